//! The fast path between nodes delivers exactly what the kernel path does.
//!
//! Two nodes, each a namespace with its own datapath pins and CNI network,
//! joined by one wire (a veth pair: each end its node's uplink, MTU 1480),
//! each routing the other's pod CIDRs by the agent's own routing pass
//! (`Router::pass` over two Node objects) in three ways: hostGateway,
//! vxlan (the agent's VXLAN device over the wire, MTU 1430), and auto
//! between nodes of two subnets (its tunnel half). A pod on each, made by
//! the real CNI: a on node 1 (MTU 1500, above the wire's), b on node 2
//! (MTU 1400, below it). Every probe is a sequence of frames sent with an
//! AF_PACKET socket from inside a pod; everything that then arrives at both
//! pods' eth0 is captured. Each probe runs on the kernel path (both pods
//! `off`, no `remote_nets`, no uplink program) and on the fast path (both
//! pods in `tc`, `remote_nets` as the agent derives it from its routes
//! (`routes::remote_nets`), the uplink program on the routes' device: the
//! wire or the VXLAN device), and the captures must be equal byte for
//! byte: both directions, IPv4 and IPv6, TTL 1 at either node, fragments,
//! packets too big for the path or for the receiving pod, ICMP errors. The
//! fast path must have carried what it may carry (its counters on both
//! nodes), and the nodes' own traffic over the wire still flows with the
//! uplink program on.
//!
//! Needs root, bpffs, iptables and containernetworking-plugins.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{
    cell::RefCell,
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::Node;
use serde_json::json;
use xdpcni_agent::{
    config::Routing as AgentRouting,
    routes::{self, Router},
};
use xdpcni_e2e::{
    capture::{silence_stack, Capture},
    cni::{Call, Network},
    in_netns,
    netns::Netns,
    packet::{
        self, eth, fix_l4_v6, ipv4_full, pick, random_bytes, ETH_P_IP, ETH_P_IPV6, IPPROTO_ICMP,
        IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP,
    },
    traffic::ping,
    unique_name, PinDir,
};
use xdpcni_ebpf::{
    abi::{RedirectPolicy, Verdict},
    Datapath, Maps,
};
use xdpcni_host::{
    netlink::Netlink,
    overlay::{
        RoutingMode, Underlay, Vtep, DEFAULT_PORT, DEFAULT_TX_CHECKSUM_OFFLOAD, DEFAULT_VNI,
        DEVICE, VTEP_ANNOTATION,
    },
    pod::{self, XdpMode},
    state::{self, Record},
};

/// The wire's MTU: between b's (1400) and a's (1500). The tunnel's device
/// takes 50 bytes of it (1430).
const WIRE_MTU: &str = "1480";

/// How the two nodes reach each other's pods: the routing mode, and
/// whether their InternalIPs share a subnet (auto tunnels when not).
#[derive(Clone, Copy, Debug)]
struct Routing {
    mode: RoutingMode,
    same_subnet: bool,
}

const HOST_GATEWAY: Routing = Routing {
    mode: RoutingMode::HostGateway,
    same_subnet: true,
};
const VXLAN: Routing = Routing {
    mode: RoutingMode::Vxlan,
    same_subnet: true,
};
/// auto between nodes of two subnets of one wire: its tunnel half (its
/// same-subnet half is host-gateway's routes).
const AUTO_TUNNEL: Routing = Routing {
    mode: RoutingMode::Auto,
    same_subnet: false,
};

impl Routing {
    /// Node `n`'s (1 or 2) addresses on the wire, both families.
    fn wire(self, n: u8) -> (IpAddr, IpAddr) {
        let net = if self.same_subnet { 81 } else { 80 + n };
        (
            format!("192.168.{net}.{n}").parse().unwrap(),
            format!("fd{net}:ff::{n}").parse().unwrap(),
        )
    }

    fn config(self) -> AgentRouting {
        AgentRouting {
            mode: self.mode,
            vni: DEFAULT_VNI,
            port: DEFAULT_PORT,
            tx_checksum_offload: DEFAULT_TX_CHECKSUM_OFFLOAD,
            fast_path: true,
        }
    }
}

/// One node: pins, CNI network, its end of the wire, its name.
struct Side {
    pins: PinDir,
    net: Network,
    uplink: String,
    name: &'static str,
    routing: Routing,
}

/// Node `name`'s Node object as the API server would hold it: InternalIPs
/// (the wire's addresses), pod CIDRs, its VTEP when the mode tunnels.
fn node_object(
    name: &str,
    cidrs: (&str, &str),
    ips: (IpAddr, IpAddr),
    routing: Routing,
) -> Arc<Node> {
    let mut meta = json!({ "name": name });
    if routing.mode.tunnels() {
        meta["annotations"] = json!({ VTEP_ANNOTATION: Vtep::for_address(ips.0).to_annotation() });
    }
    Arc::new(
        serde_json::from_value(json!({
            "metadata": meta,
            "spec": { "podCIDR": cidrs.0, "podCIDRs": [cidrs.0, cidrs.1] },
            "status": { "addresses": [
                { "type": "InternalIP", "address": ips.0.to_string() },
                { "type": "InternalIP", "address": ips.1.to_string() },
            ] },
        }))
        .unwrap(),
    )
}

