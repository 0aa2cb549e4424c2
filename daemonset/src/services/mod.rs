//! Services translated at the socket for this node's pods (issue 34; see
//! ebpf/src/services.bpf.c): what the cluster's Services mean for this
//! node ([`model`]), as the Service maps' writer wants it ([`wants`]),
//! which sockets are translated ([`scope`]: the node's pods', and the
//! node's own with the source kube-proxy gives them), and the
//! connected UDP sockets a gone backend leaves ([`connected_to`], [`close`]),
//! and the health check node ports of local load balancers ([`health`]).

pub mod health;
pub mod model;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::{Path, PathBuf},
};

use ipnet::IpNet;
use tracing::{debug, warn};
use xdpcni_ebpf::{
    abi::SvcAddr, abi::SVC_AFFINITY, abi::SVC_EXT_LOCAL, abi::SVC_NODE_ONLY, ServiceWant,
};
use xdpcni_host::{
    netlink::Netlink,
    netns::in_netns,
    sockets::{self, ConnectedUdp},
    state::Record,
};

use self::model::{Frontend, FrontendKind, NodeMasquerade};
use crate::config::ServicesConfig;

/// The writer's wants: each frontend with its backends keyed as the
/// programs read them. A frontend in two Services (never, for cluster IPs)
/// keeps the first.
pub fn wants(frontends: &[Frontend]) -> BTreeMap<SvcAddr, ServiceWant> {
    let mut out = BTreeMap::new();
    for f in frontends {
        let p = f.proto.number();
        let key = if f.outside {
            SvcAddr::outside(f.addr, p)
        } else {
            SvcAddr::new(f.addr, p)
        };
        out.entry(key).or_insert_with(|| ServiceWant {
            flags: if f.affinity.is_some() {
                SVC_AFFINITY
            } else {
                0
            } | if f.outside {
                if f.external_local {
                    SVC_EXT_LOCAL
                } else {
                    0
                }
            } else if f.kind == FrontendKind::ClusterIp {
                0
            } else {
                SVC_NODE_ONLY
            },
            affinity_timeout: f.affinity.unwrap_or(0),
            backends: f.backends.iter().map(|b| SvcAddr::new(*b, p)).collect(),
        });
    }
    out
}

/// The node's live pods as the Service programs scope them: each pod's
/// network namespace cookie with the pod's own addresses (a backend that is
/// the caller itself is left to kube-proxy).
pub type PodNamespaces = BTreeMap<u64, BTreeSet<IpAddr>>;

/// The network namespaces of this node's live pods, with their addresses:
/// each cookie from its record, or read from its namespace where an older
/// plugin wrote none (skipped when that namespace is gone: its pod is going).
pub fn pod_netns(records: &[Record]) -> PodNamespaces {
    let mut out = PodNamespaces::new();
    for r in records.iter().filter(|r| !r.deleting) {
        let cookie = r
            .netns_cookie
            .or_else(|| xdpcni_host::netns::netns_cookie(Path::new(&r.netns)).ok());
        if let Some(c) = cookie {
            out.entry(c).or_default().extend(r.ips.iter().copied());
        }
    }
    out
}

/// Which sockets the Service programs translate: the node's live pods'
/// (`netns`), and the node's own when `services.nodeSockets` is on: its
/// namespace's cookie (`node`, also in `netns` with every node address,
/// so a backend on the node itself is the caller's own and kube-proxy's),
/// and the source each frontend's translated calls bind to (`node_src`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scope {
    /// Namespace cookie -> its own addresses.
    pub netns: PodNamespaces,
    /// The node's own namespace, when translated.
    pub node: Option<u64>,
    /// Frontend -> the source a node's translated call to it binds to
    /// (see [`kept_source`]); a frontend without one takes the source the
    /// backend's route gives (kube-proxy masquerades it).
    pub node_src: BTreeMap<SvcAddr, IpAddr>,
    /// The uplinks north-south frontends are served on (ifindex, name;
    /// `services.northSouthDevices` that exist).
    pub uplinks: Vec<(u32, String)>,
    /// The outside frontends with source ranges, and their ranges.
    pub source_ranges: xdpcni_ebpf::SourceRanges,
}

