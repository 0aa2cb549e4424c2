//! Routing to the other nodes' pods, in the main table and on the VXLAN
//! device the agent owns ([`xdpcni_host::overlay`] decides the modes, the
//! device's name, the MTU and the VTEP; this module keeps the kernel's
//! entries equal to the Node objects).
//!
//! Per other node and pod CIDR, one route: `via <InternalIP>` (host-gateway)
//! or `via <gateway> dev xdpcni.vxlan` (the tunnel: the gateway is
//! [`tunnel_gateway`], with a permanent neighbour mapping it to the node's
//! VTEP MAC and an FDB entry mapping that MAC to its VTEP address). Every route carries the agent's route protocol, so the agent only
//! ever touches routes it made; everything on the device is the agent's.
//!
//! A node that publishes no VTEP (its agent runs host-gateway, or an older
//! release, or has not started) is reached by host-gateway in every mode:
//! during a `helm upgrade` between modes, each pair of nodes keeps a path.

mod device;
mod fast;
mod sync;

pub use device::{ensure_device, Device};
pub use fast::{
    bad_annotation, fast_path, remote_nets, uplinks, FastPathOff, NODE_FAST_PATH_ANNOTATION,
};
pub use sync::sync;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use xdpcni_host::{
    netlink::{Netlink, NetlinkError},
    overlay::{
        remove_device, tunnel_gateway, MacAddr, RoutingMode, Underlay, Vtep, DEVICE,
        VTEP_ANNOTATION,
    },
};

use crate::{config::Routing, owner::Owner, reconciler::RemoteDone};

pub use xdpcni_host::overlay::ROUTE_PROTOCOL;

/// How a route reaches another node's pod CIDR.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Via {
    /// Host-gateway: the node's InternalIP, on this node's L2 segment.
    Gateway(IpAddr),
    /// The tunnel: the CIDR's gateway address, on link on the VXLAN device.
    Tunnel(IpAddr),
}

/// A route to another node's pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NodeRoute {
    /// Pod CIDR address.
    pub dst: IpAddr,
    /// Pod CIDR prefix length.
    pub prefix: u8,
    /// The next hop.
    pub via: Via,
}

impl NodeRoute {
    fn cidr(&self) -> String {
        format!("{}/{}", self.dst, self.prefix)
    }
}

/// What this node needs for the others.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Each route and the node it leads to.
    pub routes: BTreeMap<NodeRoute, String>,
    /// FDB entries on the device: VTEP MAC -> VTEP address.
    pub fdb: BTreeSet<(MacAddr, IpAddr)>,
    /// Neighbours on the device: a CIDR's gateway -> its node's VTEP MAC.
    pub neighbours: BTreeSet<(IpAddr, MacAddr)>,
    /// Nodes whose VTEP annotation cannot be read (they get host-gateway).
    pub bad_vteps: Vec<(String, String)>,
}

impl Plan {
    /// How many routes go (host-gateway, through the tunnel).
    fn counts(&self) -> (usize, usize) {
        let tunnel = self
            .routes
            .keys()
            .filter(|r| matches!(r.via, Via::Tunnel(_)))
            .count();
        (self.routes.len() - tunnel, tunnel)
    }
}

