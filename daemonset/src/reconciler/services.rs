//! The reconciler's Services: the socket programs (`services.bpf.c`)
//! loaded and attached, their maps written from the cluster's Services
//! (`crate::services`), and the lease that lets them translate.

use std::{collections::BTreeSet, path::PathBuf};

use xdpcni_ebpf::{abi::SvcAddr, Services, SVC_LEASE_SECS};
use xdpcni_host::sockets::ConnectedUdp;

use super::Reconciler;

/// `IPPROTO_UDP`.
const UDP: u8 = 17;

/// What one pass of the Service writer did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServicesSynced {
    /// Frontends written or removed.
    pub writes: usize,
    /// Pod network namespaces added to and removed from translation.
    pub netns: (usize, usize),
    /// UDP (frontend, backend) pairs the maps no longer hold: the sockets
    /// translated to them are to be closed.
    pub gone: BTreeSet<(SvcAddr, SvcAddr)>,
}

impl Reconciler {
    /// Loads the Service programs with their maps pinned under `pin_dir`
    /// and attaches them to the cgroup v2 root `cgroup` through pinned
    /// links (moved to this build's programs where an earlier agent left
    /// them). From then on [`Reconciler::sync_services`] writes their maps.
    pub fn open_services(
        &mut self,
        pin_dir: &std::path::Path,
        cgroup: &std::path::Path,
    ) -> Result<(), xdpcni_ebpf::Error> {
        let mut s = Services::open(pin_dir)?;
        s.attach_pinned(pin_dir, cgroup)?;
        self.services = Some(s);
        Ok(())
    }

    /// Makes the Service maps hold `frontends` (the cluster's Services as this
    /// node's clients see them, each frontend -> its backends) for the
    /// sockets `scope` says (the node's pods', the node's own with their
    /// sources): the namespaces and sources first, so a new pod is
    /// translated as soon as its Services are, then the frontends in the
    /// writer's safe order.
    pub fn sync_services(
        &mut self,
        frontends: &[crate::services::model::Frontend],
        scope: &crate::services::Scope,
    ) -> Result<ServicesSynced, xdpcni_ebpf::Error> {
        let mut want = crate::services::wants(frontends);
        self.tc_backends_only(&mut want)?;
        let Some(s) = self.services.as_mut() else {
            return Err(xdpcni_ebpf::Error::Invalid {
                what: "services",
                why: "the Service programs are not loaded".into(),
            });
        };
        s.sync_node_src(&scope.node_src)?;
        let netns = s.sync_netns(&scope.netns, scope.node)?;
        // A LoadBalancer IP's ranges before it, the stale ones after.
        s.add_source_ranges(&scope.source_ranges)?;
        let (writes, gone) = s.sync_gone(&want)?;
        s.prune_source_ranges(&scope.source_ranges)?;
        // The maps are what the API says: the programs may translate on.
        s.renew_lease(SVC_LEASE_SECS)?;
        self.services_synced = true;
        // The uplink program where north-south frontends come in (after
        // the frontends, so its first packet finds them).
        let uplinks: Vec<u32> = scope.uplinks.iter().map(|u| u.0).collect();
        if !uplinks.is_empty() || !self.north_south_uplinks.is_empty() {
            self.north_south_uplinks = uplinks;
            self.sync_uplinks()?;
        }
        Ok(ServicesSynced {
            writes,
            netns,
            gone: gone.into_iter().collect(),
        })
    }

    /// An outside frontend's backends on this node that are not on the tc
    /// hook are left out: their replies would meet an XDP program, which
    /// does not translate them back (north-south to them stays
    /// kube-proxy's). Backends on other nodes stay (the uplink's program
    /// leaves their flows to kube-proxy).
    fn tc_backends_only(
        &self,
        want: &mut std::collections::BTreeMap<SvcAddr, xdpcni_ebpf::ServiceWant>,
    ) -> Result<(), xdpcni_ebpf::Error> {
        for (_, w) in want.iter_mut().filter(|(fe, _)| fe.is_outside()) {
            let mut keep = Vec::with_capacity(w.backends.len());
            for b in &w.backends {
                let Some(ip) = b.ip() else { continue };
                let on_tc = match self.dp.maps().endpoint(ip)? {
                    None => true,
                    Some(info) => self
                        .dp
                        .attachment(info.ifindex)?
                        .is_some_and(|a| a.mode == xdpcni_ebpf::AttachMode::Tc),
                };
                if on_tc {
                    keep.push(*b);
                }
            }
            w.backends = keep;
        }
        Ok(())
    }

    /// Of the connected UDP sockets `found` (with their namespaces), those
    /// the programs translated to a pair of `gone` (their record of the
    /// socket names that frontend and backend): not a socket that
    /// connected to the backend's own address, nor one translated from a
    /// frontend that still has it.
    pub fn translated_to_gone(
        &self,
        found: Vec<(PathBuf, ConnectedUdp)>,
        gone: &BTreeSet<(SvcAddr, SvcAddr)>,
    ) -> Result<Vec<(PathBuf, ConnectedUdp)>, xdpcni_ebpf::Error> {
        let Some(s) = self.services.as_ref() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for (ns, sock) in found {
            let backend = SvcAddr::new(sock.peer, UDP);
            if let Some(fe) = s.translated_from(sock.cookie, backend)? {
                if gone.contains(&(fe, backend)) {
                    out.push((ns, sock));
                }
            }
        }
        Ok(out)
    }

    /// Renews the lease on the Service maps, if they were written whole
    /// once (until then the programs translate nothing).
    pub fn renew_services_lease(&mut self) -> Result<bool, xdpcni_ebpf::Error> {
        match self.services.as_mut() {
            Some(s) if self.services_synced => s.renew_lease(SVC_LEASE_SECS).map(|()| true),
            _ => Ok(false),
        }
    }
}
