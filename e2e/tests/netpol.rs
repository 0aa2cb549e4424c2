//! NetworkPolicy enforcement, in the style of cyclonus and the upstream
//! netpol tests: three namespaces (x, y, z) of three labelled pods (a, b,
//! c), each serving TCP and UDP on ports 80 and 81, every pair probed over
//! IPv4 and IPv6 after each policy change and compared with a matrix
//! written by hand from the spec (not computed by the product). The steps
//! and their matrices are data: tests/data/netpol-truth-table.json. A real
//! kube-apiserver, the real agent in Kubernetes mode, pods made by the real
//! CNI plugin. Probes run in parallel with short timeouts; a step passes
//! once two rounds in a row show its matrix (the policy's propagation is
//! what the first rounds wait for).
//! Needs root, bpffs, nftables, containernetworking-plugins, and
//! scripts/k8s-build.sh.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpStream, UdpSocket},
    time::{Duration, Instant},
};

use serde::Deserialize;
use serde_json::{json, Value};
use xdpcni_e2e::{
    agent::mode_of,
    cluster::{KubeNode, TestPod},
    in_netns,
};
use xdpcni_ebpf::{
    abi::{self, Verdict},
    Maps,
};

/// The pods in matrix order (rows: sources, columns: destinations).
const PODS: [(&str, &str); 9] = [
    ("x", "a"),
    ("x", "b"),
    ("x", "c"),
    ("y", "a"),
    ("y", "b"),
    ("y", "c"),
    ("z", "a"),
    ("z", "b"),
    ("z", "c"),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Proto {
    Tcp,
    Udp,
}

/// One probe: a protocol, a port, a family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Probe {
    proto: Proto,
    port: u16,
    v6: bool,
}

const ALL_PORTS: [(Proto, u16); 4] = [
    (Proto::Tcp, 80),
    (Proto::Tcp, 81),
    (Proto::Udp, 80),
    (Proto::Udp, 81),
];

/// Every probe of a round.
fn probes() -> Vec<Probe> {
    let mut v = Vec::new();
    for v6 in [false, true] {
        for (proto, port) in ALL_PORTS {
            v.push(Probe { proto, port, v6 });
        }
    }
    v
}

/// Whether `to` (named `name`) answers `p` from the calling thread's
/// network namespace within `timeout`: a TCP connection that gets the
/// server's greeting (its own name: no other pod answered), or a UDP
/// datagram echoed.
fn reach(to: IpAddr, name: &str, p: Probe, timeout: Duration) -> bool {
    let addr = SocketAddr::new(to, p.port);
    match p.proto {
        Proto::Tcp => {
            let Ok(mut c) = TcpStream::connect_timeout(&addr, timeout) else {
                return false;
            };
            let _ = c.set_read_timeout(Some(timeout));
            let mut line = Vec::new();
            let mut b = [0u8; 1];
            while line.len() < 128 {
                match c.read(&mut b) {
                    Ok(1) if b[0] != b'\n' => line.push(b[0]),
                    _ => break,
                }
            }
            line == name.as_bytes()
        }
        Proto::Udp => {
            let bind: SocketAddr = if to.is_ipv6() {
                "[::]:0".parse().unwrap()
            } else {
                "0.0.0.0:0".parse().unwrap()
            };
            let Ok(s) = UdpSocket::bind(bind) else {
                return false;
            };
            let _ = s.set_read_timeout(Some(timeout));
            let msg = format!("probe to {name}");
            if s.send_to(msg.as_bytes(), addr).is_err() {
                return false;
            }
            let mut buf = [0u8; 256];
            matches!(s.recv_from(&mut buf), Ok((n, _)) if buf[..n] == *msg.as_bytes())
        }
    }
}