/// The InternalIPs of `node`, in the order its status lists them.
pub fn internal_ips(node: &Node) -> Vec<IpAddr> {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .map(|a| {
            a.iter()
                .filter(|a| a.type_ == "InternalIP")
                .filter_map(|a| a.address.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The pod CIDRs of `node`, as networks.
pub fn pod_cidrs(node: &Node) -> Vec<IpNet> {
    let Some(spec) = &node.spec else {
        return Vec::new();
    };
    let mut cidrs: Vec<String> = spec.pod_cidrs.clone().unwrap_or_default();
    if let Some(c) = &spec.pod_cidr {
        if !cidrs.contains(c) {
            cidrs.push(c.clone());
        }
    }
    let mut out: Vec<IpNet> = cidrs
        .iter()
        .filter_map(|c| c.parse::<IpNet>().ok())
        .map(|n| n.trunc())
        .collect();
    out.dedup();
    out
}

/// The VTEP `node` publishes, if any: `Err` names a value that cannot be read.
pub fn published_vtep(node: &Node) -> Option<Result<Vtep, String>> {
    node.metadata
        .annotations
        .as_ref()?
        .get(VTEP_ANNOTATION)
        .map(|v| Vtep::from_annotation(v))
}

/// This node's side of the tunnel, when it has one.
#[derive(Clone, Debug)]
pub struct Local<'a> {
    /// This node's VTEP (its device is up).
    pub vtep: Vtep,
    /// The underlay interface, whose subnets `auto` reaches directly.
    pub underlay: &'a Underlay,
}

/// The routes, neighbours and FDB entries this node needs in `mode`;
/// `local` is this node's tunnel (None: host-gateway only).
pub fn plan(nodes: &[Arc<Node>], me: &str, mode: RoutingMode, local: Option<&Local<'_>>) -> Plan {
    let mut out = Plan::default();
    for n in nodes {
        let name = n.metadata.name.clone().unwrap_or_default();
        if name == me {
            continue;
        }
        let internal = internal_ips(n);
        let vtep = match published_vtep(n) {
            Some(Ok(v)) => Some(v),
            Some(Err(why)) => {
                out.bad_vteps.push((name.clone(), why));
                None
            }
            None => None,
        };
        // The tunnel reaches this node if both ends have one, of one family.
        let tunnel = match (mode, local, vtep) {
            (RoutingMode::HostGateway, _, _) => None,
            (_, Some(l), Some(v)) if l.vtep.address.is_ipv4() == v.address.is_ipv4() => {
                Some((l, v))
            }
            _ => None,
        };
        for cidr in pod_cidrs(n) {
            let dst = cidr.addr();
            let gateway = internal
                .iter()
                .copied()
                .find(|v| v.is_ipv4() == dst.is_ipv4());
            let via = match (tunnel, gateway) {
                // auto: the nodes of this node's own subnet directly.
                (Some((l, _)), Some(gw))
                    if mode == RoutingMode::Auto && l.underlay.on_subnet(gw) =>
                {
                    Via::Gateway(gw)
                }
                (Some((_, v)), _) => {
                    let gw = tunnel_gateway(dst, v.mac);
                    out.fdb.insert((v.mac, v.address));
                    out.neighbours.insert((gw, v.mac));
                    Via::Tunnel(gw)
                }
                (None, Some(gw)) => Via::Gateway(gw),
                (None, None) => continue,
            };
            out.routes.insert(
                NodeRoute {
                    dst,
                    prefix: cidr.prefix_len(),
                    via,
                },
                name.clone(),
            );
        }
    }
    out
}

/// A host-gateway route the kernel refused: its next hop is not on this
/// node's L2 segment.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Unreachable {
    /// The node the route leads to.
    pub node: String,
    /// Its pod CIDR.
    pub cidr: String,
    /// The next hop (its InternalIP).
    pub via: IpAddr,
    /// What the kernel said.
    pub why: String,
    /// This node tunnels, and the peer has published no VTEP yet (its
    /// agent is starting, runs `hostGateway` or an older release): it is
    /// reached through the tunnel once it does.
    pub awaiting_vtep: bool,
}

impl std::fmt::Display for Unreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.awaiting_vtep {
            return write!(
                f,
                "node {}'s pods ({}) are unreachable until it publishes its VXLAN endpoint \
                 ({VTEP_ANNOTATION}: its agent is not running, runs routing.mode hostGateway \
                 or an older release): its InternalIP {} is not on this node's L2 segment \
                 (the kernel refused the host-gateway route: {})",
                self.node, self.cidr, self.via, self.why
            );
        }
        write!(
            f,
            "node {}'s pods ({}) need next hop {} (its InternalIP), which is not on this \
             node's L2 segment (the kernel refused the route: {}): host-gateway routing \
             cannot reach them; set routing.mode to vxlan or auto",
            self.node, self.cidr, self.via, self.why
        )
    }
}

/// What a [`sync`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Entries added or replaced (routes, neighbours, FDB).
    pub added: usize,
    /// Entries removed.
    pub removed: usize,
    /// Host-gateway routes the kernel refused.
    pub unreachable: Vec<Unreachable>,
}

/// How long a node that left the tunnel (routing.mode hostGateway) keeps
/// its device: the other nodes take its VTEP annotation away from their
/// routes within a watch event, and until then their frames still arrive.
pub const RETIRE_AFTER: Duration = Duration::from_secs(10);

/// A failure of a routing pass.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// A route netlink request (it names itself).
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    /// The blocking task of a pass failed.
    #[error("the routing task failed: {0}")]
    Task(String),
    /// The VXLAN device was gone right after it was made.
    #[error("{DEVICE} was gone right after it was made")]
    Vanished,
    /// The device's transmit checksum offload could not be set.
    #[error("setting transmit checksum offload on {DEVICE}: {0}")]
    Offload(std::io::Error),
    /// The datapath refused the fast path between nodes' entries (the
    /// pass stops before the routes change; the next one retries).
    #[error("the fast path between nodes: {0}")]
    FastPath(String),
}