impl Side {
    fn new(name: &'static str, cidrs: (&str, &str), routing: Routing) -> Self {
        let pins = PinDir::new("xx").unwrap();
        let net = Network::new(
            pins.path(),
            "1.1.0",
            json!([[{ "subnet": cidrs.0 }], [{ "subnet": cidrs.1 }]]),
        )
        .unwrap();
        in_netns(&net.node, || Ok(Datapath::open(pins.path()).map(drop)?)).unwrap();
        net.node.sysctl("net.ipv4.ip_forward", "1").unwrap();
        net.node
            .sysctl("net.ipv6.conf.all.forwarding", "1")
            .unwrap();
        net.node.for_differential_tests().unwrap();
        Self {
            pins,
            net,
            uplink: String::new(),
            name,
            routing,
        }
    }

    /// The agent's routing pass for this node over `nodes` (the real
    /// `Router`, routes only: the fast path is set by [`Side::set_fast`]).
    fn route(&self, nodes: &[Arc<Node>]) {
        let (nodes, me, routing) = (nodes.to_vec(), self.name, self.routing.config());
        // Both pod CIDRs of the other node, by the path the mode picks.
        let want = if self.device() == DEVICE {
            (0, 2)
        } else {
            (2, 0)
        };
        in_netns(&self.net.node, move || {
            let mut router = Router::new(routing, None);
            let done = router.pass(&nodes, me, Duration::from_secs(3600), true)?;
            anyhow::ensure!(
                done.unreachable == 0 && done.warnings.is_empty(),
                "{done:?}"
            );
            anyhow::ensure!(
                done.routes == want,
                "routes (host-gateway, tunnel): {:?}, not {want:?}",
                done.routes
            );
            Ok(())
        })
        .unwrap();
    }

    /// The device the other node's pods' routes leave by (and their
    /// packets arrive on): the wire, or the VXLAN device.
    fn device(&self) -> &str {
        if self.routing.same_subnet && self.routing.mode != RoutingMode::Vxlan {
            &self.uplink
        } else {
            DEVICE
        }
    }

    /// The fast path between nodes on (`remote_nets` from the routes in
    /// place as the agent derives it, the uplink program on the routes'
    /// device) or off. `nodes`: the cluster's Node objects.
    fn set_fast(&self, nodes: &[Arc<Node>], on: bool) -> usize {
        let (pins, nodes, me, routing, device) = (
            self.pins.path().to_path_buf(),
            nodes.to_vec(),
            self.name,
            self.routing,
            self.device().to_string(),
        );
        in_netns(&self.net.node, move || {
            let mut nl = Netlink::new()?;
            let tunnel = nl.link_by_name(DEVICE)?.map(|l| l.index);
            let (v4, _) = routing.wire(if me == "n1" { 1 } else { 2 });
            let underlay = Underlay::find(&mut nl, v4)?
                .ok_or_else(|| anyhow::anyhow!("no underlay holds {v4}"))?;
            let local = routes::Local {
                vtep: Vtep::for_address(v4),
                underlay: &underlay,
            };
            let plan = routes::plan(&nodes, me, routing.mode, Some(&local));
            let nets = if on {
                routes::remote_nets(&mut nl, &plan, tunnel)?
            } else {
                BTreeMap::new()
            };
            let mut dp = Datapath::open(&pins)?;
            dp.sync_remote_nets(&nets)?;
            let dev = nl
                .link_by_name(&device)?
                .ok_or_else(|| anyhow::anyhow!("no {device}"))?;
            if on {
                anyhow::ensure!(
                    routes::uplinks(&nets) == vec![dev.index],
                    "the routes leave by {:?}, not {device}",
                    routes::uplinks(&nets)
                );
                dp.attach_uplink(dev.index)?;
            } else {
                dp.detach_uplink(dev.index)?;
            }
            Ok(nets.len())
        })
        .unwrap()
    }

    fn counters(&self, dev: &str) -> xdpcni_ebpf::Counters {
        let ifindex = self.net.node.ifindex(dev).unwrap();
        let pins = self.pins.path().to_path_buf();
        in_netns(&self.net.node, move || {
            Ok(Maps::open_pinned(&pins)?.counters(ifindex)?)
        })
        .unwrap()
    }
}

struct Pod {
    ns: Netns,
    rec: Record,
    v4: Ipv4Addr,
    v6: Ipv6Addr,
    mtu: usize,
    eth0: Capture,
}