/// The agent's own network namespace: the node's (it runs in the host's).
pub const NODE_NETNS: &str = "/proc/self/ns/net";

/// The sockets to translate for `records` (the node's pods) and, with
/// `cfg.node_sockets`, the node's own, with the frontends to write: the
/// cluster IPs of `frontends` always, the rest (node ports at each node
/// address, external and LoadBalancer IPs) only for the node's own
/// sockets. When the node's namespace or its addresses cannot be read, its
/// sockets stay kube-proxy's (logged).
pub fn scope(
    records: &[Record],
    frontends: Vec<Frontend>,
    cfg: &ServicesConfig,
) -> (Scope, Vec<Frontend>) {
    let mut out = Scope {
        netns: pod_netns(records),
        ..Scope::default()
    };
    let outside = if cfg.north_south() {
        match north_south(&frontends, &cfg.north_south_devices) {
            Ok(o) => Some(o),
            Err(e) => {
                warn!(error = %e, "north-south Services stay kube-proxy's");
                None
            }
        }
    } else {
        None
    };
    let cluster_ips = |f: Vec<Frontend>| -> Vec<Frontend> {
        f.into_iter()
            .filter(|f| f.kind == FrontendKind::ClusterIp)
            .collect()
    };
    let mut written = if !cfg.node_sockets {
        cluster_ips(frontends)
    } else {
        match node_scope(&frontends, &cfg.cluster_cidrs) {
            Ok((node, written)) => {
                for (cookie, addrs) in node.netns {
                    out.netns.entry(cookie).or_default().extend(addrs);
                }
                out.node = node.node;
                out.node_src = node.node_src;
                written
            }
            Err(e) => {
                warn!(error = %e, "the node's own sockets stay kube-proxy's");
                cluster_ips(frontends)
            }
        }
    };
    if let Some((fronts, uplinks)) = outside {
        out.source_ranges = source_ranges(&fronts);
        written.extend(fronts);
        out.uplinks = uplinks;
    }
    (out, written)
}

/// The source ranges of `outside` frontends that have them, keyed as the
/// uplink's program looks them up.
fn source_ranges(outside: &[Frontend]) -> xdpcni_ebpf::SourceRanges {
    outside
        .iter()
        .filter(|f| !f.source_ranges.is_empty())
        .map(|f| {
            (
                SvcAddr::outside(f.addr, f.proto.number()),
                f.source_ranges
                    .iter()
                    .map(|n| (n.network(), n.prefix_len()))
                    .collect(),
            )
        })
        .collect()
}

/// The frontends outside clients reach, the uplinks (ifindex, name).
type NorthSouth = (Vec<Frontend>, Vec<(u32, String)>);

/// North-south (`services.northSouthDevices`): the frontends outside
/// clients reach ([`outside_frontends`], at the node's addresses) and the
/// uplinks that exist, by ifindex. (The address a flow is masqueraded to
/// is the uplink program's to find, per flow: the source of the kernel's
/// route to its backend, as MASQUERADE chooses it.)
fn north_south(frontends: &[Frontend], devices: &[String]) -> Result<NorthSouth, String> {
    let mut nl = Netlink::new().map_err(|e| format!("netlink: {e}"))?;
    let mut uplinks = Vec::new();
    for name in devices {
        match nl.link_by_name(name) {
            Ok(Some(link)) => uplinks.push((link.index, name.clone())),
            Ok(None) => {
                warn!(device = %name, "no such uplink: north-south Services through it stay kube-proxy's")
            }
            Err(e) => return Err(format!("the uplink {name}: {e}")),
        }
    }
    let addrs: BTreeSet<IpAddr> = nl
        .all_addresses()
        .map_err(|e| format!("the node's addresses: {e}"))?
        .into_iter()
        .map(|a| a.1)
        .collect();
    let fronts = outside_frontends(frontends, &addrs);
    Ok((fronts, uplinks))
}

