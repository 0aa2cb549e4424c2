//! The fast path between nodes as the routing pass keeps it: what the
//! datapath reads beside the routes (`remote_nets`, ebpf/src/node.bpf.c),
//! read back from the kernel's own routes of the agent (each route's pod
//! CIDR with the device it leaves by, that device's MTU and the route's
//! gateway: the uplink and the peer's InternalIP for host-gateway, the
//! VXLAN device and the CIDR's tunnel gateway for the tunnel), and the
//! uplink program on those devices. The routes stay the truth: an entry is
//! made from a route in place and names the next hop the kernel uses; the
//! tunnel's entries go into the agent's own VXLAN device, whose neighbour
//! and FDB entries (the same pass's) pick the VTEP as for the kernel path.
//! Before a pass changes a route, the entries it changes go
//! ([`Router::retain_remote`]), after it the entries of the routes in place
//! are written ([`Router::sync_remote`]). The datapath owner writes both.

use std::{collections::BTreeMap, net::IpAddr};

use k8s_openapi::api::core::v1::Node;
use xdpcni_ebpf::{abi::RemoteNet, RemoteCidr};
use xdpcni_host::netlink::{Netlink, NetlinkError};

use super::{sync::agent_routes, Plan, RouteError, Routed, Router, Via};

/// The Node annotation that turns the fast path between nodes off for that
/// node (`"false"`; `"true"`, or none, leaves the config's
/// `routing.fastPath`).
pub const NODE_FAST_PATH_ANNOTATION: &str = "xdpcni.io/cross-node-fast-path";

/// Why the fast path between nodes is off on this node, if it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FastPathOff {
    /// `routing.fastPath: false`.
    Config,
    /// The Node's [`NODE_FAST_PATH_ANNOTATION`] says `"false"`.
    Node,
    /// The Node's annotation has a value that is neither `"true"` nor
    /// `"false"` (off until it is fixed: the kernel path is the safe one).
    BadAnnotation,
    /// The NAT'd ports could not be written whole (a full map): replies of
    /// other nodes' Service backends would not be recognised.
    NatPorts,
}

impl FastPathOff {
    /// The label of its metric and status.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Config => "config",
            Self::Node => "node",
            Self::BadAnnotation => "bad_annotation",
            Self::NatPorts => "nat_ports",
        }
    }
}

/// Whether the fast path between nodes runs on node `me` (its Node object)
/// with `routing.fastPath` `config` and the NAT'd ports written whole
/// (`nat_synced`): `Err` says why not.
pub fn fast_path(config: bool, me: Option<&Node>, nat_synced: bool) -> Result<(), FastPathOff> {
    if !config {
        return Err(FastPathOff::Config);
    }
    let value = me
        .and_then(|n| n.metadata.annotations.as_ref())
        .and_then(|a| a.get(NODE_FAST_PATH_ANNOTATION));
    match value.map(String::as_str) {
        None | Some("true") => {}
        Some("false") => return Err(FastPathOff::Node),
        Some(_) => return Err(FastPathOff::BadAnnotation),
    }
    if !nat_synced {
        return Err(FastPathOff::NatPorts);
    }
    Ok(())
}

/// What the agent says of node `me`'s [`NODE_FAST_PATH_ANNOTATION`] when its
/// value is neither `"true"` nor `"false"` (a log line and an Event).
pub fn bad_annotation(me: &str) -> String {
    format!(
        "Node {me}: the annotation {NODE_FAST_PATH_ANNOTATION} is neither \"true\" nor \
         \"false\": the fast path between nodes is off on this node until it is"
    )
}

/// Each route's pod CIDR in `plan`, with its next hop (the peer's
/// InternalIP, or the CIDR's tunnel gateway).
fn gateways(plan: &Plan) -> BTreeMap<RemoteCidr, IpAddr> {
    plan.routes
        .keys()
        .map(|r| match r.via {
            Via::Gateway(gw) | Via::Tunnel(gw) => ((r.dst, r.prefix), gw),
        })
        .collect()
}