impl Pod {
    fn add(side: &Side, id: &str, mtu: u32) -> Self {
        let ns = Netns::new("xp").unwrap();
        // The pod's own ICMP errors (its reassembly timeouts) by count and
        // within the run that caused them, as the nodes' (Side::new).
        ns.for_differential_tests().unwrap();
        let out = side
            .net
            .call(
                &Call::new("ADD", id, Some(&ns.path())),
                &json!({ "mtu": mtu }),
            )
            .unwrap();
        assert_eq!(out.status, 0, "ADD {id}: {:?} {}", out.json, side.net.log());
        let rec = state::list(&side.net.dir.path().join("state"))
            .unwrap()
            .into_iter()
            .find(|r| r.container_id == id)
            .unwrap();
        let v4 = rec
            .ips
            .iter()
            .find_map(|i| match i {
                IpAddr::V4(a) => Some(*a),
                IpAddr::V6(_) => None,
            })
            .unwrap();
        let v6 = rec
            .ips
            .iter()
            .find_map(|i| match i {
                IpAddr::V6(a) => Some(*a),
                IpAddr::V4(_) => None,
            })
            .unwrap();
        let eth0 = Capture::open(&ns, "eth0").unwrap();
        Self {
            ns,
            rec,
            v4,
            v6,
            mtu: mtu as usize,
            eth0,
        }
    }

    fn v4(&self, dst: Ipv4Addr, ttl: u8, proto: u8, frag: u16, l4: &[u8]) -> Vec<u8> {
        eth(
            self.rec.host_mac.0,
            self.rec.pod_mac.0,
            ETH_P_IP,
            &ipv4_full(self.v4, dst, ttl, proto, frag, &[], l4),
        )
    }

    fn v6(&self, dst: Ipv6Addr, hop: u8, nh: u8, l4: &[u8]) -> Vec<u8> {
        let mut f = eth(
            self.rec.host_mac.0,
            self.rec.pod_mac.0,
            ETH_P_IPV6,
            &packet::ipv6(self.v6, dst, hop, nh, l4),
        );
        fix_l4_v6(&mut f);
        f
    }

    fn host_veth(&self) -> &str {
        &self.rec.host_veth
    }
}

struct Lab {
    n1: Side,
    n2: Side,
    nodes: Vec<Arc<Node>>,
    a: Pod,
    b: Pod,
    /// Reassembly timeouts captured since the last [`timeouts_of_run`].
    timeouts: RefCell<Vec<Vec<u8>>>,
}

const P1: (&str, &str) = ("10.81.1.0/24", "fd81:1::/64");
const P2: (&str, &str) = ("10.81.2.0/24", "fd81:2::/64");

impl Lab {
    fn new(routing: Routing) -> Self {
        let mut n1 = Side::new("n1", P1, routing);
        let mut n2 = Side::new("n2", P2, routing);
        let (u1, u2) = (unique_name("xu"), unique_name("xu"));
        n1.net.node.add_veth(&u1, &u2, Some(&n2.net.node)).unwrap();
        for (side, dev, n) in [(&n1, &u1, 1), (&n2, &u2, 2)] {
            let node = &side.net.node;
            let (v4, v6) = routing.wire(n);
            let (o4, o6) = routing.wire(3 - n);
            node.ip(&["link", "set", dev, "mtu", WIRE_MTU, "up"])
                .unwrap();
            node.ip(&["addr", "add", &format!("{v4}/24"), "dev", dev])
                .unwrap();
            node.ip(&[
                "-6",
                "addr",
                "add",
                &format!("{v6}/64"),
                "dev",
                dev,
                "nodad",
            ])
            .unwrap();
            if !routing.same_subnet {
                // The other subnet on the same wire: the underlay reaches
                // it, auto's host-gateway test does not.
                node.ip(&["route", "add", &format!("{o4}/32"), "dev", dev])
                    .unwrap();
                node.ip(&["-6", "route", "add", &format!("{o6}/128"), "dev", dev])
                    .unwrap();
            }
        }
        n1.uplink = u1;
        n2.uplink = u2;
        let nodes = vec![
            node_object("n1", P1, routing.wire(1), routing),
            node_object("n2", P2, routing.wire(2), routing),
        ];
        n1.route(&nodes);
        n2.route(&nodes);
        let a = Pod::add(&n1, "a", 1500);
        let b = Pod::add(&n2, "b", 1400);
        Self {
            n1,
            n2,
            nodes,
            a,
            b,
            timeouts: RefCell::new(Vec::new()),
        }
    }

    /// Both pods in `mode` (as the agent's apply makes them) and the fast
    /// path between nodes as `fast` says; neighbours warmed both ways.
    fn set(&self, mode: XdpMode, fast: bool) {
        for (side, pod) in [(&self.n1, &self.a), (&self.n2, &self.b)] {
            let (pins, rec) = (side.pins.path().to_path_buf(), pod.rec.clone());
            in_netns(&side.net.node, move || {
                let mut dp = Datapath::open_existing(&pins)?;
                let wish = xdpcni_agent::wish::Wish {
                    mode,
                    redirect: RedirectPolicy::Devmap,
                    cpu_mask: pod::online_cpus(),
                };
                let done = xdpcni_agent::apply::apply(&mut dp, &rec, &wish, false, false)?;
                anyhow::ensure!(done.mode == mode, "{mode} refused: {:?}", done.problems);
                Ok(())
            })
            .unwrap();
            assert_eq!(side.set_fast(&self.nodes, fast), if fast { 2 } else { 0 });
        }
        self.warm();
    }