/// The frontends clients outside the node reach, as kube-proxy serves
/// them: each node port at every address of the node of its family (but
/// loopback and IPv6 link-local ones, which no packet from outside
/// carries), each externalIP and LoadBalancer IP; under
/// `externalTrafficPolicy: Local` their backends on this node by
/// `nodeName` alone ([`Frontend::local`], as kube-proxy tells them; one
/// that is no pod of this node the program leaves to kube-proxy). An
/// externalIP under `Local` stays kube-proxy's (not written).
pub fn outside_frontends(frontends: &[Frontend], addrs: &BTreeSet<IpAddr>) -> Vec<Frontend> {
    let mut out = Vec::new();
    for f in frontends
        .iter()
        .filter(|f| f.kind != FrontendKind::ClusterIp)
    {
        if f.kind == FrontendKind::ExternalIp && f.external_local {
            continue;
        }
        let mut o = f.clone();
        o.outside = true;
        if f.external_local {
            o.backends = f.local.clone();
        }
        if f.kind == FrontendKind::NodePort {
            node_port_at(&o, addrs, false, &mut out);
        } else {
            out.push(o);
        }
    }
    out.sort();
    out
}

/// Node port `f` at each address of `addrs` of its family it is served
/// at: not IPv6 loopback nor link-local (no route to a pod, or a scope
/// needed), and IPv4 loopback only for the node's own sockets
/// (`v4_loopback`: no packet from outside carries it).
fn node_port_at(
    f: &Frontend,
    addrs: &BTreeSet<IpAddr>,
    v4_loopback: bool,
    out: &mut Vec<Frontend>,
) {
    for a in addrs.iter().filter(|a| a.is_ipv4() == f.addr.is_ipv4()) {
        let usable = match a {
            IpAddr::V4(v4) => v4_loopback || !v4.is_loopback(),
            IpAddr::V6(v6) => !v6.is_loopback() && (v6.segments()[0] & 0xffc0) != 0xfe80,
        };
        if usable {
            let mut at = f.clone();
            at.addr = std::net::SocketAddr::new(*a, f.addr.port());
            out.push(at);
        }
    }
}

/// The node's part of a [`Scope`] (its namespace cookie with its
/// addresses, and for each frontend the source kube-proxy's path keeps
/// for the node's calls to it), with `frontends`' node ports put at each
/// node address ([`at_node_addresses`]).
fn node_scope(
    frontends: &[Frontend],
    cluster_cidrs: &[IpNet],
) -> Result<(Scope, Vec<Frontend>), String> {
    let cookie = xdpcni_host::netns::netns_cookie(Path::new(NODE_NETNS))
        .map_err(|e| format!("the node's network namespace cookie: {e}"))?;
    let mut nl = Netlink::new().map_err(|e| format!("netlink: {e}"))?;
    let addrs: BTreeSet<IpAddr> = nl
        .all_addresses()
        .map_err(|e| format!("the node's addresses: {e}"))?
        .into_iter()
        .map(|a| a.1)
        .collect();
    let written = at_node_addresses(frontends, &addrs);
    let mut routed: BTreeMap<IpAddr, Option<IpAddr>> = BTreeMap::new();
    let mut src = BTreeMap::new();
    for f in &written {
        let to = f.addr.ip();
        let from = match routed.get(&to) {
            Some(s) => *s,
            None => {
                let s = nl
                    .route_source(to)
                    .map_err(|e| format!("the node's source toward {to}: {e}"))?;
                routed.insert(to, s);
                s
            }
        };
        if let Some(from) = from.filter(|s| kept_source(f.node_masquerade(), *s, cluster_cidrs)) {
            src.insert(SvcAddr::new(f.addr, f.proto.number()), from);
        }
    }
    let scope = Scope {
        netns: PodNamespaces::from([(cookie, addrs)]),
        node: Some(cookie),
        node_src: src,
        uplinks: Vec::new(),
        source_ranges: BTreeMap::new(),
    };
    Ok((scope, written))
}

