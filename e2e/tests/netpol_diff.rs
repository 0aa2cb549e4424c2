//! The differential NetworkPolicy suite: for generated policies and flows,
//! the fast path (the datapath's own verdicts, pods flagged `EP_POLICY` on
//! tc) gives every packet the verdict the kernel path gives it (every pod
//! kernel-only: kernel routing, conntrack and the agent's nftables table),
//! both directions, IPv4 and IPv6, TCP, UDP and ICMP echo.
//!
//! Six pods made by the real CNI in two namespaces; the agent's own code
//! turns each generated round of policies into its two outputs (the model,
//! then the nftables transaction and the compiled verdicts the datapath
//! reads), in the test node's namespace. Each flow is four frames sent
//! from inside the pods with AF_PACKET (first packet, the answer, the
//! first side again: a TCP handshake, a UDP exchange, an echo and its
//! reply; then an ICMP port unreachable from the second side about the
//! first packet, which passes only as part of a flow the path let through),
//! each frame sent whatever happened to the one before, and what
//! arrives at each pod's eth0 is captured (the pods' own stacks are
//! silenced, as in equivalence.rs). The same round runs on both paths with
//! flows that differ only in their source port or echo id, and every
//! frame's arrival must be the same. Both runs see no window (the one a pod
//! newly isolated gets: netpol_flows_begun_... covers it).
//!
//! proptest drives the rounds from a seed, printed first and on a failure:
//! `XDPCNI_NETPOL_DIFF_SEED` replays one, `XDPCNI_NETPOL_DIFF_ROUNDS` (50)
//! and `XDPCNI_NETPOL_DIFF_FLOWS` (200 a round) size the run: 10,000 cases
//! by default. Needs root, bpffs, nftables, iptables and
//! containernetworking-plugins.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{
    cell::Cell,
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use k8s_openapi::api::{
    core::v1::{Namespace, Pod as PodObject},
    networking::v1::NetworkPolicy,
};
use proptest::{
    prelude::*,
    test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner},
};
use serde_json::{json, Value};
use xdpcni_agent::netpol::{
    compile,
    model::{self, Cluster, LocalPod},
    Enforcer,
};
use xdpcni_e2e::{
    capture::{silence_stack, Capture},
    cni::{Call, Network},
    env_or, in_netns,
    netns::Netns,
    packet::{self, checksum, eth, ETH_P_IP, ETH_P_IPV6},
    PinDir,
};
use xdpcni_ebpf::{abi::RedirectPolicy, Datapath, Maps, PodVerdicts};
use xdpcni_host::{
    pod::{self, XdpMode},
    state::{self, Record},
};

/// The pods: (namespace, name, app label); the named port `web` is 80 on
/// the first of each namespace and 81 on the others.
const PODS: [(&str, &str, &str); 6] = [
    ("x", "a", "a"),
    ("x", "b", "b"),
    ("x", "c", "c"),
    ("y", "a", "a"),
    ("y", "b", "b"),
    ("y", "c", "a"),
];

const TCP: u8 = packet::IPPROTO_TCP;
const UDP: u8 = packet::IPPROTO_UDP;
const ICMP: u8 = packet::IPPROTO_ICMP;

struct Pod {
    /// Its namespace, kept for as long as the pod.
    _ns: Netns,
    rec: Record,
    v4: Ipv4Addr,
    v6: Ipv6Addr,
    eth0: Capture,
}

impl Pod {
    fn ip(&self, v6: bool) -> IpAddr {
        if v6 {
            IpAddr::V6(self.v6)
        } else {
            IpAddr::V4(self.v4)
        }
    }

    fn send(&self, frame: &[u8]) {
        self.eth0.send(frame).unwrap();
    }

    fn drain(&self) -> Vec<Vec<u8>> {
        self.eth0.drain()
    }
}

struct Lab {
    pins: PinDir,
    net: Network,
    pods: Vec<Pod>,
    dp: Mutex<Datapath>,
    /// The next source port / echo id: every flow of the run has its own.
    next_port: Cell<u16>,
    /// Kubernetes objects of the pods and namespaces (the model's input).
    objects: (Vec<Arc<PodObject>>, Vec<Arc<Namespace>>),
    /// The node's enforcer, kept from round to round as the agent keeps
    /// it: after the first, its transactions write only what changed.
    enforcer: Mutex<Enforcer>,
    /// Where each round's table is also written whole, by a fresh
    /// enforcer, to compare with the node's.
    whole: Netns,
}

