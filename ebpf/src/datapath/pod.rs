//! A pod's fast-path state, and the only verbs that write it.
//!
//! A pod's state in the datapath is, per host veth: its counter slot
//! (`port_slots`/`slot_owners`), its hold links, its devmap entry
//! (`tx_ports`), the endpoint records of its addresses (`endpoints4/6`) and
//! its datapath link (XDP or tc). The programs rely on an order between them
//! that these verbs alone keep, so that no binary has to know it:
//!
//! - the devmap entry is there before the first endpoint record points at
//!   the veth, and goes only after the last one is gone (the tc program
//!   redirects to a record's ifindex without looking it up in `tx_ports`);
//! - the records are there before a datapath link is made (the program drops
//!   sources it has no record of);
//! - a pod leaving the fast path is flagged kernel-only before its link goes
//!   (no program redirects to it while it detaches);
//! - a hold's counter slot is claimed before the hold links, so its drops
//!   count as the pod's own.
//!
//! The map-level writes of `maps/writes.rs` are private to this crate: the CNI
//! plugin holds a new pod ([`Datapath::hold_pod`]) and forgets it at DEL
//! ([`Datapath::forget_veth`]); the agent does everything else through the
//! verbs below. Tests that build a datapath by hand use
//! `crate::testing` (feature `test-objects`), which no product binary has.

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    net::IpAddr,
};

use tracing::info;

use super::{AttachMode, Attachment, Datapath, L4Proto};
use crate::{
    abi::{EndpointInfo, EP_KERNEL_ONLY, MAX_CPUS},
    Error, Result,
};

/// cpumap queue size of a CPU enabled for a pod.
pub const CPUMAP_QUEUE: u32 = 2048;

/// What [`Datapath::sync_nat_ports`] changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatSync {
    /// Ports added.
    pub added: usize,
    /// Ports removed.
    pub removed: usize,
    /// Endpoint records whose no-NAT flag was repaired.
    pub repaired: usize,
}

/// What [`Datapath::collect`] removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Collected {
    /// Link pins of veths that are gone.
    pub links: Vec<u32>,
    /// Endpoint records of veths that are gone, with their devmap entries and
    /// counters.
    pub endpoints: Vec<(IpAddr, u32)>,
}

impl Collected {
    /// How many things were collected.
    pub fn len(&self) -> usize {
        self.links.len() + self.endpoints.len()
    }

    /// Whether nothing was.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Datapath {
    /// Holds the pod of host veth `ifindex` (named `ifname` in the calling
    /// thread's network namespace): nothing but ARP and neighbour discovery
    /// reaches or leaves it until [`Datapath::release_hold`]. The records of
    /// `ips` are flagged kernel-only first (the fast path would carry the
    /// pod's frames past the hold), then its counter slot is claimed (the
    /// hold's drops count as the pod's), then the hold links come. A new
    /// pod (CNI ADD) has no records yet. Idempotent; whether a link was
    /// attached.
    pub fn hold_pod(&mut self, ifindex: u32, ifname: &str, ips: &[IpAddr]) -> Result<bool> {
        self.flag_kernel_only(ips)?;
        self.maps.claim_slot(ifindex)?;
        self.hold(ifindex, ifname)
    }

    /// Ends the hold of host veth `ifindex`; whether there was one.
    pub fn release_hold(&mut self, ifindex: u32) -> Result<bool> {
        self.release(ifindex)
    }

    /// Makes the records of `ips` say `info` for host veth `ifindex`
    /// (`info.ifindex` must be it), the veth's devmap entry first. Records
    /// that already say it are left alone; whether anything was written.
    pub fn set_endpoint(
        &mut self,
        ifindex: u32,
        ips: &[IpAddr],
        info: &EndpointInfo,
    ) -> Result<bool> {
        if info.ifindex != ifindex {
            return Err(Error::Invalid {
                what: "endpoint",
                why: format!("record for ifindex {} given for {ifindex}", info.ifindex),
            });
        }
        let mut changed = false;
        if !self.maps.has_tx_port(ifindex)? {
            self.maps.add_tx_port(ifindex)?;
            changed = true;
        }
        for ip in ips {
            let same = self
                .maps
                .endpoint(*ip)?
                .is_some_and(|have| have.same_policy(info));
            if !same {
                self.maps.upsert_endpoint(*ip, info)?;
                changed = true;
            }
        }
        Ok(changed)
    }

    /// Attaches the datapath to host veth `ifindex` in `mode` (see
    /// [`Datapath::attach`]). Refused while the veth has no devmap entry:
    /// its records must be written first ([`Datapath::set_endpoint`]).
    pub fn switch_mode(&mut self, ifindex: u32, mode: AttachMode) -> Result<Attachment> {
        if !self.maps.has_tx_port(ifindex)? {
            return Err(Error::Invalid {
                what: "mode switch",
                why: format!("ifindex {ifindex} has no endpoint records yet"),
            });
        }
        self.attach(ifindex, mode)
    }

    /// Flags the records of `ips` kernel-only at once (a policy now isolates
    /// their pod): no program redirects to or from them from here on, ahead
    /// of the reconcile that detaches the pod's link
    /// ([`Datapath::make_kernel_only`]).
    pub fn flag_kernel_only(&mut self, ips: &[IpAddr]) -> Result<()> {
        for ip in ips {
            self.maps.flag_kernel_only(*ip)?;
        }
        Ok(())
    }