/// `frontends` as written for the node's own sockets: each node port at
/// every address of the node of its family, as kube-proxy serves it (its
/// rule matches any local destination; not IPv6's loopback, which it
/// cannot route to a pod, nor link-local addresses, which need a scope);
/// an externalIP only where it is an address of the node (kube-proxy 1.20
/// serves no other externalIP to the node's own sockets).
pub fn at_node_addresses(frontends: &[Frontend], addrs: &BTreeSet<IpAddr>) -> Vec<Frontend> {
    let mut out = Vec::new();
    for f in frontends {
        if f.kind == FrontendKind::ExternalIp && !addrs.contains(&f.addr.ip()) {
            continue;
        }
        // Source ranges: kube-proxy's own rule for the node's calls (its
        // firewall chain's exception for the node's address) stays its.
        if !f.source_ranges.is_empty() {
            continue;
        }
        if f.kind == FrontendKind::NodePort {
            node_port_at(f, addrs, true, &mut out);
        } else {
            out.push(f.clone());
        }
    }
    out.sort();
    out
}

/// Whether kube-proxy keeps source `src` of a node's call to a frontend
/// whose rule is `rule` (see [`NodeMasquerade`]), given its clusterCIDR.
pub fn kept_source(rule: NodeMasquerade, src: IpAddr, cluster_cidrs: &[IpNet]) -> bool {
    let same: Vec<&IpNet> = cluster_cidrs
        .iter()
        .filter(|c| c.addr().is_ipv6() == src.is_ipv6())
        .collect();
    let inside = same.iter().any(|c| c.contains(&src));
    match rule {
        NodeMasquerade::OutsideClusterCidr => same.is_empty() || inside,
        NodeMasquerade::UnlessInClusterCidr => inside,
        NodeMasquerade::Always => false,
    }
}

/// The network namespaces whose sockets are translated, by path: this
/// node's live pods', and the node's own with `node`.
pub fn netns_paths(records: &[Record], node: bool) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = records
        .iter()
        .filter(|r| !r.deleting)
        .map(|r| PathBuf::from(&r.netns))
        .chain(node.then(|| PathBuf::from(NODE_NETNS)))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The connected UDP sockets, in each of `namespaces`, whose peer is one of
/// `backends` (UDP [`SvcAddr`]s). A namespace that cannot be read (its pod
/// is going) is skipped.
pub fn connected_to(
    namespaces: &[PathBuf],
    backends: &BTreeSet<SvcAddr>,
) -> Vec<(PathBuf, ConnectedUdp)> {
    let mut out = Vec::new();
    for ns in namespaces {
        match in_netns(ns, sockets::connected_udp) {
            Ok(found) => out.extend(
                found
                    .into_iter()
                    .filter(|s| backends.contains(&SvcAddr::new(s.peer, UDP)))
                    .map(|s| (ns.clone(), s)),
            ),
            Err(e) => debug!(netns = %ns.display(), error = %e, "listing UDP sockets"),
        }
    }
    out
}

/// Closes `doomed` in their namespaces; returns how many were closed.
pub fn close(doomed: Vec<(PathBuf, ConnectedUdp)>) -> usize {
    let mut by_ns: BTreeMap<PathBuf, Vec<ConnectedUdp>> = BTreeMap::new();
    for (ns, s) in doomed {
        by_ns.entry(ns).or_default().push(s);
    }
    let mut closed = 0;
    for (ns, list) in by_ns {
        match in_netns(&ns, || sockets::destroy(&list)) {
            Ok(n) => closed += n,
            Err(e) => {
                warn!(netns = %ns.display(), error = %e, "closing UDP sockets of a gone backend")
            }
        }
    }
    closed
}