/// (source, destination, probe) -> reached, for every pair but a pod and
/// itself, all in parallel: a thread per source in its network namespace,
/// a thread per probe under it (threads start in their creator's network
/// namespace). A probe `expected` to be allowed that fails is tried again
/// with a longer timeout before it counts as refused (a first packet may
/// wait for the node's neighbour entry); one expected refused is tried
/// once (a success is a difference at once).
fn round(
    pods: &[TestPod],
    expected: &(dyn Fn(usize, usize, Probe) -> bool + Sync),
) -> BTreeMap<(usize, usize, Probe), bool> {
    let probes = probes();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..pods.len())
            .map(|src| {
                let probes = &probes;
                s.spawn(move || {
                    in_netns(&pods[src].netns, move || {
                        Ok(std::thread::scope(|s| {
                            let each: Vec<_> = (0..pods.len())
                                .filter(|dst| *dst != src)
                                .flat_map(|dst| probes.iter().map(move |p| (dst, *p)))
                                .map(|(dst, p)| {
                                    s.spawn(move || {
                                        let to = &pods[dst];
                                        let (ip, id) = (to.ip(p.v6), to.id());
                                        let ok = reach(ip, &id, p, Duration::from_millis(300))
                                            || (expected(src, dst, p)
                                                && reach(ip, &id, p, Duration::from_millis(1500)));
                                        ((src, dst, p), ok)
                                    })
                                })
                                .collect();
                            each.into_iter()
                                .map(|h| h.join().unwrap())
                                .collect::<Vec<_>>()
                        }))
                    })
                    .unwrap()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    })
}

/// The truth table, as data: each step's operations and the matrix written
/// by hand from the spec (tests/data/netpol-truth-table.json says how).
#[derive(Deserialize)]
struct Table {
    named_ports: BTreeMap<String, Value>,
    steps: Vec<Step>,
}

#[derive(Deserialize)]
struct Step {
    name: String,
    ops: Vec<Op>,
    refused: Refused,
    #[serde(default)]
    checks: Vec<Check>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum Op {
    DeletePolicies,
    Create {
        namespace: String,
        name: String,
        spec: Value,
    },
    Relabel {
        namespace: String,
        pod: Option<String>,
        labels: Value,
    },
}

/// Refusal rules for every port, or per `proto/port`.
#[derive(Deserialize)]
#[serde(untagged)]
enum Refused {
    All(Vec<String>),
    PerPort(BTreeMap<String, Vec<String>>),
}

/// What else must hold after a step, for the pods of a pattern.
#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum Check {
    Isolated(String),
    FastPath(String),
    IngressDrops(String),
}

/// The pods (indices into `PODS`) a pattern names: `*`, a namespace `x`,
/// or a pod `xa`.
fn pods_of(pattern: &str) -> Vec<usize> {
    let pattern = pattern.trim();
    let found: Vec<usize> = PODS
        .iter()
        .enumerate()
        .filter(|(_, (ns, name))| {
            pattern == "*" || pattern == *ns || pattern == format!("{ns}{name}")
        })
        .map(|(i, _)| i)
        .collect();
    assert!(!found.is_empty(), "pattern {pattern:?} names no pod");
    found
}

/// The (source, destination) pairs refused by rules `S > D`.
fn refused_pairs(rules: &[String]) -> BTreeSet<(usize, usize)> {
    let mut out = BTreeSet::new();
    for rule in rules {
        let (from, to) = rule
            .split_once('>')
            .unwrap_or_else(|| panic!("rule {rule:?}: no '>'"));
        let list = |side: &str| -> Vec<usize> { side.split(',').flat_map(pods_of).collect() };
        for s in list(from) {
            for d in list(to) {
                if s != d {
                    out.insert((s, d));
                }
            }
        }
    }
    out
}

/// What a step expects: the refused pairs per (protocol, port), the same
/// for both families.
struct Expect(BTreeMap<(Proto, u16), BTreeSet<(usize, usize)>>);

impl Expect {
    fn of(refused: &Refused) -> Expect {
        Expect(
            ALL_PORTS
                .iter()
                .map(|port| {
                    let rules = match refused {
                        Refused::All(rules) => rules,
                        Refused::PerPort(per) => {
                            let key = format!("{:?}/{}", port.0, port.1).to_lowercase();
                            per.get(&key)
                                .unwrap_or_else(|| panic!("no rules for {key}"))
                        }
                    };
                    (*port, refused_pairs(rules))
                })
                .collect(),
        )
    }

    /// Whether the matrix allows `p` from pod `src` to pod `dst`.
    fn allows(&self, src: usize, dst: usize, p: Probe) -> bool {
        !self.0[&(p.proto, p.port)].contains(&(src, dst))
    }
}

/// Compares a round with `expect`; the differences, described.
fn diff(
    pods: &[TestPod],
    got: &BTreeMap<(usize, usize, Probe), bool>,
    expect: &Expect,
) -> Vec<String> {
    got.iter()
        .filter(|((i, j, p), reached)| **reached != expect.allows(*i, *j, *p))
        .map(|((i, j, p), reached)| {
            format!(
                "{} -> {} {:?}/{} {}: {}, expected {}",
                pods[*i].id(),
                pods[*j].id(),
                p.proto,
                p.port,
                if p.v6 { "IPv6" } else { "IPv4" },
                if *reached { "reached" } else { "refused" },
                if *reached { "refused" } else { "allowed" }
            )
        })
        .collect()
}

/// Probes until two rounds in a row match `expect` (or fails after 20 s,
/// with the differences); the time to the first matching round.
fn settle(node: &KubeNode, pods: &[TestPod], step: &str, expect: &Expect) -> Duration {
    let start = Instant::now();
    let mut first_match = None;
    loop {
        let got = round(pods, &|i, j, p| expect.allows(i, j, p));
        let d = diff(pods, &got, expect);
        if d.is_empty() {
            match first_match {
                Some(t) => {
                    eprintln!("netpol {step}: matrix matched after {t:?}");
                    return t;
                }
                None => first_match = Some(start.elapsed()),
            }
        } else {
            first_match = None;
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "netpol {step}: {} probes differ from the matrix:\n{}\nagent log:\n{}",
                d.len(),
                d.join("\n"),
                node.agent_log()
            );
        }
    }
}

/// A policy `name` in `ns` with `spec`.
fn np(ns: &str, name: &str, spec: Value) -> Value {
    json!({ "metadata": { "name": name, "namespace": ns }, "spec": spec })
}

/// The packets the fast path delivered from `pod`'s host veth.
fn forwarded(node: &KubeNode, pod: &TestPod) -> u64 {
    let idx = node.net.node.ifindex(&pod.host).unwrap();
    Maps::open_pinned(node.pin_dir())
        .unwrap()
        .counters(idx)
        .unwrap()
        .forwarded()
}

fn ports() -> Value {
    json!([])
}

/// `value` with every `$cidr4:xa` / `$cidr6:xa` replaced by that pod's
/// address as a /32 or /128.
fn with_addresses(value: &Value, pods: &[TestPod]) -> Value {
    match value {
        Value::String(s) => {
            let Some((fam, pod)) = s.strip_prefix('$').and_then(|r| r.split_once(':')) else {
                return value.clone();
            };
            let [i] = pods_of(pod)[..] else {
                panic!("{s}: not one pod")
            };
            let v6 = fam == "cidr6";
            json!(format!("{}/{}", pods[i].ip(v6), if v6 { 128 } else { 32 }))
        }
        Value::Array(a) => Value::Array(a.iter().map(|v| with_addresses(v, pods)).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, v)| (k.clone(), with_addresses(v, pods)))
                .collect(),
        ),
        _ => value.clone(),
    }
}

