//! The reconciler's part of the fast path between nodes: `remote_nets` and
//! the uplink programs, written in the order a routing pass needs them
//! ([`crate::routes`] asks, through the datapath owner).

use std::{collections::BTreeMap, net::IpAddr};

use tracing::info;
use xdpcni_ebpf::{abi::RemoteNet, RemoteCidr, RemoteSynced};

use super::Reconciler;

/// What [`Reconciler::sync_remote`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RemoteDone {
    /// The `remote_nets` entries written and removed.
    pub nets: RemoteSynced,
    /// Uplink programs attached (or swapped to this build's).
    pub attached: usize,
    /// Uplink programs detached.
    pub detached: usize,
    /// Entries in place now.
    pub entries: usize,
    /// Devices the uplink program runs on now (ifindexes).
    pub uplinks: Vec<u32>,
}

impl Reconciler {
    /// The uplink program on the union of the devices the routes' pass and
    /// the Service writer want it on, and on no other: (attached or
    /// swapped, detached). Until the routes' pass has said which it wants
    /// (an agent starting), nothing is detached: the links an earlier agent
    /// left for other nodes' pods stay.
    pub(super) fn sync_uplinks(&mut self) -> Result<(usize, usize), xdpcni_ebpf::Error> {
        let Some(remote) = &self.remote_uplinks else {
            let mut attached = 0;
            for ifindex in self.north_south_uplinks.clone() {
                attached += usize::from(self.dp.attach_uplink(ifindex)?);
            }
            return Ok((attached, 0));
        };
        let mut all = remote.clone();
        all.extend(&self.north_south_uplinks);
        all.sort_unstable();
        all.dedup();
        self.dp.sync_uplinks(&all)
    }

    /// Before the routes change: removes every entry whose CIDR `gateways`
    /// does not route through the same next hop (its route goes, or goes
    /// elsewhere), so no program sends where the kernel will not. How many
    /// went.
    pub fn retain_remote(
        &mut self,
        gateways: &BTreeMap<RemoteCidr, IpAddr>,
    ) -> Result<usize, xdpcni_ebpf::Error> {
        self.dp.retain_remote_nets(|cidr, have| {
            have.nexthop().is_some() && gateways.get(&cidr).copied() == have.nexthop()
        })
    }

    /// After the routes changed: `remote_nets` made equal to `want` (read
    /// back from the routes in place), then the uplink program on each
    /// device the entries name and on no other.
    pub fn sync_remote(
        &mut self,
        want: &BTreeMap<RemoteCidr, RemoteNet>,
        uplinks: &[u32],
    ) -> Result<RemoteDone, xdpcni_ebpf::Error> {
        let nets = self.dp.sync_remote_nets(want)?;
        self.remote_uplinks = Some(uplinks.to_vec());
        let (attached, detached) = self.sync_uplinks()?;
        let done = RemoteDone {
            nets,
            attached,
            detached,
            entries: want.len(),
            uplinks: uplinks.to_vec(),
        };
        if (nets.written, nets.removed, attached, detached) != (0, 0, 0, 0) {
            info!(
                written = nets.written,
                removed = nets.removed,
                attached,
                detached,
                entries = done.entries,
                "fast path between nodes updated"
            );
        }
        Ok(done)
    }
}