/// `IPPROTO_UDP`.
const UDP: u8 = 17;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::test_record;
    use xdpcni_ebpf::L4Proto;

    #[test]
    fn kept_source_is_kube_proxys_masquerade_decision_per_kind_and_family() {
        use NodeMasquerade::*;
        let cidrs: Vec<IpNet> = vec!["10.244.0.0/16".parse().unwrap()];
        let both: Vec<IpNet> = vec![
            "10.244.0.0/16".parse().unwrap(),
            "fd44::/48".parse().unwrap(),
        ];
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        // ClusterIP: kept in the clusterCIDR, masqueraded outside it, and
        // never masqueraded for a family without one.
        assert!(kept_source(OutsideClusterCidr, ip("10.244.3.1"), &cidrs));
        assert!(!kept_source(OutsideClusterCidr, ip("192.168.1.10"), &cidrs));
        assert!(kept_source(OutsideClusterCidr, ip("fd00::10"), &cidrs));
        assert!(kept_source(OutsideClusterCidr, ip("192.168.1.10"), &[]));
        assert!(!kept_source(OutsideClusterCidr, ip("fd00::10"), &both));
        assert!(kept_source(OutsideClusterCidr, ip("fd44::1"), &both));
        // externalIP, or externalTrafficPolicy Local: kept only inside a
        // clusterCIDR (without one, kube-proxy masquerades every source).
        assert!(kept_source(UnlessInClusterCidr, ip("10.244.3.1"), &cidrs));
        assert!(!kept_source(
            UnlessInClusterCidr,
            ip("192.168.1.10"),
            &cidrs
        ));
        assert!(!kept_source(UnlessInClusterCidr, ip("fd00::10"), &cidrs));
        assert!(!kept_source(UnlessInClusterCidr, ip("10.244.3.1"), &[]));
        // NodePort, LoadBalancer under Cluster: always masqueraded.
        assert!(!kept_source(Always, ip("10.244.3.1"), &both));
    }

    #[test]
    fn node_ports_are_written_at_each_usable_node_address_of_their_family() {
        let f = |addr: &str, kind: FrontendKind| Frontend {
            addr: addr.parse().unwrap(),
            proto: L4Proto::Tcp,
            affinity: None,
            backends: vec!["10.244.0.5:80".parse().unwrap()],
            local: vec![],
            service: "ns/web".into(),
            kind,
            external_local: false,
            outside: false,
            source_ranges: Vec::new(),
        };
        let addrs: BTreeSet<IpAddr> = ["10.0.0.5", "127.0.0.1", "fd00::5", "::1", "fe80::1"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        let out = at_node_addresses(
            &[
                f("0.0.0.0:30080", FrontendKind::NodePort),
                f("[::]:30080", FrontendKind::NodePort),
                f("10.96.0.10:80", FrontendKind::ClusterIp),
                f("192.0.2.7:80", FrontendKind::ExternalIp),
                f("10.0.0.5:80", FrontendKind::ExternalIp),
            ],
            &addrs,
        );
        let got: Vec<String> = out.iter().map(|f| f.addr.to_string()).collect();
        assert_eq!(
            got,
            [
                "10.0.0.5:80",
                "10.0.0.5:30080",
                "10.96.0.10:80",
                "127.0.0.1:30080",
                "[fd00::5]:30080"
            ]
        );
        // Everything but cluster IPs is written for the node alone.
        let w = wants(&out);
        for (fe, want) in &w {
            let cluster_ip = fe.addr[..4] == [10, 96, 0, 10];
            assert_eq!(want.flags & SVC_NODE_ONLY == 0, cluster_ip, "{fe:?}");
        }
        // Without nodeSockets only the cluster IPs are written.
        let (_, written) = scope(&[], out, &ServicesConfig::default());
        assert_eq!(written.len(), 1);
        assert_eq!(written[0].kind, FrontendKind::ClusterIp);
    }

    #[test]
    fn outside_frontends_are_node_ports_at_outside_addresses_external_and_balancer_ips_keyed_apart()
    {
        let f = |addr: &str, kind: FrontendKind, local: bool| Frontend {
            addr: addr.parse().unwrap(),
            proto: L4Proto::Tcp,
            affinity: None,
            backends: vec![
                "10.244.0.5:80".parse().unwrap(),
                "10.244.1.7:80".parse().unwrap(),
            ],
            local: vec!["10.244.0.5:80".parse().unwrap()],
            service: "ns/web".into(),
            kind,
            external_local: local,
            outside: false,
            source_ranges: Vec::new(),
        };
        let addrs: BTreeSet<IpAddr> = ["10.0.0.5", "127.0.0.1", "fd00::5", "::1", "fe80::1"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        let out = outside_frontends(
            &[
                f("10.96.0.10:80", FrontendKind::ClusterIp, false),
                f("0.0.0.0:30080", FrontendKind::NodePort, false),
                f("[::]:30081", FrontendKind::NodePort, true),
                f("192.0.2.7:80", FrontendKind::ExternalIp, false),
                f("192.0.2.8:80", FrontendKind::ExternalIp, true),
                f("198.51.100.9:80", FrontendKind::LoadBalancer, true),
            ],
            &addrs,
        );
        let got: Vec<(String, usize)> = out
            .iter()
            .map(|f| (f.addr.to_string(), f.backends.len()))
            .collect();
        // No cluster IP, no loopback or link-local address, no Local
        // externalIP; under Local the node's own backends alone.
        assert_eq!(
            got,
            [
                ("10.0.0.5:30080".to_string(), 2),
                ("192.0.2.7:80".to_string(), 2),
                ("198.51.100.9:80".to_string(), 1),
                ("[fd00::5]:30081".to_string(), 1),
            ]
        );
        assert!(out.iter().all(|f| f.outside));
        // Keyed apart from the same address for sockets, flagged Local.
        let w = wants(&out);
        let np = SvcAddr::outside("10.0.0.5:30080".parse().unwrap(), 6);
        assert!(np.is_outside() && w.contains_key(&np));
        assert!(!w.contains_key(&SvcAddr::new("10.0.0.5:30080".parse().unwrap(), 6)));
        assert_eq!(np.ip(), Some("10.0.0.5".parse().unwrap()));
        assert_eq!(w[&np].flags, 0);
        let lb = SvcAddr::outside("198.51.100.9:80".parse().unwrap(), 6);
        assert_eq!(w[&lb].flags, SVC_EXT_LOCAL);
    }

    #[test]
    fn the_node_scope_is_left_out_unless_configured() {
        let cfg = ServicesConfig::default();
        let (s, written) = scope(&[], vec![], &cfg);
        assert_eq!(s, Scope::default());
        assert!(written.is_empty());
        assert_eq!(netns_paths(&[], false), Vec::<PathBuf>::new());
        assert_eq!(netns_paths(&[], true), vec![PathBuf::from(NODE_NETNS)]);
    }

    #[test]
    fn wants_key_frontends_and_backends_with_the_protocol_and_affinity() {
        let f = Frontend {
            addr: "10.96.0.10:53".parse().unwrap(),
            proto: L4Proto::Udp,
            affinity: Some(60),
            backends: vec!["10.244.0.5:5353".parse().unwrap()],
            local: vec![],
            service: "ns/dns".into(),
            kind: FrontendKind::ClusterIp,
            external_local: false,
            outside: false,
            source_ranges: Vec::new(),
        };
        let w = wants(&[f]);
        let (fe, want) = w.iter().next().unwrap();
        assert_eq!(fe.proto, 17);
        assert_eq!(fe.port, 53u16.to_be());
        assert_eq!((want.flags, want.affinity_timeout), (SVC_AFFINITY, 60));
        assert_eq!(want.backends[0].proto, 17);
        assert_eq!(want.backends[0].port, 5353u16.to_be());
    }

    #[test]
    fn pod_netns_takes_recorded_cookies_with_addresses_and_skips_pods_being_deleted() {
        let ip: IpAddr = "10.1.0.2".parse().unwrap();
        let mut a = test_record("ns", "a", "ca", vec![ip]);
        a.netns_cookie = Some(7);
        let mut b = test_record("ns", "b", "cb", vec![]);
        b.netns_cookie = Some(8);
        b.deleting = true;
        // No cookie and a namespace path that does not exist: skipped.
        let mut c = test_record("ns", "c", "cc", vec![]);
        c.netns = "/nonexistent/netns".into();
        assert_eq!(
            pod_netns(&[a, b, c]),
            PodNamespaces::from([(7, BTreeSet::from([ip]))])
        );
    }
}