fn first<T>(ips: &[IpAddr], f: impl Fn(&IpAddr) -> Option<T>) -> T {
    ips.iter().find_map(f).unwrap()
}

impl Lab {
    fn new() -> Self {
        let pins = PinDir::new("xn").unwrap();
        let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
        let dp = in_netns(&net.node, || Ok(Datapath::open(pins.path())?)).unwrap();
        let mut pods = Vec::new();
        let mut objects = Vec::new();
        for (i, (ns_name, name, app)) in PODS.iter().enumerate() {
            let id = format!("{ns_name}{name}");
            let ns = Netns::new("xn").unwrap();
            let out = net
                .call(&Call::new("ADD", &id, Some(&ns.path())), &json!({}))
                .unwrap();
            assert_eq!(out.status, 0, "ADD {id}: {:?} {}", out.json, net.log());
            silence_stack(&ns).unwrap();
            let rec = state::list(&net.dir.path().join("state"))
                .unwrap()
                .into_iter()
                .find(|r| r.container_id == id)
                .unwrap();
            let eth0 = Capture::open(&ns, "eth0").unwrap();
            let web = if i % 3 == 0 { 80 } else { 81 };
            objects.push(Arc::new(
                serde_json::from_value::<PodObject>(json!({
                    "metadata": { "name": name, "namespace": ns_name, "labels": { "app": app } },
                    "spec": { "containers": [{ "name": "c", "ports": [
                        { "name": "web", "containerPort": web },
                        { "name": "web", "containerPort": web, "protocol": "UDP" },
                    ] }] },
                    "status": { "phase": "Running", "podIPs": rec.ips.iter()
                        .map(|ip| json!({ "ip": ip.to_string() })).collect::<Vec<_>>() },
                }))
                .unwrap(),
            ));
            pods.push(Pod {
                v4: first(&rec.ips, |i| match i {
                    IpAddr::V4(v) => Some(*v),
                    IpAddr::V6(_) => None,
                }),
                v6: first(&rec.ips, |i| match i {
                    IpAddr::V6(v) => Some(*v),
                    IpAddr::V4(_) => None,
                }),
                _ns: ns,
                rec,
                eth0,
            });
        }
        let namespaces = ["x", "y"]
            .iter()
            .map(|n| {
                Arc::new(
                    serde_json::from_value::<Namespace>(
                        json!({ "metadata": { "name": n, "labels": { "ns": n } } }),
                    )
                    .unwrap(),
                )
            })
            .collect();
        let lab = Self {
            pins,
            net,
            pods,
            dp: Mutex::new(dp),
            next_port: Cell::new(10_000),
            objects: (objects, namespaces),
            enforcer: Mutex::new(Enforcer::new()),
            whole: Netns::new("xw").unwrap(),
        };
        // The node's neighbour entries of every pod, as traffic would make
        // them (the pods' stacks answer neighbour discovery alone).
        for p in &lab.pods {
            let mac = p
                .rec
                .pod_mac
                .0
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":");
            for v6 in [false, true] {
                lab.net
                    .node
                    .exec(&[
                        "ip",
                        "neigh",
                        "replace",
                        &p.ip(v6).to_string(),
                        "lladdr",
                        &mac,
                        "dev",
                        &p.rec.host_veth,
                        "nud",
                        "permanent",
                    ])
                    .unwrap();
            }
        }
        lab
    }

    /// Puts `policies` in force on both outputs; `fast`: the isolated pods
    /// keep tc with the datapath's check, the others tc; else every pod
    /// kernel-only. Returns the isolated pods (indexes).
    fn enforce(&self, policies: &[Arc<NetworkPolicy>], fast: bool) -> BTreeSet<usize> {
        let (pods, namespaces) = &self.objects;
        let local: Vec<LocalPod> = PODS
            .iter()
            .zip(&self.pods)
            .map(|((ns, name, _), p)| LocalPod {
                key: (ns.to_string(), name.to_string()),
                ips: p.rec.ips.clone(),
            })
            .collect();
        let e = model::compute(
            &Cluster {
                policies,
                namespaces,
                pods,
            },
            &local,
        );
        let all: BTreeSet<IpAddr> = self.pods.iter().flat_map(|p| p.rec.ips.clone()).collect();
        // Twice: the first opens the newly isolated pods' windows, the
        // second writes the table without them.
        let enforcer = &self.enforcer;
        in_netns(&self.net.node, || {
            let mut enforcer = enforcer.lock().unwrap();
            enforcer.apply(&e, &all, &Default::default())?;
            enforcer.close_windows();
            enforcer.apply(&e, &all, &Default::default())?;
            Ok(())
        })
        .unwrap();
        // The table the changes made is the table written whole (twice
        // by fresh enforcers: the second sees no pod isolated anew, so
        // opens no window).
        in_netns(&self.whole, || {
            Enforcer::new().apply(&e, &all, &Default::default())?;
            Enforcer::new().apply(&e, &all, &Default::default())?;
            Ok(())
        })
        .unwrap();
        assert_eq!(
            table_listing(&self.net.node),
            table_listing(&self.whole),
            "the table after changes differs from the table written whole"
        );
        let isolated: BTreeSet<usize> = local
            .iter()
            .enumerate()
            .filter(|(_, l)| e.pods.contains_key(&l.key))
            .map(|(i, _)| i)
            .collect();
        let compiled = compile::compile(&e);
        let want: Vec<(Vec<IpAddr>, PodVerdicts, u64)> = compiled
            .iter()
            .map(|(k, v)| {
                let v = v.clone().expect("the generated policies fit the datapath");
                (e.pods[k].addrs.clone(), v, 0)
            })
            .collect();
        let recs: Vec<(Record, bool)> = self
            .pods
            .iter()
            .enumerate()
            .map(|(i, p)| (p.rec.clone(), isolated.contains(&i)))
            .collect();
        let dp = &self.dp;
        in_netns(&self.net.node, move || {
            let mut dp = dp.lock().unwrap();
            dp.sync_policy(&want)?;
            let wish = xdpcni_agent::wish::Wish {
                mode: XdpMode::Tc,
                redirect: RedirectPolicy::Devmap,
                cpu_mask: pod::online_cpus(),
            };
            for (r, iso) in &recs {
                xdpcni_agent::apply::apply(&mut dp, r, &wish, !fast, fast && *iso)?;
            }
            Ok(())
        })
        .unwrap();
        isolated
    }

    fn port(&self) -> u16 {
        let p = self.next_port.get();
        self.next_port.set(if p >= 65_000 { 10_000 } else { p + 1 });
        p
    }
}