/// What one routing pass found and did.
#[derive(Clone, Debug, Default)]
pub struct Routed {
    /// The VTEP this node should publish on its Node (None: none).
    pub vtep: Option<Vtep>,
    /// Set when the kernel's entries were read and made right.
    pub report: Option<Report>,
    /// Routes in place: (host-gateway, tunnel).
    pub routes: (usize, usize),
    /// Host-gateway routes refused that were not refused at the last pass.
    pub new_unreachable: Vec<Unreachable>,
    /// Every route refused now.
    pub unreachable: usize,
    /// What the tunnel lacks, once per change (no interface holds the
    /// InternalIP, a Node's VTEP annotation cannot be read).
    pub warnings: Vec<String>,
    /// Whether the device was made, or removed, in this pass.
    pub device_changed: bool,
    /// Why the fast path between nodes is off, if it is.
    pub fast_path_off: Option<FastPathOff>,
    /// What the pass wrote of the fast path between nodes (None: the
    /// entries were not looked at: nothing changed).
    pub fast_path: Option<RemoteDone>,
}

/// The routing state of this node's agent between passes, with its netlink
/// socket.
pub struct Router {
    routing: Routing,
    /// Who writes the fast path between nodes (None: routes only).
    owner: Option<Owner>,
    /// What the last pass left of the fast path between nodes: None when
    /// on, else why it is off (the status follows each change).
    fast_off: Option<Option<FastPathOff>>,
    netlink: Option<Netlink>,
    device: Option<u32>,
    last: Option<(Plan, Instant)>,
    retire_at: Option<Instant>,
    reported: BTreeSet<(String, IpAddr)>,
    refused: usize,
    warned: BTreeSet<String>,
}

impl Router {
    /// A router for `routing`, with nothing in place yet, that keeps the
    /// fast path between nodes through `owner` (None: routes only).
    pub fn new(routing: Routing, owner: Option<Owner>) -> Self {
        Self {
            routing,
            owner,
            fast_off: None,
            netlink: None,
            device: None,
            last: None,
            retire_at: None,
            reported: BTreeSet::new(),
            refused: 0,
            warned: BTreeSet::new(),
        }
    }

    /// The routing it runs.
    pub fn routing(&self) -> Routing {
        self.routing
    }

    /// A router like this one with nothing in place (the next pass reads
    /// the kernel again).
    pub fn fresh(&self) -> Self {
        Self::new(self.routing, self.owner.clone())
    }

    /// Whether a device is waiting to be retired (the node pass must come
    /// back for it even when nothing else changes).
    pub fn retiring(&self) -> bool {
        self.retire_at.is_some()
    }

    /// Forgets what was put in place: the next pass reads the kernel again.
    pub fn invalidate(&mut self) {
        self.last = None;
        self.fast_off = None;
    }

    /// [`Router::pass`] on a blocking thread (its netlink requests are
    /// syscalls): the router comes back with the outcome (a fresh one, which
    /// reads the kernel again, if the thread failed).
    pub async fn pass_blocking(
        mut self,
        nodes: Vec<Arc<Node>>,
        me: String,
        resync: Duration,
        nat_synced: bool,
    ) -> (Self, Result<Routed, RouteError>) {
        let fresh = self.fresh();
        let done = tokio::task::spawn_blocking(move || {
            let outcome = self.pass(&nodes, &me, resync, nat_synced);
            (self, outcome)
        })
        .await;
        done.unwrap_or_else(|e| (fresh, Err(RouteError::Task(e.to_string()))))
    }

    /// One pass over `nodes` for node `me`. The kernel's entries are read
    /// and made right when the Nodes ask for something else than the last
    /// pass put in place, or `resync` after it (an entry removed by hand
    /// comes back then). A failure closes the netlink socket, and the next
    /// pass opens another and reads everything again.
    ///
    /// The fast path between nodes follows the routes in the same pass
    /// (unless [`fast_path`] says it is off; `nat_synced`: the NAT'd ports
    /// were written whole): an entry whose route goes or changes goes
    /// before the routes change, the entries of the routes in place are
    /// written after.
    pub fn pass(
        &mut self,
        nodes: &[Arc<Node>],
        me: &str,
        resync: Duration,
        nat_synced: bool,
    ) -> Result<Routed, RouteError> {
        let mut nl = match self.netlink.take() {
            Some(nl) => nl,
            None => Netlink::new()?,
        };
        let outcome = self.pass_with(&mut nl, nodes, me, resync, nat_synced);
        match outcome {
            Ok(_) => self.netlink = Some(nl),
            Err(_) => self.invalidate(),
        }
        outcome
    }