fn run_op(node: &KubeNode, pods: &[TestPod], op: &Op) {
    match op {
        Op::DeletePolicies => node.delete_policies().unwrap(),
        Op::Create {
            namespace,
            name,
            spec,
        } => node
            .create_policy(np(namespace, name, with_addresses(spec, pods)))
            .unwrap(),
        Op::Relabel {
            namespace,
            pod,
            labels,
        } => node
            .relabel(namespace, pod.as_deref(), labels.clone())
            .unwrap(),
    }
}

/// Packets the datapath dropped by policy, from every pod's host veth.
fn policy_drops(node: &KubeNode, pods: &[TestPod]) -> u64 {
    let maps = Maps::open_pinned(node.pin_dir()).unwrap();
    pods.iter()
        .map(|p| {
            let idx = node.net.node.ifindex(&p.host).unwrap();
            maps.counters(idx).unwrap().packets(Verdict::DropPolicy)
        })
        .sum()
}

/// The pods of `pattern` keep the fast path: the node's default mode, and
/// a round of probes moves their forward counters.
fn assert_fast_path(node: &KubeNode, pods: &[TestPod], pattern: &str) {
    for i in pods_of(pattern) {
        let p = &pods[i];
        assert_eq!(
            mode_of(&node.net.node, &p.host).unwrap(),
            xdpcni_e2e::agent::default_shown(),
            "{} on the fast path",
            p.id()
        );
        let before = forwarded(node, p);
        round(pods, &|_, _, _| false);
        assert!(
            forwarded(node, p) > before,
            "{} forwarded by the fast path",
            p.id()
        );
    }
}

fn run_check(node: &KubeNode, pods: &[TestPod], check: &Check, datapath: bool) {
    match check {
        Check::Isolated(pattern) if datapath => {
            let maps = Maps::open_pinned(node.pin_dir()).unwrap();
            for i in pods_of(pattern) {
                let p = &pods[i];
                for v6 in [false, true] {
                    let flags = maps.endpoint(p.ip(v6)).unwrap().expect("a record").flags;
                    assert_eq!(
                        flags & (abi::EP_KERNEL_ONLY | abi::EP_POLICY),
                        abi::EP_KERNEL_ONLY | abi::EP_POLICY,
                        "{} flagged for the datapath's policy check",
                        p.id()
                    );
                }
            }
            assert_fast_path(node, pods, pattern);
        }
        Check::Isolated(pattern) => {
            for i in pods_of(pattern) {
                let p = &pods[i];
                assert_eq!(
                    mode_of(&node.net.node, &p.host).unwrap(),
                    "none",
                    "{}",
                    p.id()
                );
            }
        }
        Check::FastPath(pattern) => assert_fast_path(node, pods, pattern),
        Check::IngressDrops(pattern) if datapath => {
            let before = policy_drops(node, pods);
            round(pods, &|_, _, _| false);
            assert!(
                policy_drops(node, pods) > before,
                "{pattern}: the datapath counted refused packets (drop_policy)"
            );
        }
        Check::IngressDrops(pattern) => {
            let m = node.metrics().unwrap();
            for i in pods_of(pattern) {
                let (ns, name) = PODS[i];
                let key = format!(
                    r#"xdpcni_policy_drop_packets_total{{namespace="{ns}",pod="{name}",direction="ingress"}}"#
                );
                let drops = m.get(&key).copied().unwrap_or_default();
                assert!(drops > 0.0, "{ns}/{name}'s ingress drops counted: {m:?}");
            }
        }
    }
}

/// The truth table with the isolated pods on the fast path: the datapath
/// enforces their policies (the agent's default).
#[test]
fn netpol_truth_table_ipv4_and_ipv6() {
    truth_table(true);
}

/// The same matrix with the isolated pods on the kernel path (the agent's
/// `policyDatapath: false`): the nftables rules alone.
#[test]
fn netpol_truth_table_kernel_path_ipv4_and_ipv6() {
    truth_table(false);
}

fn truth_table(datapath: bool) {
    let started = Instant::now();
    let table: Table =
        serde_json::from_str(include_str!("data/netpol-truth-table.json")).expect("the table");
    let node = KubeNode::start(|c| c.policy_datapath = datapath).unwrap();
    for ns in ["x", "y", "z"] {
        node.namespace(ns, json!({ "ns": ns })).unwrap();
    }
    let pods: Vec<TestPod> = PODS
        .iter()
        .map(|(ns, name)| {
            let ports = table
                .named_ports
                .get(&format!("{ns}{name}"))
                .cloned()
                .unwrap_or_else(|| json!([]));
            node.add_pod(ns, name, json!({ "pod": name }), ports)
                .unwrap()
        })
        .collect();
    let mut apply_latency = Vec::new();
    for step in &table.steps {
        let expect = Expect::of(&step.refused);
        for op in &step.ops {
            run_op(&node, &pods, op);
        }
        apply_latency.push(settle(&node, &pods, &step.name, &expect));
        for check in &step.checks {
            run_check(&node, &pods, check, datapath);
        }
    }

    let mut lat: Vec<f64> = apply_latency
        .iter()
        .skip(1)
        .map(|t| t.as_secs_f64() * 1e3)
        .collect();
    lat.sort_by(f64::total_cmp);
    eprintln!(
        "netpol ({}): {} steps, change -> matrix matched p50 {:.0} ms, max {:.0} ms (a round of {} probes is part of it); suite {:?}",
        if datapath { "fast path" } else { "kernel path" },
        apply_latency.len(),
        lat[lat.len() / 2],
        lat[lat.len() - 1],
        9 * 8 * probes().len(),
        started.elapsed()
    );
    for p in pods {
        node.del_pod(p).unwrap();
    }
}

