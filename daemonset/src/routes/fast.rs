//! What the datapath's fast path between nodes reads beside the routes
//! (`remote_nets`, ebpf/src/node.bpf.h): read back from the kernel's own
//! routes of the agent, each host-gateway route's pod CIDR with the device
//! it leaves by, that device's MTU and the route's gateway. The routes
//! stay the truth: an entry is made from a route in place and names the
//! next hop the kernel uses.

use std::collections::BTreeMap;

use xdpcni_ebpf::{abi::RemoteNet, RemoteCidr};
use xdpcni_host::netlink::{Netlink, NetlinkError};

use super::{sync::agent_routes, Plan, Via};

/// The `remote_nets` entries of the agent's routes in place that `want`
/// also holds (a route on its way out is none); `device` is the VXLAN
/// device's ifindex, whose routes the fast path does not carry (yet: the
/// kernel's tunnel takes them).
pub fn remote_nets(
    nl: &mut Netlink,
    want: &Plan,
    device: Option<u32>,
) -> Result<BTreeMap<RemoteCidr, RemoteNet>, NetlinkError> {
    let mut mtus: BTreeMap<u32, Option<u32>> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for (route, oif) in agent_routes(nl, device)? {
        let (Via::Gateway(gw), Some(oif)) = (route.via, oif) else {
            continue;
        };
        if !want.routes.contains_key(&route) {
            continue;
        }
        let mtu = match mtus.get(&oif) {
            Some(m) => *m,
            None => {
                let m = nl.link_by_index(oif)?.map(|l| l.mtu);
                mtus.insert(oif, m);
                m
            }
        };
        if let Some(mtu) = mtu {
            out.insert((route.dst, route.prefix), RemoteNet::gateway(oif, mtu, gw));
        }
    }
    Ok(out)
}

/// The devices the entries leave by: where the uplink program runs.
pub fn uplinks(nets: &BTreeMap<RemoteCidr, RemoteNet>) -> Vec<u32> {
    let mut v: Vec<u32> = nets.values().map(|n| n.ifindex).collect();
    v.sort_unstable();
    v.dedup();
    v
}