/// L4 checksum over the pseudo-header of `src`/`dst`.
fn l4_checksum(src: IpAddr, dst: IpAddr, proto: u8, l4: &[u8]) -> u16 {
    let mut pseudo = Vec::new();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            pseudo.extend_from_slice(&s.octets());
            pseudo.extend_from_slice(&d.octets());
            pseudo.extend_from_slice(&[0, proto]);
            pseudo.extend_from_slice(&(l4.len() as u16).to_be_bytes());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            pseudo.extend_from_slice(&s.octets());
            pseudo.extend_from_slice(&d.octets());
            pseudo.extend_from_slice(&(l4.len() as u32).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, proto]);
        }
        _ => unreachable!("one family"),
    }
    pseudo.extend_from_slice(l4);
    checksum(&pseudo)
}

/// A flow of a round.
#[derive(Clone, Copy, Debug)]
struct Flow {
    src: usize,
    dst: usize,
    proto: u8,
    dport: u16,
    v6: bool,
}

/// Frame `step` (0: the first packet, 1: the answer, 2: the first side
/// again, 3: an ICMP error from the second side about the first packet) of
/// `flow` with source port / echo id `port`, tagged `tag`; (sender,
/// receiver, frame).
fn frame(lab: &Lab, f: &Flow, port: u16, step: usize, tag: &[u8]) -> (usize, usize, Vec<u8>) {
    if step == 3 {
        return icmp_error(lab, f, port, tag);
    }
    let (from, to) = if step == 1 {
        (f.dst, f.src)
    } else {
        (f.src, f.dst)
    };
    let (sp, dp) = if step == 1 {
        (f.dport, port)
    } else {
        (port, f.dport)
    };
    let (s, d) = (lab.pods[from].ip(f.v6), lab.pods[to].ip(f.v6));
    let l4 = match f.proto {
        TCP => {
            // SYN, SYN-ACK, ACK with consistent numbers (conntrack checks them).
            let (seq, ack, flags) = match step {
                0 => (1000u32, 0u32, 0x02u8),
                1 => (5000, 1001, 0x12),
                _ => (1001, 5001, 0x10),
            };
            let mut t = Vec::new();
            t.extend_from_slice(&sp.to_be_bytes());
            t.extend_from_slice(&dp.to_be_bytes());
            t.extend_from_slice(&seq.to_be_bytes());
            t.extend_from_slice(&ack.to_be_bytes());
            t.extend_from_slice(&[0x50, flags, 0xff, 0xff, 0, 0, 0, 0]);
            if step == 2 {
                t.extend_from_slice(tag);
            }
            t
        }
        UDP => packet::udp(sp, dp, tag),
        _ => {
            let ty = match (f.v6, step == 1) {
                (false, false) => 8,
                (false, true) => 0,
                (true, false) => 128,
                (true, true) => 129,
            };
            let mut m = vec![ty, 0, 0, 0];
            m.extend_from_slice(&port.to_be_bytes());
            m.extend_from_slice(&(step as u16 + 1).to_be_bytes());
            m.extend_from_slice(tag);
            m
        }
    };
    let proto = if f.proto == ICMP && f.v6 {
        packet::IPPROTO_ICMPV6
    } else {
        f.proto
    };
    let (sum_at, pseudo) = match proto {
        TCP => (16, true),
        UDP => (6, true),
        packet::IPPROTO_ICMPV6 => (2, true),
        _ => (2, false),
    };
    (
        from,
        to,
        sealed(lab, from, (s, d), proto, l4, sum_at, pseudo),
    )
}