/// Established connections: every packet of a connection, not only its
/// first, is checked against the policies in force, from the connection's
/// own direction. A connection that a new policy forbids stops at its next
/// packet; one it still allows goes on; replies of an allowed connection
/// pass whichever side is isolated.
#[test]
fn netpol_established_connections_follow_the_policies_in_force() {
    let node = KubeNode::start(|_| {}).unwrap();
    for ns in ["x", "y"] {
        node.namespace(ns, json!({ "ns": ns })).unwrap();
    }
    let client = node
        .add_pod("x", "client", json!({ "app": "client" }), ports())
        .unwrap();
    let other = node
        .add_pod("x", "other", json!({ "app": "other" }), ports())
        .unwrap();
    let server = node
        .add_pod("y", "server", json!({ "app": "server" }), ports())
        .unwrap();
    let to = SocketAddr::new(server.ip(false), 80);
    // Two connections to the server, open before any policy.
    let connect = |pod: &TestPod| {
        in_netns(&pod.netns, move || {
            let mut c = TcpStream::connect_timeout(&to, Duration::from_secs(2))?;
            c.set_read_timeout(Some(Duration::from_millis(500)))?;
            c.set_write_timeout(Some(Duration::from_millis(500)))?;
            let mut greeting = [0u8; 9];
            c.read_exact(&mut greeting)?;
            anyhow::ensure!(&greeting == b"y/server\n", "{greeting:?}");
            Ok(c)
        })
        .unwrap()
    };
    let mut from_client = connect(&client);
    let mut from_other = connect(&other);
    // Whether a connection still carries data: the server discards what it
    // gets, so the proof is the TCP acknowledgment (the send queue drains).
    let carries = |c: &mut TcpStream| -> bool {
        if c.write_all(&[0x5a; 1000]).is_err() {
            return false;
        }
        let fd = std::os::fd::AsRawFd::as_raw_fd(c);
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(1500) {
            let mut pending: libc::c_int = 0;
            // SAFETY: SIOCOUTQ writes one int: the bytes not yet acknowledged.
            unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut pending) };
            if pending == 0 {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    };
    assert!(carries(&mut from_client) && carries(&mut from_other));
    // The server's namespace now admits only x/client on port 80.
    node.create_policy(np(
        "y",
        "only-client",
        json!({ "podSelector": {}, "ingress": [{
            "from": [{ "namespaceSelector": { "matchLabels": { "ns": "x" } },
                       "podSelector": { "matchLabels": { "app": "client" } } }],
            "ports": [{ "port": 80 }] }] }),
    ))
    .unwrap();
    let start = Instant::now();
    while carries(&mut from_other) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "x/other's established connection still carries data: {}",
            node.agent_log()
        );
    }
    eprintln!(
        "netpol: an established connection the new policy forbids stopped after {:?}",
        start.elapsed()
    );
    assert!(
        carries(&mut from_client),
        "the allowed established connection goes on"
    );
    // Replies of an allowed connection pass: the server, isolated for
    // ingress, still answers a new connection from x/client, and its own
    // connections out (egress is not isolated) get their replies.
    let ok = in_netns(&client.netns, || {
        Ok(reach(
            server.ip(true),
            "y/server",
            Probe {
                proto: Proto::Tcp,
                port: 80,
                v6: true,
            },
            Duration::from_secs(1),
        ))
    })
    .unwrap();
    assert!(
        ok,
        "x/client -> y/server over IPv6, a new connection: {}",
        node.net
            .node
            .exec(&["nft", "list", "table", "inet", "xdpcni"])
            .unwrap_or_default()
    );
    let back = in_netns(&server.netns, || {
        Ok(reach(
            other.ip(false),
            "x/other",
            Probe {
                proto: Proto::Tcp,
                port: 81,
                v6: false,
            },
            Duration::from_secs(1),
        ))
    })
    .unwrap();
    assert!(
        back,
        "the isolated server's own connection out gets its replies"
    );
    // The policy deleted: the forbidden connection carries data again
    // (conntrack kept it; nothing reset it).
    node.delete_policies().unwrap();
    let start = Instant::now();
    while !carries(&mut from_other) {
        // TCP retransmits with backoff: seconds, not milliseconds.
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "not back after the policy went"
        );
    }
    drop((from_client, from_other));
    for p in [client, other, server] {
        node.del_pod(p).unwrap();
    }
}

/// The agent's enforcer, in `ns`, puts in force a table where pod x/a at
/// `ip` is isolated for ingress with nothing allowed.
fn deny_all_in(ns: &xdpcni_e2e::netns::Netns, ip: &str) {
    use xdpcni_agent::netpol::{model, Enforcer};
    in_netns(ns, || {
        let mut e = model::Enforcement::default();
        e.pods.insert(
            ("x".into(), "a".into()),
            model::PodRules {
                addrs: vec![ip.parse().unwrap()],
                ingress: Some(vec![]),
                ..Default::default()
            },
        );
        Enforcer::new().apply(&e, &Default::default(), &Default::default())?;
        Ok(())
    })
    .unwrap();
}

/// `xdpcni uninstall` (and `xdpcni-agent uninstall`) remove the policy
/// table over netlink, with no `nft` needed on the node: here a ruleset the
/// agent's enforcer put in a namespace of its own, then taken out.
#[test]
fn netpol_uninstall_removes_the_table_over_netlink() {
    let ns = xdpcni_e2e::netns::Netns::new("xu").unwrap();
    let listed = || ns.exec(&["nft", "list", "tables"]).unwrap();
    deny_all_in(&ns, "10.1.0.2");
    assert!(listed().contains("table inet xdpcni"), "{}", listed());
    let gone = in_netns(&ns, || Ok(xdpcni_host::nftable::remove_table()?)).unwrap();
    assert!(gone, "removed");
    assert!(!listed().contains("xdpcni"), "{}", listed());
    let again = in_netns(&ns, || Ok(xdpcni_host::nftable::remove_table()?)).unwrap();
    assert!(!again, "nothing to remove the second time");
}