    /// Every neighbour entry of both paths resolved (pods, gateways), then
    /// the pods' stacks silenced: what arrives is the nodes' doing.
    fn warm(&self) {
        for ns in [&self.a.ns, &self.b.ns] {
            ns.exec(&["iptables", "-F", "INPUT"]).unwrap();
            ns.exec(&["ip6tables", "-F", "INPUT"]).unwrap();
        }
        for (from, to) in [(&self.a, &self.b), (&self.b, &self.a)] {
            for ip in [IpAddr::V4(to.v4), IpAddr::V6(to.v6)] {
                // A new pod's IPv6 address may still be tentative.
                let start = Instant::now();
                while let Err(e) = ping(&from.ns, ip, 1) {
                    assert!(start.elapsed() < Duration::from_secs(10), "{e:#}");
                }
            }
        }
        for ns in [&self.a.ns, &self.b.ns] {
            silence_stack(ns).unwrap();
        }
        // Each pod's frames reach the other before a probe runs.
        for (from, to) in [(&self.a, &self.b), (&self.b, &self.a)] {
            let frame = from.v4(to.v4, 64, IPPROTO_UDP, 0x4000, &udp(9, 9, 8));
            let start = Instant::now();
            to.eth0.drain();
            loop {
                from.eth0.send(&frame).unwrap();
                std::thread::sleep(Duration::from_millis(20));
                if !to.eth0.drain().is_empty() {
                    break;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(5),
                    "no path between the pods"
                );
            }
        }
        std::thread::sleep(Duration::from_millis(50));
        self.a.eth0.drain();
        self.b.eth0.drain();
    }
}

#[derive(Clone, Copy, Debug)]
enum From {
    A,
    B,
}

/// What arrived at a's and b's eth0, the nodes' own link-local chatter left
/// out (address resolution: only the kernel path resolves pods' addresses;
/// multicast, such as the MLD reports a node sends when it likes), sorted.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    at_a: Vec<Vec<u8>>,
    at_b: Vec<Vec<u8>>,
}

fn is_node_chatter(frame: &[u8]) -> bool {
    if frame.len() < 14 {
        return false;
    }
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    // No probe sends to a multicast MAC: IPv6 multicast is the node's.
    ethertype == 0x0806
        || frame[..2] == [0x33, 0x33]
        || (ethertype == ETH_P_IPV6
            && frame.len() > 54
            && frame[20] == 58
            && (133..=137).contains(&frame[54]))
}

/// The IP ID of an IPv4 packet a node originates (an ICMP error), or a
/// pod's stack (a reassembly timeout: the pods are otherwise silenced),
/// comes from the kernel's per-destination counter, which moves between
/// runs whatever the path: zeroed, with its header checksum recomputed.
fn normalise(frame: &mut [u8], pods: [Ipv4Addr; 2]) {
    if frame.len() < 34 || u16::from_be_bytes([frame[12], frame[13]]) != ETH_P_IP {
        return;
    }
    if pods.iter().any(|p| frame[26..30] == p.octets()) && !is_reassembly_timeout(frame) {
        return;
    }
    let hlen = usize::from(frame[14] & 0x0f) * 4;
    if frame.len() < 14 + hlen {
        return;
    }
    frame[18..20].copy_from_slice(&[0, 0]);
    frame[24..26].copy_from_slice(&[0, 0]);
    let c = packet::checksum(&frame[14..14 + hlen]);
    frame[24..26].copy_from_slice(&c.to_be_bytes());
}

/// An ICMP "fragment reassembly time exceeded": a node's timer sends it
/// (ipfrag_time after the fragment), so which batch's capture it falls
/// into is timing, not path.
fn is_reassembly_timeout(f: &[u8]) -> bool {
    if f.len() < 56 {
        return false;
    }
    match u16::from_be_bytes([f[12], f[13]]) {
        ETH_P_IP => {
            let l4 = 14 + usize::from(f[14] & 0x0f) * 4;
            f[23] == IPPROTO_ICMP && f.len() > l4 + 1 && f[l4] == 11 && f[l4 + 1] == 1
        }
        ETH_P_IPV6 => f[20] == IPPROTO_ICMPV6 && f[54] == 3 && f[55] == 1,
        _ => false,
    }
}

/// Sends `steps` and captures what arrives until the pods have been quiet
/// for 80 ms. Reassembly timeouts go to `lab.timeouts` instead, wherever
/// they arrive (compared over a whole run).
fn send_and_capture(lab: &Lab, steps: &[(From, Vec<u8>)]) -> Seen {
    let (mut at_a, mut at_b) = (Vec::new(), Vec::new());
    let late: Vec<Vec<u8>> = lab
        .a
        .eth0
        .drain()
        .into_iter()
        .chain(lab.b.eth0.drain())
        .collect();
    for (from, frame) in steps {
        match from {
            From::A => lab.a.eth0.send(frame).unwrap(),
            From::B => lab.b.eth0.send(frame).unwrap(),
        }
        std::thread::sleep(Duration::from_millis(3));
    }
    let (start, mut last) = (Instant::now(), Instant::now());
    while last.elapsed() < Duration::from_millis(80) && start.elapsed() < Duration::from_secs(2) {
        let (x, y) = (lab.a.eth0.drain(), lab.b.eth0.drain());
        if !x.is_empty() || !y.is_empty() {
            last = Instant::now();
        }
        at_a.extend(x);
        at_b.extend(y);
        std::thread::sleep(Duration::from_millis(5));
    }
    let pods = [lab.a.v4, lab.b.v4];
    let mut timeouts = lab.timeouts.borrow_mut();
    for mut f in late {
        if is_reassembly_timeout(&f) {
            normalise(&mut f, pods);
            timeouts.push(f);
        }
    }
    for v in [&mut at_a, &mut at_b] {
        v.retain(|f| !is_node_chatter(f));
        v.iter_mut().for_each(|f| normalise(f, pods));
        timeouts.extend(v.iter().filter(|f| is_reassembly_timeout(f)).cloned());
        v.retain(|f| !is_reassembly_timeout(f));
        v.sort();
    }
    Seen { at_a, at_b }
}