/// The `remote_nets` entries of the agent's routes in place that `want`
/// also holds (a route on its way out is none); `device` is the VXLAN
/// device's ifindex (its routes are the tunnel's).
pub fn remote_nets(
    nl: &mut Netlink,
    want: &Plan,
    device: Option<u32>,
) -> Result<BTreeMap<RemoteCidr, RemoteNet>, NetlinkError> {
    let mut mtus: BTreeMap<u32, Option<u32>> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for (route, oif) in agent_routes(nl, device)? {
        let (Via::Gateway(gw) | Via::Tunnel(gw), Some(oif)) = (route.via, oif) else {
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

impl Router {
    /// Before the pass changes routes: the entries whose route goes or
    /// changes its next hop go first (every entry when the fast path is
    /// off), so no program sends where the kernel no longer routes.
    pub(super) fn retain_remote(&self, want: &Plan, on: bool) -> Result<(), RouteError> {
        let Some(owner) = &self.owner else {
            return Ok(());
        };
        let keep = if on { gateways(want) } else { BTreeMap::new() };
        owner
            .run_blocking(move |r| r.retain_remote(&keep))
            .map_err(|e| RouteError::FastPath(e.to_string()))?
            .map_err(|e| RouteError::FastPath(e.to_string()))?;
        Ok(())
    }

    /// After the pass made the routes: the entries of the routes in place
    /// written (none when the fast path is off), the uplink
    /// program on their devices.
    pub(super) fn sync_remote(
        &self,
        nl: &mut Netlink,
        want: &Plan,
        on: bool,
        out: &mut Routed,
    ) -> Result<(), RouteError> {
        let Some(owner) = &self.owner else {
            return Ok(());
        };
        let nets = if on {
            remote_nets(nl, want, self.device)?
        } else {
            BTreeMap::new()
        };
        let devices = uplinks(&nets);
        let done = owner
            .run_blocking(move |r| r.sync_remote(&nets, &devices))
            .map_err(|e| RouteError::FastPath(e.to_string()))?
            .map_err(|e| RouteError::FastPath(e.to_string()))?;
        out.fast_path = Some(done);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(annotation: Option<&str>) -> Node {
        let mut meta = serde_json::json!({ "name": "me" });
        if let Some(v) = annotation {
            meta["annotations"] = serde_json::json!({ NODE_FAST_PATH_ANNOTATION: v });
        }
        serde_json::from_value(serde_json::json!({ "metadata": meta })).unwrap()
    }

    #[test]
    fn the_fast_path_between_nodes_is_on_unless_config_node_or_nat_ports_say_otherwise() {
        assert_eq!(fast_path(true, Some(&node(None)), true), Ok(()));
        assert_eq!(fast_path(true, None, true), Ok(()));
        assert_eq!(fast_path(true, Some(&node(Some("true"))), true), Ok(()));
        assert_eq!(
            fast_path(false, Some(&node(Some("true"))), true),
            Err(FastPathOff::Config)
        );
        assert_eq!(
            fast_path(true, Some(&node(Some("false"))), true),
            Err(FastPathOff::Node)
        );
        assert_eq!(
            fast_path(true, Some(&node(Some("off"))), true),
            Err(FastPathOff::BadAnnotation),
            "an unknown value is off: the kernel path is the safe one"
        );
        assert_eq!(
            fast_path(true, Some(&node(None)), false),
            Err(FastPathOff::NatPorts)
        );
    }

    #[test]
    fn host_gateway_and_tunnel_routes_are_fast_path_destinations_by_their_own_next_hop() {
        let mut plan = Plan::default();
        let gw: IpAddr = "192.0.2.2".parse().unwrap();
        let tgw: IpAddr = "10.1.2.0".parse().unwrap();
        for (dst, via) in [
            ("10.1.1.0", Via::Gateway(gw)),
            ("10.1.2.0", Via::Tunnel(tgw)),
        ] {
            plan.routes.insert(
                super::super::NodeRoute {
                    dst: dst.parse().unwrap(),
                    prefix: 24,
                    via,
                },
                "n".into(),
            );
        }
        let g = gateways(&plan);
        assert_eq!(g.len(), 2);
        assert_eq!(g.get(&("10.1.1.0".parse().unwrap(), 24)), Some(&gw));
        assert_eq!(
            g.get(&("10.1.2.0".parse().unwrap(), 24)),
            Some(&tgw),
            "a tunnel route's entry is kept while its tunnel gateway stays"
        );
    }
}