/// Counters of a pod's host veth: drops by its hold.
fn held_drops(node: &KubeNode, pod: &TestPod) -> u64 {
    let idx = node.net.node.ifindex(&pod.host).unwrap();
    Maps::open_pinned(node.pin_dir())
        .unwrap()
        .counters(idx)
        .unwrap()
        .packets(Verdict::DropHeld)
}

/// The window: a pod created into a namespace with a default-deny policy,
/// probed every millisecond from before its ADD (an ICMP echo to each of
/// its addresses from a pod of another namespace, and from inside it an
/// echo out to that pod, started before its network exists), answers
/// nothing and reaches nothing, from its first packet on: with the agent
/// running, and with the agent stopped (the CNI holds it alone, from the
/// pinned datapath). A pod of a namespace without policies gets its
/// network with the agent stopped (and the probes do see answers there,
/// so a 0 is no blind probe).
#[test]
fn netpol_no_window_a_new_pod_a_policy_selects_is_held_from_its_first_packet() {
    let mut node = KubeNode::start(|_| {}).unwrap();
    node.namespace("guarded", json!({})).unwrap();
    node.namespace("open", json!({})).unwrap();
    node.create_policy(np(
        "guarded",
        "deny-all",
        json!({ "podSelector": {}, "policyTypes": ["Ingress", "Egress"] }),
    ))
    .unwrap();
    let prober = node.add_pod("open", "prober", json!({}), ports()).unwrap();
    // Let the agent write the gate with the new namespace in it.
    let start = Instant::now();
    while !Maps::open_pinned(node.pin_dir())
        .unwrap()
        .is_policy_namespace("guarded")
        .unwrap()
    {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{}",
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let every = Duration::from_millis(1);
    let mut n = 0;
    // ADDs `ns/name` at fixed addresses while both probes run (from 300 ms
    // before its ADD to 2 s after); (the pod, prober -> pod replies per
    // family, pod -> prober replies).
    let mut probed_add = |node: &KubeNode, ns: &str, name: &str| {
        n += 1;
        let ips: [IpAddr; 2] = [
            format!("10.78.0.{}", 200 + n).parse().unwrap(),
            format!("fd78::{}", 200 + n).parse().unwrap(),
        ];
        let obj = node
            .create_pod_object(ns, name, json!({}), ports())
            .unwrap();
        let netns = xdpcni_e2e::netns::Netns::new("xw").unwrap();
        let window = Duration::from_millis(2300);
        let into: Vec<_> = ips
            .iter()
            .map(|ip| xdpcni_e2e::traffic::echo_probe(prober.netns.path(), *ip, every, window))
            .collect();
        let out = xdpcni_e2e::traffic::echo_probe(netns.path(), prober.ip(false), every, window);
        std::thread::sleep(Duration::from_millis(300));
        let added = Instant::now();
        let pod = node.add_network(obj, netns, &ips).unwrap();
        let add_took = added.elapsed();
        let into: Vec<_> = into
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect();
        let out = out.join().unwrap().unwrap();
        eprintln!(
            "netpol window: {ns}/{name} (ADD {add_took:?}): prober -> pod {:?}, pod -> prober {out:?}",
            into
        );
        (pod, into, out)
    };

    // A control: a pod of the open namespace answers at once, both ways.
    let (open1, into, out) = probed_add(&node, "open", "control");
    for c in &into {
        assert!(c.replies > 100, "the probe sees an open pod: {c:?}");
    }
    assert!(out.replies > 100, "an open pod reaches out: {out:?}");

    // The agent running: nothing in or out of the guarded pod.
    let (g1, into, out) = probed_add(&node, "guarded", "first");
    for c in &into {
        assert!(c.sent > 1000, "probed all along: {c:?}");
        assert_eq!(
            c.replies, 0,
            "answers from a pod a deny-all policy selects: {c:?}"
        );
    }
    assert!(
        out.sent > 500,
        "the pod sent all along once it had a network: {out:?}"
    );
    assert_eq!(
        out.replies, 0,
        "a pod a deny-all policy selects reached out: {out:?}"
    );

    // The agent stopped: the CNI holds the new guarded pod by itself, and
    // an open pod still gets its network.
    node.stop_agent(libc::SIGKILL).unwrap();
    let (g2, into, out) = probed_add(&node, "guarded", "second");
    for c in &into {
        assert!(c.sent > 1000, "probed all along: {c:?}");
        assert_eq!(
            c.replies, 0,
            "agent down: answers from a guarded pod: {c:?}"
        );
    }
    assert_eq!(
        out.replies, 0,
        "agent down: a guarded pod reached out: {out:?}"
    );
    assert!(held_drops(&node, &g2) > 1000, "the hold dropped the probes");
    let (open2, into, out) = probed_add(&node, "open", "without-agent");
    for c in &into {
        assert!(c.replies > 100, "agent down: an open pod answers: {c:?}");
    }
    assert!(
        out.replies > 100,
        "agent down: an open pod reaches out: {out:?}"
    );
    assert_eq!(
        mode_of(&node.net.node, &open2.host).unwrap(),
        "none",
        "kernel routing"
    );

    // The agent back: the held pod is classified (its rules in force, its
    // hold released) and still answers nothing; the open one gets XDP.
    node.start_agent().unwrap();
    let start = Instant::now();
    while xdpcni_ebpf::is_held(node.pin_dir(), node.net.node.ifindex(&g2.host).unwrap()) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{}",
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let still = xdpcni_e2e::traffic::echo_probe(
        prober.netns.path(),
        g2.ip(false),
        every,
        Duration::from_millis(500),
    )
    .join()
    .unwrap()
    .unwrap();
    assert_eq!(
        still.replies, 0,
        "classified: the deny-all rules in force: {still:?}"
    );
    xdpcni_e2e::agent::wait_mode(
        &node.net.node,
        &open2.host,
        xdpcni_e2e::agent::default_shown(),
        Duration::from_secs(5),
    )
    .unwrap();
    for p in [open1, g1, g2, open2, prober] {
        node.del_pod(p).unwrap();
    }
}

/// Rules that cannot be put in force (here: no `nft` where the agent runs)
/// fail closed: every pod a policy selects is held (no traffic at all, not
/// even what the policy allows), the policy gets an Event saying why and
/// which pods, the failure is counted; once the rules can be applied, the
/// holds go and the policy is enforced as written.
#[test]
fn netpol_rules_that_cannot_be_applied_hold_the_pods_they_select() {
    let mut node = KubeNode::start(|_| {}).unwrap();
    node.namespace("x", json!({})).unwrap();
    let a = node
        .add_pod("x", "a", json!({ "app": "a" }), ports())
        .unwrap();
    let b = node
        .add_pod("x", "b", json!({ "app": "b" }), ports())
        .unwrap();
    let c = node
        .add_pod("x", "c", json!({ "app": "c" }), ports())
        .unwrap();
    node.stop_agent(libc::SIGTERM).unwrap();
    node.agent_env = vec![("PATH".into(), "/usr/bin:/bin".into())];
    node.start_agent().unwrap();
    node.create_policy(np(
        "x",
        "b-from-a",
        json!({ "podSelector": { "matchLabels": { "app": "b" } },
                "ingress": [{ "from": [{ "podSelector": { "matchLabels": { "app": "a" } } }] }] }),
    ))
    .unwrap();
    let b_idx = node.net.node.ifindex(&b.host).unwrap();
    let start = Instant::now();
    while !xdpcni_ebpf::is_held(node.pin_dir(), b_idx) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "b not held: {}",
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let tcp80 = Probe {
        proto: Proto::Tcp,
        port: 80,
        v6: false,
    };
    let from = |p: &TestPod, to: &TestPod| {
        let (ip, id) = (to.ip(false), to.id());
        in_netns(&p.netns, move || {
            Ok(reach(ip, &id, tcp80, Duration::from_millis(500)))
        })
        .unwrap()
    };
    assert!(!from(&a, &b), "held: not even the allowed peer gets in");
    assert!(from(&a, &c), "a pod no policy selects is untouched");
    let events = node
        .client(|cl| async move {
            let ev: kube::Api<k8s_openapi::api::events::v1::Event> = kube::Api::namespaced(cl, "x");
            Ok(ev
                .list(&Default::default())
                .await?
                .items
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some("XdpcniPolicyFailed"))
                .filter(|e| {
                    e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("b-from-a")
                })
                .filter_map(|e| e.note)
                .collect::<Vec<_>>())
        })
        .unwrap();
    assert!(
        events
            .iter()
            .any(|n| n.contains("nft") && n.contains("held") && n.contains(" b")),
        "{events:?}"
    );
    let m = node.metrics().unwrap();
    assert!(
        m[r#"xdpcni_reconcile_errors_total{stage="netpol"}"#] > 0.0,
        "{m:?}"
    );
    // nft back: enforced as written, the hold gone.
    node.stop_agent(libc::SIGTERM).unwrap();
    node.agent_env.clear();
    node.start_agent().unwrap();
    let start = Instant::now();
    while xdpcni_ebpf::is_held(node.pin_dir(), b_idx) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{}",
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(from(&a, &b), "a -> b allowed by the policy");
    assert!(!from(&c, &b), "c -> b refused by the policy");
    for p in [a, b, c] {
        node.del_pod(p).unwrap();
    }
}

/// The node itself: what it sends to a pod is allowed in whatever the
/// policies (the kubelet's probes, hostNetwork pods of the node), with its
/// replies; a pod's own connections to the node are egress, checked like
/// any other (here refused by a deny-all egress policy, then allowed by an
/// ipBlock of the node's address).
#[test]
fn netpol_the_node_itself_is_allowed_in_and_checked_out() {
    let node = KubeNode::start(|_| {}).unwrap();
    node.namespace("x", json!({})).unwrap();
    let pod = node
        .add_pod("x", "p", json!({ "app": "p" }), ports())
        .unwrap();
    node.create_policy(np(
        "x",
        "deny-all",
        json!({ "podSelector": {}, "policyTypes": ["Ingress", "Egress"] }),
    ))
    .unwrap();
    // A server on the node's own address (the test network's 10.99.0.1).
    let listener = in_netns(&node.net.node, || {
        Ok(std::net::TcpListener::bind(("10.99.0.1", 7070))?)
    })
    .unwrap();
    listener.set_nonblocking(true).unwrap();
    let to_node = |pod: &TestPod| {
        let connected = in_netns(&pod.netns, || {
            Ok(TcpStream::connect_timeout(
                &"10.99.0.1:7070".parse().unwrap(),
                Duration::from_millis(500),
            )
            .is_ok())
        })
        .unwrap();
        // Accepted and closed: a full accept queue would refuse the next
        // connection whatever the policies say.
        while listener.accept().is_ok() {}
        connected
    };
    let tcp80 = Probe {
        proto: Proto::Tcp,
        port: 80,
        v6: false,
    };
    let (ip, id) = (pod.ip(false), pod.id());
    let start = Instant::now();
    while to_node(&pod) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the pod still reaches the node: {}",
            node.agent_log()
        );
    }
    let from_node = in_netns(&node.net.node, || {
        Ok(reach(ip, &id, tcp80, Duration::from_secs(1)))
    })
    .unwrap();
    assert!(
        from_node,
        "the node reaches a pod a deny-all policy isolates"
    );
    node.create_policy(np(
        "x",
        "to-the-node",
        json!({ "podSelector": {}, "policyTypes": ["Egress"],
                "egress": [{ "to": [{ "ipBlock": { "cidr": "10.99.0.1/32" } }] }] }),
    ))
    .unwrap();
    let start = Instant::now();
    while !to_node(&pod) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{}",
            node.agent_log()
        );
    }
    drop(listener);
    node.del_pod(pod).unwrap();
}