/// The frame pod `from` sends from `s` to `d` with L4 `l4` of `proto`, its
/// checksum (at `sum_at`, over the pseudo-header if `pseudo`) filled in.
fn sealed(
    lab: &Lab,
    from: usize,
    (s, d): (IpAddr, IpAddr),
    proto: u8,
    mut l4: Vec<u8>,
    sum_at: usize,
    pseudo: bool,
) -> Vec<u8> {
    let c = if pseudo {
        l4_checksum(s, d, proto, &l4)
    } else {
        checksum(&l4)
    };
    l4[sum_at..sum_at + 2].copy_from_slice(&c.to_be_bytes());
    let p = &lab.pods[from];
    match (s, d) {
        (IpAddr::V4(s), IpAddr::V4(d)) => eth(
            p.rec.host_mac.0,
            p.rec.pod_mac.0,
            ETH_P_IP,
            &packet::ipv4(s, d, 64, proto, &l4),
        ),
        (IpAddr::V6(s), IpAddr::V6(d)) => eth(
            p.rec.host_mac.0,
            p.rec.pod_mac.0,
            ETH_P_IPV6,
            &packet::ipv6(s, d, 64, proto, &l4),
        ),
        _ => unreachable!("one family"),
    }
}

/// Port unreachable from the flow's second side to its first, quoting the
/// first packet's IP header and 8 bytes, then `tag` (what a longer quote
/// would carry).
fn icmp_error(lab: &Lab, f: &Flow, port: u16, tag: &[u8]) -> (usize, usize, Vec<u8>) {
    let (_, _, first) = frame(lab, f, port, 0, b"");
    let ip_len = if f.v6 { 40 } else { 20 };
    let quoted = &first[14..14 + ip_len + 8];
    let (s, d) = (lab.pods[f.dst].ip(f.v6), lab.pods[f.src].ip(f.v6));
    let mut m = if f.v6 {
        vec![1, 4, 0, 0, 0, 0, 0, 0]
    } else {
        vec![3, 3, 0, 0, 0, 0, 0, 0]
    };
    m.extend_from_slice(quoted);
    m.extend_from_slice(tag);
    let proto = if f.v6 { packet::IPPROTO_ICMPV6 } else { ICMP };
    (f.dst, f.src, sealed(lab, f.dst, (s, d), proto, m, 2, f.v6))
}