    /// Takes the pod of host veth `ifindex` off the fast path both ways:
    /// its records say `info` flagged kernel-only (no program redirects to
    /// or from it), then its datapath link goes. Returns (records changed,
    /// link detached).
    pub fn make_kernel_only(
        &mut self,
        ifindex: u32,
        ips: &[IpAddr],
        info: &EndpointInfo,
    ) -> Result<(bool, bool)> {
        let info = EndpointInfo {
            flags: EP_KERNEL_ONLY,
            ..*info
        };
        let changed = self.set_endpoint(ifindex, ips, &info)?;
        let detached = self.detach(ifindex)?;
        Ok((changed, detached))
    }

    /// Leaves the pod of host veth `ifindex` on kernel routing with no
    /// records at all (a map had no room for them): its link goes, then
    /// every record pointing at it. Its devmap entry and counter slot stay.
    pub fn drop_records(&mut self, ifindex: u32) -> Result<Vec<IpAddr>> {
        self.detach(ifindex)?;
        self.maps.remove_endpoints_of(ifindex)
    }

    /// Forgets everything of host veth `ifindex` (its pod is deleted): the
    /// datapath link and the hold, every endpoint record pointing at it
    /// (named anywhere or not), then its devmap entry and counters. `step`
    /// is called after each stage by name (`detached`, `endpoints`), for
    /// crash tests. Idempotent.
    pub fn forget_veth(&mut self, ifindex: u32, step: &mut dyn FnMut(&str)) -> Result<()> {
        self.detach(ifindex)?;
        self.release(ifindex)?;
        step("detached");
        self.maps.remove_endpoints_of(ifindex)?;
        step("endpoints");
        self.maps.remove_tx_port(ifindex)?;
        self.maps.remove_counters(ifindex)
    }

    /// Forgets the records of `ips` that still point at host veth `ifindex`
    /// and nothing else: the ifindex is another pod's now (a late DEL).
    pub fn forget_addresses(&mut self, ifindex: u32, ips: &[IpAddr]) -> Result<()> {
        for ip in ips {
            if self
                .maps
                .endpoint(*ip)?
                .is_some_and(|e| e.ifindex == ifindex)
            {
                self.maps.remove_endpoint(*ip)?;
            }
        }
        Ok(())
    }

    /// Enables the cpumap CPUs of `cpu_mask` that are not enabled yet.
    pub fn enable_cpus(&mut self, cpu_mask: u64) -> Result<()> {
        for cpu in (0..MAX_CPUS).filter(|c| cpu_mask & (1 << c) != 0) {
            if self.maps.cpu_queue_size(cpu)?.is_none() {
                self.enable_cpu(cpu, CPUMAP_QUEUE)?;
            }
        }
        Ok(())
    }

    /// Makes the NAT'd ports equal `want`: the (address, protocol, port) of
    /// pods whose replies conntrack may translate (this node's, and other
    /// nodes' Service backends for the fast path between nodes). Removals
    /// go first; additions clear their address's no-NAT flag before the
    /// port is listed; then every record's flag is made to agree with the
    /// list (one scan per batch, which also repairs a record written while a
    /// change raced it).
    pub fn sync_nat_ports(&mut self, want: &BTreeSet<(IpAddr, L4Proto, u16)>) -> Result<NatSync> {
        let have: BTreeSet<_> = self.maps.nat_ports()?.into_iter().collect();
        let mut out = NatSync::default();
        // Removals first: a map full of entries no longer wanted still
        // takes the new ones.
        for (ip, proto, port) in have.difference(want) {
            self.maps.remove_nat_port(*ip, *proto, *port)?;
            out.removed += 1;
        }
        for (ip, proto, port) in want.difference(&have) {
            self.maps.add_nat_port(*ip, *proto, *port)?;
            out.added += 1;
        }
        out.repaired = self.maps.refresh_nat_flags()?;
        Ok(out)
    }

    /// Makes the policy gate the CNI reads at ADD list exactly `namespaces`
    /// (name -> how many policies), complete; when the list cannot be
    /// written it is marked incomplete (every new pod held) and the error
    /// returned. Whether anything changed.
    pub fn set_policy_namespaces(&mut self, namespaces: &BTreeMap<String, u32>) -> Result<bool> {
        let gate = self.maps.policy_gate()?;
        if gate.complete == 1 && self.maps.policy_namespaces()? == *namespaces {
            return Ok(false);
        }
        self.maps.write_policy_gate(namespaces)?;
        Ok(true)
    }

    /// Node-wide collection: link pins whose veth is gone, and the records
    /// (then devmap entries and counters) of veths that are gone and that
    /// `claimed` does not name (pods whose DEL never came). `exists` says
    /// whether a device with an ifindex is there.
    pub fn collect(
        &mut self,
        claimed: &HashSet<u32>,
        exists: &dyn Fn(u32) -> bool,
    ) -> Result<Collected> {
        let mut out = Collected {
            links: self.gc_links()?,
            ..Collected::default()
        };
        let mut gone = BTreeSet::new();
        for (ip, ep) in self.maps.endpoints()? {
            if claimed.contains(&ep.ifindex) || exists(ep.ifindex) {
                continue;
            }
            info!(%ip, ifindex = ep.ifindex, "removing the endpoint of a vanished veth");
            self.maps.remove_endpoint(ip)?;
            gone.insert(ep.ifindex);
            out.endpoints.push((ip, ep.ifindex));
        }
        // After the last record pointing at each: the devmap entry, counters.
        for ifindex in gone {
            self.maps.remove_tx_port(ifindex)?;
            self.maps.remove_counters(ifindex)?;
        }
        Ok(out)
    }
}