/// Flows that began on the fast path (unseen by conntrack) stop when a
/// policy isolates their pod, whichever end speaks first after the switch:
/// eight UDP exchanges (a asks, b answers, at once) and a TCP
/// connection whose server b pushes data to its client a. Without care
/// conntrack would take b's first packet on the kernel path for the start
/// of a connection b began (b's egress is open), and let a's in as its
/// replies.
#[test]
fn netpol_flows_begun_on_the_fast_path_stop_when_their_pod_is_isolated() {
    use std::sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    };
    let node = KubeNode::start(|_| {}).unwrap();
    node.namespace("x", json!({})).unwrap();
    let a = node
        .add_pod("x", "a", json!({ "app": "a" }), ports())
        .unwrap();
    let b = node
        .add_pod("x", "b", json!({ "app": "b" }), ports())
        .unwrap();
    for p in [&a, &b] {
        xdpcni_e2e::agent::wait_mode(
            &node.net.node,
            &p.host,
            xdpcni_e2e::agent::default_shown(),
            Duration::from_secs(5),
        )
        .unwrap();
    }
    // b's own connection to the node, tracked from its first packet: kept
    // through the isolation (neither cut nor made again).
    let listener = in_netns(&node.net.node, || {
        Ok(std::net::TcpListener::bind(("10.99.0.1", 7073))?)
    })
    .unwrap();
    let mut b_to_node = in_netns(&b.netns, || {
        Ok(TcpStream::connect_timeout(
            &"10.99.0.1:7073".parse().unwrap(),
            Duration::from_secs(2),
        )?)
    })
    .unwrap();
    let (mut node_to_b, _) = listener.accept().unwrap();
    let entry_id = || {
        let out = node
            .net
            .node
            .exec(&[
                "conntrack",
                "-L",
                "-p",
                "tcp",
                "--orig-src",
                &b.ip(false).to_string(),
                "--dport",
                "7073",
                "-o",
                "id",
            ])
            .unwrap_or_default();
        out.split_whitespace()
            .find_map(|w| w.strip_prefix("id="))
            .map(str::to_string)
    };
    let id_before = entry_id().expect("b's connection to the node is tracked");
    let started = Instant::now();
    let now = move || started.elapsed().as_millis() as u64;
    let (udp_last, tcp_last) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let stop = Arc::new(AtomicBool::new(false));
    let b_ip = b.ip(false);
    /// Sets the flag when dropped: a failed assertion in the scope below
    /// stops the flows, so the scope's join returns and the test fails
    /// (rather than waiting forever for threads that never stop).
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    std::thread::scope(|s| {
        let _stop_on_panic = StopOnDrop(&stop);
        // b pushes to whoever connects to its port 7071.
        s.spawn(|| {
            in_netns(&b.netns, || {
                let l = std::net::TcpListener::bind((b_ip, 7071))?;
                // Not blocking: the test ends even if a never connects.
                l.set_nonblocking(true)?;
                let mut c = loop {
                    match l.accept() {
                        Ok((c, _)) => break c,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            if stop.load(Ordering::Relaxed) {
                                return Ok(());
                            }
                            std::thread::sleep(Duration::from_millis(10));
                        }
                        Err(e) => return Err(e.into()),
                    }
                };
                c.set_nonblocking(false)?;
                c.set_write_timeout(Some(Duration::from_millis(200)))?;
                let chunk = [0x5au8; 16384];
                while !stop.load(Ordering::Relaxed) {
                    let _ = c.write(&chunk);
                }
                Ok(())
            })
            .unwrap();
        });
        std::thread::sleep(Duration::from_millis(200));
        s.spawn(|| {
            in_netns(&a.netns, || {
                let mut c =
                    TcpStream::connect_timeout(&(b_ip, 7071).into(), Duration::from_secs(2))?;
                c.set_read_timeout(Some(Duration::from_millis(100)))?;
                let mut buf = [0u8; 65536];
                while !stop.load(Ordering::Relaxed) {
                    if matches!(c.read(&mut buf), Ok(n) if n > 0) {
                        tcp_last.store(now(), Ordering::Relaxed);
                    }
                }
                Ok(())
            })
            .unwrap();
        });
        // Eight UDP exchanges: whichever packet of each the kernel path
        // sees first, none may go on.
        for _ in 0..8 {
            s.spawn(|| {
                in_netns(&a.netns, || {
                    let sock = UdpSocket::bind("0.0.0.0:0")?;
                    sock.set_read_timeout(Some(Duration::from_millis(1)))?;
                    let mut buf = [0u8; 64];
                    while !stop.load(Ordering::Relaxed) {
                        let _ = sock.send_to(b"ping", (b_ip, 80));
                        if sock.recv_from(&mut buf).is_ok() {
                            udp_last.store(now(), Ordering::Relaxed);
                        }
                    }
                    Ok(())
                })
                .unwrap();
            });
        }
        // Both flowing on the fast path: each has delivered within the last
        // 100 ms (waited for up to 5 s: on a loaded machine a flow can
        // pause for longer than that at one instant).
        let flowing = || {
            let t = now();
            udp_last.load(Ordering::Relaxed) + 100 > t && tcp_last.load(Ordering::Relaxed) + 100 > t
        };
        let until = now() + 5000;
        while !flowing() && now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        let t = now();
        assert!(
            flowing(),
            "both flows run before the policy: at {t} ms, the last UDP echo at {} ms, the last TCP data at {} ms",
            udp_last.load(Ordering::Relaxed),
            tcp_last.load(Ordering::Relaxed)
        );
        node.create_policy(np(
            "x",
            "b-closed",
            json!({ "podSelector": { "matchLabels": { "app": "b" } }, "policyTypes": ["Ingress"] }),
        ))
        .unwrap();
        // Both stop (no data for 2 s in a row) within 10 s.
        let policy_at = now();
        let mut stopped = None;
        while now() < policy_at + 10_000 {
            let quiet = now().saturating_sub(
                udp_last
                    .load(Ordering::Relaxed)
                    .max(tcp_last.load(Ordering::Relaxed)),
            );
            if quiet > 2000 {
                stopped = Some(
                    udp_last
                        .load(Ordering::Relaxed)
                        .max(tcp_last.load(Ordering::Relaxed)),
                );
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::Relaxed);
        let (u, t) = (
            udp_last.load(Ordering::Relaxed),
            tcp_last.load(Ordering::Relaxed),
        );
        assert!(
            stopped.is_some(),
            "flows go on after the policy: last UDP echo {} ms, last TCP data {} ms after it\n{}\n{}",
            u.saturating_sub(policy_at),
            t.saturating_sub(policy_at),
            node.net.node.exec(&["nft", "list", "table", "inet", "xdpcni"]).unwrap_or_default(),
            node.agent_log()
        );
        eprintln!(
            "netpol: after the policy, the last UDP echo came {} ms later, the last pushed TCP data {} ms later",
            u.saturating_sub(policy_at),
            t.saturating_sub(policy_at)
        );
    });
    assert_eq!(
        entry_id().as_deref(),
        Some(id_before.as_str()),
        "b's connection to the node kept its conntrack entry"
    );
    node_to_b.write_all(b"still here").unwrap();
    b_to_node
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut got = [0u8; 10];
    b_to_node.read_exact(&mut got).unwrap();
    assert_eq!(
        &got, b"still here",
        "b's connection to the node carries data"
    );
    for p in [a, b] {
        node.del_pod(p).unwrap();
    }
}