/// The tag of frame `step` of flow `i` (a TCP SYN or SYN-ACK carries no
/// payload: those are found by their ports and flags instead).
fn tag(i: usize, step: usize) -> Vec<u8> {
    format!("nd{i:06}s{step}!").into_bytes()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Whether `frame` (captured) is frame `step` of a TCP flow from `sp` to
/// `dp` with `flags`.
fn is_tcp(frame: &[u8], v6: bool, sp: u16, dp: u16, flags: u8) -> bool {
    let l4 = if v6 { 14 + 40 } else { 14 + 20 };
    frame.len() >= l4 + 20
        && frame[if v6 { 14 + 6 } else { 14 + 9 }] == TCP
        && frame[l4..l4 + 2] == sp.to_be_bytes()
        && frame[l4 + 2..l4 + 4] == dp.to_be_bytes()
        && frame[l4 + 13] == flags
}

/// Runs `flows` on the path in force: per flow and step, whether the
/// frame arrived at its receiver.
fn run_flows(lab: &Lab, flows: &[Flow]) -> Vec<[bool; 4]> {
    let ports: Vec<u16> = flows.iter().map(|_| lab.port()).collect();
    let mut out = vec![[false; 4]; flows.len()];
    for p in &lab.pods {
        p.drain();
    }
    #[allow(clippy::needless_range_loop)] // step is also the frame's step
    for step in 0..4 {
        let mut sent: Vec<(usize, usize, Vec<u8>)> = Vec::new();
        for (i, f) in flows.iter().enumerate() {
            let (from, to, bytes) = frame(lab, f, ports[i], step, &tag(i, step));
            lab.pods[from].send(&bytes);
            sent.push((i, to, bytes));
            if i % 32 == 31 {
                std::thread::sleep(Duration::from_micros(300));
            }
        }
        std::thread::sleep(Duration::from_millis(80));
        let got: Vec<Vec<Vec<u8>>> = lab.pods.iter().map(Pod::drain).collect();
        for (i, to, _) in sent {
            let f = &flows[i];
            let seen = &got[to];
            out[i][step] = if f.proto == TCP && step < 2 {
                let (sp, dp, flags) = if step == 0 {
                    (ports[i], f.dport, 0x02)
                } else {
                    (f.dport, ports[i], 0x12)
                };
                seen.iter().any(|fr| is_tcp(fr, f.v6, sp, dp, flags))
            } else {
                let t = tag(i, step);
                seen.iter().any(|fr| contains(fr, &t))
            };
        }
    }
    out
}

/// A generated round: policies (JSON) and flows.
#[derive(Clone, Debug)]
struct Round {
    policies: Vec<Value>,
    flows: Vec<Flow>,
}

fn label() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("a"), Just("b"), Just("c")]
}

fn peer(lab_ips: Arc<Vec<(IpAddr, IpAddr)>>) -> impl Strategy<Value = Value> {
    let ips = lab_ips;
    prop_oneof![
        label().prop_map(|l| json!({ "podSelector": { "matchLabels": { "app": l } } })),
        prop_oneof![Just("x"), Just("y")]
            .prop_map(|n| json!({ "namespaceSelector": { "matchLabels": { "ns": n } } })),
        (prop_oneof![Just("x"), Just("y")], label()).prop_map(|(n, l)| json!({
            "namespaceSelector": { "matchLabels": { "ns": n } },
            "podSelector": { "matchLabels": { "app": l } },
        })),
        Just(json!({ "namespaceSelector": {} })),
        (
            0..PODS.len(),
            any::<bool>(),
            0u8..3,
            proptest::option::of(0..PODS.len())
        )
            .prop_map(move |(i, v6, widen, except)| {
                let (v4ip, v6ip) = ips[i];
                let ip = if v6 { v6ip } else { v4ip };
                let full = if v6 { 128 } else { 32 };
                let plen = [full, full - 4, full - 8][usize::from(widen)];
                let net = ipnet::IpNet::new(ip, plen).unwrap().trunc();
                let mut block = json!({ "cidr": net.to_string() });
                if let Some(e) = except {
                    let (e4, e6) = ips[e];
                    let eip = if v6 { e6 } else { e4 };
                    if net.contains(&eip) && plen < full {
                        block["except"] = json!([format!("{eip}/{full}")]);
                    }
                }
                json!({ "ipBlock": block })
            }),
    ]
}

fn port() -> impl Strategy<Value = Value> {
    prop_oneof![
        (80u16..83).prop_map(|p| json!({ "port": p })),
        (80u16..83).prop_map(|p| json!({ "protocol": "UDP", "port": p })),
        Just(json!({ "port": "web" })),
        Just(json!({ "protocol": "UDP", "port": "web" })),
        Just(json!({ "port": 80, "endPort": 81 })),
        Just(json!({ "protocol": "SCTP", "port": 80 })),
    ]
}