/// The reassembly timeouts of a run, once every fragment queue it left has
/// expired (ipfrag_time is 1 s), sorted; `lab.timeouts` starts empty again.
fn timeouts_of_run(lab: &Lab) -> Vec<Vec<u8>> {
    std::thread::sleep(Duration::from_millis(1500));
    send_and_capture(lab, &[]);
    let mut v = std::mem::take(&mut *lab.timeouts.borrow_mut());
    v.sort();
    v
}

fn tcp_syn(sport: u16, dport: u16) -> Vec<u8> {
    let mut t = packet::tcp(sport, dport);
    t[13] = 0x02;
    t
}

fn udp(sport: u16, dport: u16, len: usize) -> Vec<u8> {
    packet::udp(sport, dport, &vec![0x5a; len])
}

/// An ICMP error from `pod` about a UDP packet `quoted_from` -> `pod`.
fn icmp_error_v4(pod: &Pod, to: Ipv4Addr) -> Vec<u8> {
    let quoted = ipv4_full(to, pod.v4, 63, IPPROTO_UDP, 0x4000, &[], &udp(5000, 53, 4));
    let mut m = vec![3, 3, 0, 0, 0, 0, 0, 0];
    m.extend_from_slice(&quoted[..28]);
    let c = packet::checksum(&m);
    m[2..4].copy_from_slice(&c.to_be_bytes());
    pod.v4(to, 64, IPPROTO_ICMP, 0x4000, &m)
}

/// A named sequence of frames, each with its sender.
type Probe = (String, Vec<(From, Vec<u8>)>);

/// Every probe, both directions.
fn probes(lab: &Lab) -> Vec<Probe> {
    let (a, b) = (&lab.a, &lab.b);
    let mut v: Vec<Probe> = Vec::new();
    for (name, from, to) in [("a->b", From::A, b), ("b->a", From::B, a)] {
        let me = match from {
            From::A => a,
            From::B => b,
        };
        let one = |n: &str, f: Vec<u8>| (format!("{name} {n}"), vec![(from, f)]);
        v.push(one(
            "v4 udp 64",
            me.v4(to.v4, 64, IPPROTO_UDP, 0x4000, &udp(4000, 5000, 64)),
        ));
        v.push(one(
            "v6 udp 64",
            me.v6(to.v6, 64, IPPROTO_UDP, &udp(4000, 5000, 64)),
        ));
        v.push(one(
            "v4 tcp syn",
            me.v4(to.v4, 64, IPPROTO_TCP, 0x4000, &tcp_syn(4001, 80)),
        ));
        v.push(one(
            "v6 tcp syn",
            me.v6(to.v6, 64, IPPROTO_TCP, &tcp_syn(4001, 80)),
        ));
        v.push(one(
            "v4 echo",
            me.v4(to.v4, 64, IPPROTO_ICMP, 0x4000, &packet::icmp(8, 7, 1)),
        ));
        v.push(one(
            "v6 echo",
            me.v6(to.v6, 64, IPPROTO_ICMPV6, &packet::icmp(128, 7, 1)),
        ));
        v.push(one(
            "v4 ttl 1",
            me.v4(to.v4, 1, IPPROTO_UDP, 0x4000, &udp(4002, 5000, 8)),
        ));
        v.push(one(
            "v6 hop 1",
            me.v6(to.v6, 1, IPPROTO_UDP, &udp(4002, 5000, 8)),
        ));
        // Expires at the second node.
        v.push(one(
            "v4 ttl 2",
            me.v4(to.v4, 2, IPPROTO_UDP, 0x4000, &udp(4003, 5000, 8)),
        ));
        v.push(one(
            "v6 hop 2",
            me.v6(to.v6, 2, IPPROTO_UDP, &udp(4003, 5000, 8)),
        ));
        v.push(one(
            "v4 first fragment",
            me.v4(to.v4, 64, IPPROTO_UDP, 0x2000, &udp(4004, 5000, 32)),
        ));
        v.push(one(
            "v4 later fragment",
            me.v4(to.v4, 64, IPPROTO_UDP, 0x0004, &[0x5a; 40]),
        ));
        v.push(one("v4 icmp error", icmp_error_v4(me, to.v4)));
        // 1400 fits b; 1440 fits the wire, not b; 1500 fits a, not the wire.
        for len in [1400, 1440, 1500].into_iter().filter(|l| *l <= me.mtu) {
            v.push(one(
                &format!("v4 DF {len}"),
                me.v4(to.v4, 64, IPPROTO_UDP, 0x4000, &udp(4005, 5000, len - 28)),
            ));
            v.push(one(
                &format!("v6 {len}"),
                me.v6(to.v6, 64, IPPROTO_UDP, &udp(4005, 5000, len - 48)),
            ));
        }
        if me.mtu >= 1440 {
            v.push(one(
                "v4 no DF 1440",
                me.v4(to.v4, 64, IPPROTO_UDP, 0, &udp(4006, 5000, 1412)),
            ));
        }
        // An address of the other node's CIDR that no pod holds.
        let mut none4 = to.v4.octets();
        none4[3] = 200;
        v.push(one(
            "v4 to no pod",
            me.v4(
                Ipv4Addr::from(none4),
                64,
                IPPROTO_UDP,
                0x4000,
                &udp(4007, 5000, 8),
            ),
        ));
    }
    // A request and its reply, across.
    v.push((
        "udp both ways".into(),
        vec![
            (
                From::A,
                a.v4(b.v4, 64, IPPROTO_UDP, 0x4000, &udp(4100, 53, 20)),
            ),
            (
                From::B,
                b.v4(a.v4, 64, IPPROTO_UDP, 0x4000, &udp(53, 4100, 40)),
            ),
            (From::A, a.v6(b.v6, 64, IPPROTO_UDP, &udp(4100, 53, 20))),
            (From::B, b.v6(a.v6, 64, IPPROTO_UDP, &udp(53, 4100, 40))),
        ],
    ));
    v
}