/// The table's notation, without a node: every step parses and every rule
/// names pods; `* > x` refuses the 24 pairs into x (a pod and itself are
/// never probed), per-port rules cover the four ports.
#[test]
fn netpol_truth_table_data_parses_and_its_rules_name_the_pairs_they_say() {
    let table: Table =
        serde_json::from_str(include_str!("data/netpol-truth-table.json")).expect("the table");
    assert_eq!(table.steps.len(), 22);
    for step in &table.steps {
        let e = Expect::of(&step.refused);
        assert_eq!(e.0.len(), 4, "{}", step.name);
    }
    let into_x = refused_pairs(&["* > x".to_string()]);
    assert_eq!(into_x.len(), 24);
    assert!(into_x.iter().all(|(s, d)| *d < 3 && s != d));
    let one = refused_pairs(&["yb > xa, xc".to_string()]);
    assert_eq!(one, BTreeSet::from([(4, 0), (4, 2)]));
}

/// A table made anew starts at generation 1, and so does one whose 16-bit
/// generation wrapped: a connection marked by an earlier ruleset of the
/// same number (here: a table deleted, as `xdpcni uninstall` does, with
/// its connections kept) would pass as allowed without a check. The first
/// transaction clears the generation from every mark first, and leaves the
/// mark's other bits alone.
#[test]
fn netpol_a_new_generation_cycle_forgets_the_marks_of_earlier_rulesets() {
    use xdpcni_agent::netpol::nft::MARK_MASK;
    let ns = xdpcni_e2e::netns::Netns::new("xg").unwrap();
    // Entries as an earlier table left them: generation 1 (with the low
    // bits another user set), and one with only the low bits.
    let insert = |sport: &str, mark: u32| {
        ns.exec(&[
            "conntrack",
            "-I",
            "-s",
            "10.9.0.1",
            "-d",
            "10.9.0.2",
            "-p",
            "udp",
            "--sport",
            sport,
            "--dport",
            "53",
            "--timeout",
            "300",
            "--mark",
            &mark.to_string(),
        ])
        .unwrap();
    };
    insert("1000", (1 << 16) | 5);
    insert("1001", 7);
    let marks = || {
        let listed = ns.exec(&["conntrack", "-L"]).unwrap();
        let mut m: Vec<(String, u32)> = listed
            .lines()
            .filter_map(|l| {
                let sport = l.split_whitespace().find(|w| w.starts_with("sport="))?;
                let mark = l.split_whitespace().find(|w| w.starts_with("mark="))?;
                Some((sport[6..].to_string(), mark[5..].parse().ok()?))
            })
            .collect();
        m.sort();
        m
    };
    assert_eq!(
        marks(),
        vec![("1000".to_string(), (1 << 16) | 5), ("1001".to_string(), 7)]
    );
    deny_all_in(&ns, "10.9.0.2");
    let after = marks();
    assert_eq!(
        after,
        vec![("1000".to_string(), 5), ("1001".to_string(), 7)],
        "generation bits {MARK_MASK:#x} cleared, the rest kept"
    );
}