/// A rule: its peers and its ports (absent: every one).
type RuleParts = (Option<Vec<Value>>, Option<Vec<Value>>);

fn rule(ips: Arc<Vec<(IpAddr, IpAddr)>>) -> impl Strategy<Value = RuleParts> {
    (
        proptest::option::of(proptest::collection::vec(peer(ips), 1..3)),
        proptest::option::of(proptest::collection::vec(port(), 1..3)),
    )
}

fn policy(i: usize, ips: Arc<Vec<(IpAddr, IpAddr)>>) -> impl Strategy<Value = Value> {
    (
        prop_oneof![Just("x"), Just("y")],
        proptest::option::of(label()),
        prop_oneof![
            Just(None),
            Just(Some(vec!["Ingress"])),
            Just(Some(vec!["Egress"])),
            Just(Some(vec!["Ingress", "Egress"])),
        ],
        proptest::collection::vec(rule(ips.clone()), 0..3),
        proptest::collection::vec(rule(ips), 0..3),
    )
        .prop_map(move |(ns, sel, types, ingress, egress)| {
            let to_rules = |rules: Vec<RuleParts>, key: &str| {
                rules
                    .into_iter()
                    .map(|(peers, ports)| {
                        let mut r = json!({});
                        if let Some(p) = peers {
                            r[key] = json!(p);
                        }
                        if let Some(p) = ports {
                            r["ports"] = json!(p);
                        }
                        r
                    })
                    .collect::<Vec<_>>()
            };
            let mut spec = json!({
                "podSelector": sel.map_or(json!({}), |l| json!({ "matchLabels": { "app": l } })),
                "ingress": to_rules(ingress, "from"),
                "egress": to_rules(egress, "to"),
            });
            if let Some(t) = types {
                spec["policyTypes"] = json!(t);
            }
            json!({ "metadata": { "name": format!("p{i}"), "namespace": ns }, "spec": spec })
        })
}

fn flow() -> impl Strategy<Value = Flow> {
    (
        0..PODS.len(),
        1..PODS.len(),
        prop_oneof![3 => Just(TCP), 3 => Just(UDP), 1 => Just(ICMP)],
        80u16..83,
        any::<bool>(),
    )
        .prop_map(|(src, off, proto, dport, v6)| Flow {
            src,
            dst: (src + off) % PODS.len(),
            proto,
            dport: if proto == ICMP { 0 } else { dport },
            v6,
        })
}

fn round(ips: Arc<Vec<(IpAddr, IpAddr)>>, flows: usize) -> impl Strategy<Value = Round> {
    (
        (1usize..5)
            .prop_flat_map(move |n| (0..n).map(|i| policy(i, ips.clone())).collect::<Vec<_>>()),
        proptest::collection::vec(flow(), flows),
    )
        .prop_map(|(policies, flows)| Round { policies, flows })
}