#[test]
fn xnode_host_gateway_every_probe_arrives_as_the_kernel_path_delivers_it() {
    every_probe(HOST_GATEWAY);
}

#[test]
fn xnode_vxlan_every_probe_arrives_as_the_kernel_path_delivers_it() {
    every_probe(VXLAN);
}

#[test]
fn xnode_auto_tunnel_every_probe_arrives_as_the_kernel_path_delivers_it() {
    every_probe(AUTO_TUNNEL);
}

fn every_probe(routing: Routing) {
    let lab = Lab::new(routing);
    lab.set(XdpMode::Off, false);
    let list = probes(&lab);
    let kernel: Vec<Seen> = list
        .iter()
        .map(|(_, steps)| send_and_capture(&lab, steps))
        .collect();
    // The kernel path delivers the ordinary probes: the comparison is not
    // of two empty captures.
    assert!(
        !kernel[0].at_b.is_empty(),
        "a->b UDP never arrived on the kernel path"
    );
    let kernel_timeouts = timeouts_of_run(&lab);

    lab.set(XdpMode::Tc, true);
    let before = (
        lab.n1.counters(lab.a.host_veth()),
        lab.n2.counters(lab.n2.device()),
    );
    let mut diffs = Vec::new();
    for ((name, steps), want) in list.iter().zip(&kernel) {
        let got = send_and_capture(&lab, steps);
        if &got != want {
            diffs.push(format!(
                "{name}:\n  kernel {want:02x?}\n  fast   {got:02x?}"
            ));
        }
    }
    let fast_timeouts = timeouts_of_run(&lab);
    if fast_timeouts != kernel_timeouts {
        diffs.push(format!(
            "reassembly timeouts:\n  kernel {kernel_timeouts:02x?}\n  fast   {fast_timeouts:02x?}"
        ));
    }
    assert!(
        diffs.is_empty(),
        "{} probes differ:\n{}",
        diffs.len(),
        diffs.join("\n")
    );

    // The fast path carried a's probes out of node 1 and into node 2, and
    // passed what it may not carry.
    let after = (
        lab.n1.counters(lab.a.host_veth()),
        lab.n2.counters(lab.n2.device()),
    );
    let d = |v: Verdict, i: usize| match i {
        0 => after.0.packets(v) - before.0.packets(v),
        _ => after.1.packets(v) - before.1.packets(v),
    };
    assert!(d(Verdict::RedirectNeigh, 0) >= 8, "sent: {:?}", after.0);
    assert!(d(Verdict::FromNodePeer, 1) >= 8, "received: {:?}", after.1);
    assert!(
        d(Verdict::PassTtl, 0) >= 2,
        "TTL 1 left to node 1: {:?}",
        after.0
    );
    assert!(
        d(Verdict::PassTtl, 1) >= 2,
        "TTL 2 left to node 2: {:?}",
        after.1
    );
    assert!(
        d(Verdict::PassMtu, 0) >= 2,
        "too big for the path left to node 1: {:?}",
        after.0
    );
    // Through the tunnel (MTU 1430), what does not fit b (1400) does not
    // leave node 1 either.
    if lab.n2.device() == lab.n2.uplink {
        assert!(
            d(Verdict::PassMtu, 1) >= 2,
            "too big for b left to node 2: {:?}",
            after.1
        );
    }

    // The nodes' own traffic over the wire with the uplink program on.
    ping(&lab.n1.net.node, routing.wire(2).0, 2).unwrap();
    ping(&lab.n2.net.node, routing.wire(1).1, 2).unwrap();
    // Off again: no entry, no program.
    assert_eq!(lab.n1.set_fast(&lab.nodes, false), 0);
    assert!(lab
        .n1
        .net
        .node
        .tcx_ingress(lab.n1.device())
        .unwrap()
        .is_empty());
}