    fn pass_with(
        &mut self,
        nl: &mut Netlink,
        nodes: &[Arc<Node>],
        me: &str,
        resync: Duration,
        nat_synced: bool,
    ) -> Result<Routed, RouteError> {
        let mut out = Routed::default();
        let mine = nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(me));
        out.fast_path_off = fast_path(self.routing.fast_path, mine.map(|n| &**n), nat_synced).err();
        let fast_on = self.owner.is_some() && out.fast_path_off.is_none();
        let own_cidrs = mine.map(|n| pod_cidrs(n)).unwrap_or_default();
        let address = mine.and_then(|n| internal_ips(n).into_iter().next());
        let mut warnings = BTreeSet::new();
        let underlay = self.underlay(nl, me, address, &mut warnings)?;
        let local = underlay.as_ref().map(|u| Local {
            vtep: Vtep::for_address(u.address),
            underlay: u,
        });
        out.vtep = local.as_ref().map(|l| l.vtep);
        let want = plan(nodes, me, self.routing.mode, local.as_ref());
        for (node, why) in &want.bad_vteps {
            warnings.insert(format!("Node {node}: {why} (reached by host-gateway)"));
        }
        match out.fast_path_off {
            Some(FastPathOff::BadAnnotation) => {
                warnings.insert(fast::bad_annotation(me));
            }
            Some(FastPathOff::NatPorts) => {
                warnings.insert(
                    "the NAT'd ports could not be written whole: the fast path between \
                     nodes is off until they are"
                        .into(),
                );
            }
            _ => {}
        }
        out.warnings = warnings.difference(&self.warned).cloned().collect();
        self.warned = warnings;
        out.routes = want.counts();
        if local.is_none() {
            out.device_changed = self.retire_device(nl)?;
        } else {
            self.retire_at = None;
        }
        let fresh = self
            .last
            .as_ref()
            .is_some_and(|(had, at)| *had == want && at.elapsed() < resync)
            && self.fast_off == Some(out.fast_path_off);
        if fresh && (local.is_none() || self.device.is_some()) {
            out.unreachable = self.refused;
            out.routes.0 -= out.unreachable.min(out.routes.0);
            return Ok(out);
        }
        // Before a route changes: its entry goes.
        self.retain_remote(&want, fast_on)?;
        self.device = match (&local, &underlay) {
            (Some(l), Some(u)) => {
                let d = ensure_device(nl, &self.routing, u, &l.vtep, &own_cidrs)?;
                out.device_changed |= d.created;
                Some(d.index)
            }
            // A device being retired keeps its entries until it goes.
            _ => None,
        };
        let report = sync(nl, &want, self.device)?;
        self.note_refused(&mut out, report);
        // After: the entries of the routes in place.
        self.sync_remote(nl, &want, fast_on, &mut out)?;
        self.last = Some((want, Instant::now()));
        self.fast_off = Some(out.fast_path_off);
        Ok(out)
    }

    /// The underlay the tunnel runs over (the interface holding this node's
    /// first InternalIP `address`), when the mode tunnels and there is one;
    /// what is missing goes to `warnings`.
    fn underlay(
        &self,
        nl: &mut Netlink,
        me: &str,
        address: Option<IpAddr>,
        warnings: &mut BTreeSet<String>,
    ) -> Result<Option<Underlay>, RouteError> {
        if !self.routing.mode.tunnels() {
            return Ok(None);
        }
        let Some(ip) = address else {
            warnings.insert(format!(
                "Node {me} has no InternalIP: no VXLAN tunnel, host-gateway routes only"
            ));
            return Ok(None);
        };
        let u = Underlay::find(nl, ip)?;
        if u.is_none() {
            warnings.insert(format!(
                "no interface of this node holds its InternalIP {ip}: no VXLAN \
                 tunnel, host-gateway routes only"
            ));
        }
        Ok(u)
    }

    /// Leaving the tunnel: the device goes once the others had time to see
    /// this node's VTEP go ([`RETIRE_AFTER`]); whether it went now.
    fn retire_device(&mut self, nl: &mut Netlink) -> Result<bool, RouteError> {
        match self.retire_at {
            Some(at) if Instant::now() >= at => {
                let removed = remove_device(nl)?;
                self.device = None;
                self.retire_at = None;
                Ok(removed)
            }
            Some(_) => Ok(false),
            None => {
                if nl.link_by_name(DEVICE)?.is_some() {
                    self.retire_at = Some(Instant::now() + RETIRE_AFTER);
                }
                Ok(false)
            }
        }
    }

    /// The refused routes of `report` into `out`: how many, and those not
    /// refused at the last pass (each is told once).
    fn note_refused(&mut self, out: &mut Routed, report: Report) {
        let now: BTreeSet<(String, IpAddr)> = report
            .unreachable
            .iter()
            .map(|u| (u.node.clone(), u.via))
            .collect();
        out.new_unreachable = report
            .unreachable
            .iter()
            .filter(|u| !self.reported.contains(&(u.node.clone(), u.via)))
            .cloned()
            .collect();
        out.unreachable = report.unreachable.len();
        out.routes.0 -= out.unreachable.min(out.routes.0);
        self.reported = now;
        self.refused = out.unreachable;
        out.report = Some(report);
    }
}

#[cfg(test)]
mod tests;