#[test]
fn netpol_diff_fast_path_verdicts_equal_the_kernel_path_packet_for_packet() {
    let started = Instant::now();
    let lab = Lab::new();
    eprintln!("netpol_diff: six pods made in {:?}", started.elapsed());
    let seed: u64 = env_or("XDPCNI_NETPOL_DIFF_SEED", fastrand::u64(..));
    let rounds: u32 = env_or("XDPCNI_NETPOL_DIFF_ROUNDS", 50);
    let flows: usize = env_or("XDPCNI_NETPOL_DIFF_FLOWS", 200);
    eprintln!("netpol_diff: seed {seed} (XDPCNI_NETPOL_DIFF_SEED={seed} replays it), {rounds} rounds of {flows} flows");
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases: rounds,
            max_shrink_iters: 32,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::ChaCha, &bytes),
    );
    let ips: Arc<Vec<(IpAddr, IpAddr)>> =
        Arc::new(lab.pods.iter().map(|p| (p.ip(false), p.ip(true))).collect());
    let forwarded_before = forwarded(&lab);
    let (cases, differing, isolated_cases) =
        (Cell::new(0usize), Cell::new(0usize), Cell::new(0usize));
    // ICMP errors that arrived and that did not, with an isolated end.
    let errors = Cell::new((0usize, 0usize));
    let result = runner.run(&round(ips, flows), |r| {
        let policies: Vec<Arc<NetworkPolicy>> = r
            .policies
            .iter()
            .map(|p| Arc::new(serde_json::from_value(p.clone()).unwrap()))
            .collect();
        let isolated = lab.enforce(&policies, false);
        let kernel = run_flows(&lab, &r.flows);
        lab.enforce(&policies, true);
        let fast = run_flows(&lab, &r.flows);
        cases.set(cases.get() + r.flows.len());
        let mut diffs = Vec::new();
        for (i, f) in r.flows.iter().enumerate() {
            if isolated.contains(&f.src) || isolated.contains(&f.dst) {
                isolated_cases.set(isolated_cases.get() + 1);
                let (arrived, not) = errors.get();
                errors.set(if fast[i][3] {
                    (arrived + 1, not)
                } else {
                    (arrived, not + 1)
                });
            }
            if kernel[i] != fast[i] {
                diffs.push(format!(
                    "{:?} {}/{} -> {}/{}: kernel path {:?}, fast path {:?}",
                    f,
                    PODS[f.src].0,
                    PODS[f.src].1,
                    PODS[f.dst].0,
                    PODS[f.dst].1,
                    kernel[i],
                    fast[i]
                ));
            }
        }
        if diffs.is_empty() {
            Ok(())
        } else {
            differing.set(differing.get() + diffs.len());
            Err(TestCaseError::fail(format!(
                "{} of {} flows differ (isolated: {isolated:?}):\n{}\npolicies: {}",
                diffs.len(),
                r.flows.len(),
                diffs.join("\n"),
                serde_json::to_string_pretty(&r.policies).unwrap()
            )))
        }
    });
    let stats = xdpcni_ebpf::PolicyStats::read_pinned(lab.pins.path()).unwrap();
    eprintln!(
        "netpol_diff: {} cases ({} with an isolated end), {:?}; datapath policy check: {stats:?}; fast path forwarded {} packets",
        cases.get(),
        isolated_cases.get(),
        started.elapsed(),
        forwarded(&lab) - forwarded_before
    );
    if let Err(e) = result {
        panic!("netpol_diff seed {seed}: {e}");
    }
    assert!(cases.get() >= (rounds as usize) * flows, "every round ran");
    let (arrived, not) = errors.get();
    eprintln!("netpol_diff: ICMP errors with an isolated end: {arrived} arrived, {not} did not");
    assert!(
        arrived > 0 && not > 0,
        "ICMP errors were both let through (about allowed flows) and not"
    );
    assert!(
        stats.new > 0 && stats.refused > 0 && stats.hit > 0,
        "the datapath allowed, refused and followed flows itself: {stats:?}"
    );
}

/// `nft list table inet xdpcni` in `ns`, with what two enforcers name or
/// number apart taken out: the epoch and content hash of set names, the
/// generation on the conntrack mark, the counters' counts, the order the
/// objects were made in (their blocks sorted).
fn table_listing(ns: &Netns) -> String {
    let text = ns
        .exec(&[
            "nft",
            "list",
            "table",
            "inet",
            xdpcni_agent::netpol::nft::TABLE,
        ])
        .unwrap();
    let hash = regex::Regex::new(r"\.[0-9a-f]{16}").unwrap();
    let mark = regex::Regex::new(r"0x[0-9a-f]{4}(0000|ffff)").unwrap();
    let counts = regex::Regex::new(r"packets \d+ bytes \d+").unwrap();
    let text = hash.replace_all(&text, ".H");
    let text = mark.replace_all(&text, "GEN");
    let text = counts.replace_all(&text, "");
    let body = text
        .trim_end()
        .trim_start_matches(|c| c != '\n')
        .trim_end_matches('}');
    let mut blocks: Vec<&str> = body.split("\n\n").map(str::trim).collect();
    blocks.sort_unstable();
    blocks.join("\n\n")
}

/// Packets the fast path forwarded from every pod's veth.
fn forwarded(lab: &Lab) -> u64 {
    let maps = Maps::open_pinned(lab.pins.path()).unwrap();
    lab.pods
        .iter()
        .map(|p| {
            let idx = lab.net.node.ifindex(&p.rec.host_veth).unwrap();
            maps.counters(idx).unwrap().forwarded()
        })
        .sum()
}