/// A random frame from `me` (on one node) towards the other node `to`:
/// mostly well-formed traffic between the pods, with TTLs that expire on
/// either node, lengths past the wire's and the receiver's MTU, fragments,
/// other protocols, extension headers, bad checksums and lengths, spoofed
/// sources and destinations that are no pod.
fn random_frame(rng: &mut fastrand::Rng, me: &Pod, to: &Pod, wire: (IpAddr, IpAddr)) -> Vec<u8> {
    let v6 = rng.bool();
    let proto = pick(
        rng,
        &[
            (4, IPPROTO_UDP),
            (3, IPPROTO_TCP),
            (2, if v6 { IPPROTO_ICMPV6 } else { IPPROTO_ICMP }),
            (1, 132),
        ],
    );
    let len = pick(rng, &[(6, 0usize), (2, 1), (1, 2)]);
    let len = match len {
        0 => rng.usize(..64),
        1 => rng.usize(64..1300),
        _ => rng.usize(1300..1500),
    };
    let l4 = match proto {
        IPPROTO_UDP => udp(rng.u16(1000..1010), rng.u16(5000..5004), len),
        IPPROTO_TCP => {
            let mut t = packet::tcp(rng.u16(1000..1010), rng.u16(80..83));
            t[13] = pick(
                rng,
                &[(3, 0x02u8), (3, 0x10), (1, 0x12), (1, 0x11), (1, 0x04)],
            );
            t.extend(random_bytes(rng, len));
            t
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 => {
            let ty = if v6 {
                pick(rng, &[(4, 128u8), (2, 129), (1, 1), (1, 2), (1, 3)])
            } else {
                pick(rng, &[(4, 8u8), (2, 0), (1, 3), (1, 11), (1, 12)])
            };
            let mut m = vec![ty, rng.u8(..4), 0, 0];
            m.extend(random_bytes(rng, 4 + len));
            if !v6 {
                let c = packet::checksum(&m);
                m[2..4].copy_from_slice(&c.to_be_bytes());
            }
            m
        }
        _ => random_bytes(rng, len),
    };
    let ttl = pick(rng, &[(1, 0u8), (3, 1), (3, 2), (1, 3), (10, 64), (2, 255)]);
    let mut frame = if v6 {
        let mut spoof = me.v6.octets();
        spoof[15] = spoof[15].wrapping_add(100);
        let mut none = to.v6.octets();
        none[15] = none[15].wrapping_add(100);
        let src = pick(rng, &[(90, me.v6), (5, Ipv6Addr::from(spoof)), (5, to.v6)]);
        let wire6 = match wire.1 {
            IpAddr::V6(a) => a,
            IpAddr::V4(_) => to.v6,
        };
        let dst = pick(rng, &[(85, to.v6), (10, Ipv6Addr::from(none)), (5, wire6)]);
        let (nh, l4) = if rng.u8(..20) == 0 {
            let ext = pick(rng, &[(1, 0u8), (1, 43), (1, 44), (1, 60)]);
            let mut h = vec![proto, 0, 0, 0, 0, 0, 0, 0];
            if ext == 44 {
                h[2..4].copy_from_slice(&rng.u16(..).to_be_bytes());
                // Its own identification, as for IPv4.
                h[4..8].copy_from_slice(&rng.u32(..).to_be_bytes());
            }
            h.extend_from_slice(&l4);
            (ext, h)
        } else {
            (proto, l4)
        };
        let mut f = eth(
            me.rec.host_mac.0,
            me.rec.pod_mac.0,
            ETH_P_IPV6,
            &packet::ipv6(src, dst, ttl, nh, &l4),
        );
        if nh == proto {
            fix_l4_v6(&mut f);
        }
        if rng.u8(..30) == 0 {
            let pl = u16::from_be_bytes([f[18], f[19]]).wrapping_add(rng.u16(1..64));
            f[18..20].copy_from_slice(&pl.to_be_bytes());
        }
        f
    } else {
        let mut spoof = me.v4.octets();
        spoof[3] = spoof[3].wrapping_add(100);
        let mut none = to.v4.octets();
        none[3] = none[3].wrapping_add(100);
        let src = pick(rng, &[(90, me.v4), (5, Ipv4Addr::from(spoof)), (5, to.v4)]);
        let wire4 = match wire.0 {
            IpAddr::V4(a) => a,
            IpAddr::V6(_) => to.v4,
        };
        let dst = pick(rng, &[(85, to.v4), (10, Ipv4Addr::from(none)), (5, wire4)]);
        let frag = pick(rng, &[(16, 0x4000u16), (2, 0), (1, 0x2000), (1, 0x0010)]);
        let mut f = eth(
            me.rec.host_mac.0,
            me.rec.pod_mac.0,
            ETH_P_IP,
            &ipv4_full(src, dst, ttl, proto, frag, &[], &l4),
        );
        // A frame's own IP ID: fragments of different frames never meet in
        // one reassembly queue (whether they did would be timing).
        f[18..20].copy_from_slice(&rng.u16(..).to_be_bytes());
        f[24..26].copy_from_slice(&[0, 0]);
        let c = packet::checksum(&f[14..34]);
        f[24..26].copy_from_slice(&c.to_be_bytes());
        match rng.u8(..40) {
            0 => f[24] ^= 0x5a,
            1 => {
                let tl = u16::from_be_bytes([f[16], f[17]]).wrapping_add(rng.u16(1..64));
                f[16..18].copy_from_slice(&tl.to_be_bytes());
            }
            _ => {}
        }
        f
    };
    frame.truncate(me.mtu + 14);
    frame
}

/// Seeded random frames both ways between the nodes, in batches of 20,
/// through the kernel path and then the fast path: every batch's captures
/// equal (`XDPCNI_EQ_SEED`, `XDPCNI_EQ_FRAMES` replay or lengthen it).
#[test]
fn xnode_host_gateway_seeded_random_frames_arrive_as_the_kernel_path_delivers_them() {
    seeded_random_frames(HOST_GATEWAY);
}

#[test]
fn xnode_vxlan_seeded_random_frames_arrive_as_the_kernel_path_delivers_them() {
    seeded_random_frames(VXLAN);
}

#[test]
fn xnode_auto_tunnel_seeded_random_frames_arrive_as_the_kernel_path_delivers_them() {
    seeded_random_frames(AUTO_TUNNEL);
}

fn seeded_random_frames(routing: Routing) {
    const BATCH: usize = 20;
    let seed = xdpcni_e2e::env_or("XDPCNI_EQ_SEED", 0x0dd_c0ffee_u64);
    let n = xdpcni_e2e::env_or("XDPCNI_EQ_FRAMES", 1000usize);
    eprintln!("xnode random ({routing:?}): seed {seed} ({n} frames); replay with XDPCNI_EQ_SEED={seed} XDPCNI_EQ_FRAMES={n}");
    let lab = Lab::new(routing);
    let (wire_a, wire_b) = (routing.wire(1), routing.wire(2));
    let mut rng = fastrand::Rng::with_seed(seed);
    let frames: Vec<(From, Vec<u8>)> = (0..n)
        .map(|_| {
            if rng.u8(..3) == 0 {
                (From::B, random_frame(&mut rng, &lab.b, &lab.a, wire_a))
            } else {
                (From::A, random_frame(&mut rng, &lab.a, &lab.b, wire_b))
            }
        })
        .collect();
    let batches: Vec<&[(From, Vec<u8>)]> = frames.chunks(BATCH).collect();
    lab.set(XdpMode::Off, false);
    // A node's IPv4 "no route" answers (ip_error) are rate limited by a
    // sysctl that is not per namespace (net.ipv4.route.error_cost: one a
    // second per source, burst 5): which of the stream's frames to no pod
    // get one would be timing. A blackhole for each node's own pod CIDR
    // drops them quietly on either path (the probes' single "to no pod"
    // frames still get their answers).
    for (side, cidr) in [(&lab.n1, P1.0), (&lab.n2, P2.0)] {
        side.net
            .node
            .ip(&["route", "add", "blackhole", cidr])
            .unwrap();
    }
    let kernel: Vec<Seen> = batches.iter().map(|b| send_and_capture(&lab, b)).collect();
    let delivered: usize = kernel.iter().map(|s| s.at_a.len() + s.at_b.len()).sum();
    assert!(
        delivered > n / 3,
        "only {delivered} frames arrived for {n} sent via the kernel"
    );
    let kernel_timeouts = timeouts_of_run(&lab);
    lab.set(XdpMode::Tc, true);
    let before = lab.n1.counters(lab.a.host_veth());
    let mut diffs = Vec::new();
    for (i, (batch, want)) in batches.iter().zip(&kernel).enumerate() {
        let got = send_and_capture(&lab, batch);
        if &got != want {
            diffs.push(format!(
                "batch {i} (frames {}..{}):\n  sent {:02x?}\n  kernel {want:02x?}\n  fast   {got:02x?}",
                i * BATCH,
                i * BATCH + batch.len(),
                batch.iter().map(|(_, f)| f).collect::<Vec<_>>(),
            ));
        }
    }
    let fast_timeouts = timeouts_of_run(&lab);
    if fast_timeouts != kernel_timeouts {
        diffs.push(format!(
            "reassembly timeouts ({} on the kernel path):\n  kernel {kernel_timeouts:02x?}\n  fast   {fast_timeouts:02x?}",
            kernel_timeouts.len()
        ));
    }
    let sent = lab
        .n1
        .counters(lab.a.host_veth())
        .packets(Verdict::RedirectNeigh)
        - before.packets(Verdict::RedirectNeigh);
    eprintln!(
        "xnode random: {delivered} frames delivered per run, {} reassembly timeouts; a's fast path sent {sent}",
        kernel_timeouts.len()
    );
    assert!(
        diffs.is_empty(),
        "{} of {} batches differ:\n{}",
        diffs.len(),
        batches.len(),
        diffs.join("\n")
    );
    assert!(
        sent as usize > n / 5,
        "the fast path carried only {sent} of a's frames"
    );
}
