//! kube-proxy as the oracle (issue 55): for each shape, the same client
//! once translated by the agent's programs (inside the test cgroup they are
//! attached to) and once through a real kube-proxy 1.20.2's rules alone
//! (outside it), on one node with its API server (`xdpcni_e2e::oracle`).
//! What each client and backend saw must agree. The ClusterIP shapes from
//! pods are in `service_equiv.rs` (also named `kpr_*`). Needs root, bpffs,
//! cgroup v2, iptables, containernetworking-plugins and
//! scripts/k8s-build.sh.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{net::IpAddr, time::Duration};

use serde_json::{json, Value};
use xdpcni_e2e::{
    cgroup::TestCgroup,
    cluster::{KubeNode, TestPod, NODE},
    node::AgentConfig,
    oracle::{
        create, follow, kube_proxy, probe, rules, set_ready, status, translated, wait_for,
        wait_rules, Seen, Shape, REMOTE4, REMOTE6,
    },
};

/// A node with the agent translating inside a test cgroup, kube-proxy
/// beside it, a client pod and backends `b1`, `b2`.
struct Fixture {
    cg: TestCgroup,
    node: KubeNode,
    client: TestPod,
    b: Vec<TestPod>,
    _proxy: xdpcni_e2e::cni::NodeProcess,
}

fn fixture(config: impl FnOnce(&mut AgentConfig)) -> Fixture {
    let cg = TestCgroup::new().unwrap();
    let cg_path = cg.path.clone();
    let node = KubeNode::start(|c| {
        c.services.cgroup = cg_path;
        config(c);
    })
    .unwrap();
    let client = node
        .add_pod("default", "client", json!({}), json!([]))
        .unwrap();
    let b = ["b1", "b2"]
        .iter()
        .map(|n| node.add_pod("default", n, json!({}), json!([])).unwrap())
        .collect();
    // Each ICMP error the node sends a client is sent (a refusal or an
    // unreachable never becomes a timeout on one side alone).
    node.net
        .node
        .sysctl("net.ipv4.icmp_ratelimit", "0")
        .unwrap();
    node.net
        .node
        .sysctl("net.ipv6.icmp.ratelimit", "0")
        .unwrap();
    let proxy = kube_proxy(&node).unwrap();
    Fixture {
        cg,
        node,
        client,
        b,
        _proxy: proxy,
    }
}

/// [`fixture`] with the node's own sockets translated, with kube-proxy's
/// clusterCIDR (`oracle::kube_proxy`'s).
fn node_sockets_fixture() -> Fixture {
    fixture(|c| {
        c.services.node_sockets = true;
        c.services.cluster_cidrs = vec![
            "10.78.0.0/16".parse().unwrap(),
            "fd78::/48".parse().unwrap(),
        ];
    })
}

fn shape(name: &str, labels: Value, family: &'static str, ready: Vec<IpAddr>) -> Shape {
    Shape {
        name: name.into(),
        labels,
        spec: json!({}),
        families: if family == "IPv6" {
            &["IPv6"]
        } else {
            &["IPv4"]
        },
        ready,
        not_ready: vec![],
    }
}

/// The agent's frontends of Service `name`.
fn frontends_of(node: &KubeNode, name: &str) -> usize {
    status(node).unwrap()["services"]["frontends"]
        .as_array()
        .map_or(0, |a| {
            a.iter()
                .filter(|f| f["service"] == format!("default/{name}"))
                .count()
        })
}

/// Services labelled `service.kubernetes.io/service-proxy-name` (another
/// proxy's, with a value or an empty one) or `service.kubernetes.io/headless`
/// are served by neither side: no rule of kube-proxy's, no translation, the
/// same failure for the client. One labelled with the name the agent is
/// configured to answer to is translated, and kube-proxy leaves it alone.
#[test]
fn kpr_service_proxy_name_and_headless_labels_as_kube_proxy() {
    let f = fixture(|c| c.services.proxy_name = Some("xdpcni".into()));
    let cns = f.client.netns.name().to_string();
    let b1 = &f.b[0];
    let labelled = [
        (
            "named",
            json!({ "service.kubernetes.io/service-proxy-name": "foo-bar" }),
        ),
        (
            "named-empty",
            json!({ "service.kubernetes.io/service-proxy-name": "" }),
        ),
        ("headless", json!({ "service.kubernetes.io/headless": "" })),
        (
            "ours",
            json!({ "service.kubernetes.io/service-proxy-name": "xdpcni" }),
        ),
    ];
    let mut vips = Vec::new();
    for family in ["IPv4", "IPv6"] {
        let v6 = family == "IPv6";
        for (name, labels) in &labelled {
            let s = shape(
                &format!("{name}-{}", &family[2..]),
                labels.clone(),
                family,
                vec![b1.ip(v6)],
            );
            vips.push((s.name.clone(), create(&f.node, &s).unwrap()[0], v6));
        }
    }
    // A plain Service, made last: once both sides serve it, both have seen
    // the labelled ones before it.
    let plain = shape("plain", json!({}), "IPv4", vec![b1.ip(false)]);
    let plain_ip = create(&f.node, &plain).unwrap()[0];
    wait_for(
        "the agent's plain frontends",
        Duration::from_secs(10),
        || frontends_of(&f.node, "plain") == 3,
    )
    .unwrap();
    wait_rules(&f.node, &[&plain]).unwrap();
    let (v4, v6) = rules(&f.node);
    for (name, _, _) in &vips {
        assert!(
            !v4.contains(&format!("default/{name}:")) && !v6.contains(&format!("default/{name}:")),
            "kube-proxy has rules for {name}"
        );
        let ours = name.starts_with("ours");
        assert_eq!(
            frontends_of(&f.node, name),
            if ours { 3 } else { 0 },
            "the agent's frontends of {name}"
        );
    }

    let mut report = Vec::new();
    let b1_saw = |v6: bool| format!("default/b1 {}", f.client.ip(v6));
    let mut check = |what: &str, to: (IpAddr, u16), proto: &str, served_by_us: bool| {
        let t0 = translated(&f.node).unwrap();
        let ours = probe(&f.cg, &cns, true, proto, to, 1).unwrap();
        let t1 = translated(&f.node).unwrap();
        let theirs = probe(&f.cg, &cns, false, proto, to, 1).unwrap();
        report.push(format!(
            "{what} {proto}: translated {ours:?}, kube-proxy {theirs:?}"
        ));
        let answered = |s: &Seen| s.keys().any(|k| !k.starts_with("error"));
        assert!(
            !answered(&theirs),
            "{what}: kube-proxy served it: {theirs:?}"
        );
        if served_by_us {
            assert_eq!(t1 - t0, 1, "{what}: not translated");
            assert_eq!(
                ours.keys().collect::<Vec<_>>(),
                vec![&b1_saw(to.0.is_ipv6())],
                "{what}"
            );
        } else {
            assert_eq!(t1, t0, "{what}: translated");
            assert_eq!(ours, theirs, "{what}: the two sides differ");
        }
    };
    for (name, vip, v6) in &vips {
        let protos: &[&str] = if *v6 {
            &["tcp"]
        } else {
            &["tcp", "udp-connected"]
        };
        for proto in protos {
            check(name, (*vip, 8080), proto, name.starts_with("ours"));
        }
    }
    // The control: both sides serve the plain Service.
    let t0 = translated(&f.node).unwrap();
    let ours = probe(&f.cg, &cns, true, "tcp", (plain_ip, 8080), 3).unwrap();
    let theirs = probe(&f.cg, &cns, false, "tcp", (plain_ip, 8080), 3).unwrap();
    assert_eq!(translated(&f.node).unwrap() - t0, 3);
    assert_eq!(ours, theirs, "plain");
    assert_eq!(ours.keys().collect::<Vec<_>>(), vec![&b1_saw(false)]);
    report.push(format!(
        "plain tcp: translated {ours:?}, kube-proxy {theirs:?}"
    ));
    eprintln!("{}", report.join("\n"));
}

/// The backends, in order, that a run of answers named (errors left out).
fn backends(runs: &[(String, u32)]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (answer, _) in runs.iter().filter(|(a, _)| !a.starts_with("error")) {
        let name = answer.split(' ').next().unwrap_or_default().to_string();
        if out.last() != Some(&name) {
            out.push(name);
        }
    }
    out
}

/// One connected UDP socket to a ClusterIP, a datagram every 100 ms, while
/// the Service's only backend is replaced (b1 -> b2). kube-proxy deletes the
/// removed endpoint's conntrack entries, so the same socket's next
/// datagrams reach b2. A translated socket is connected to b1 itself: the
/// agent closes it, the client sees ECONNABORTED once and, connecting again
/// as a resilient client does, reaches b2. Either way the client goes from
/// b1 to b2 within the run and never back. A socket connected to b1's own
/// address is not closed. IPv4 and IPv6.
#[test]
fn kpr_connected_udp_socket_whose_backend_is_replaced() {
    let f = fixture(|_| {});
    let cns = f.client.netns.name().to_string();
    let (b1, b2) = (&f.b[0], &f.b[1]);
    let mut report = Vec::new();
    for family in ["IPv4", "IPv6"] {
        let v6 = family == "IPv6";
        let s = shape(
            &format!("swap-{}", &family[2..]),
            json!({}),
            family,
            vec![b1.ip(v6)],
        );
        let vip = create(&f.node, &s).unwrap()[0];
        wait_rules(&f.node, &[&s]).unwrap();
        for inside in [true, false] {
            let side = if inside { "translated" } else { "kube-proxy" };
            set_ready(&f.node, &s.name, &[b1.ip(v6)]).unwrap();
            wait_for(
                &format!("{side}: b1 answering"),
                Duration::from_secs(30),
                || {
                    probe(&f.cg, &cns, inside, "udp-connected", (vip, 8080), 1)
                        .is_ok_and(|seen| seen.keys().all(|k| k.starts_with("default/b1 ")))
                },
            )
            .unwrap();
            let closed0 = f.node.metrics().unwrap()["xdpcni_service_sockets_closed_total"];
            let (runs, direct) = std::thread::scope(|sc| {
                let through = sc.spawn(|| follow(&f.cg, &cns, inside, (vip, 8080), 6.0));
                let direct =
                    inside.then(|| sc.spawn(|| follow(&f.cg, &cns, true, (b1.ip(v6), 80), 6.0)));
                std::thread::sleep(Duration::from_secs(2));
                set_ready(&f.node, &s.name, &[b2.ip(v6)]).unwrap();
                (
                    through.join().unwrap().unwrap(),
                    direct.map(|d| d.join().unwrap().unwrap()),
                )
            });
            let closed = f.node.metrics().unwrap()["xdpcni_service_sockets_closed_total"] - closed0;
            report.push(format!(
                "{family} {side}: {runs:?}{}, sockets closed {closed}",
                direct
                    .as_ref()
                    .map(|d| format!(", direct to b1 {d:?}"))
                    .unwrap_or_default()
            ));
            let what = format!("{family} {side}: {runs:?}");
            assert_eq!(backends(&runs), ["default/b1", "default/b2"], "{what}");
            let last = runs.last().unwrap();
            assert!(
                last.0.starts_with("default/b2 ") && last.1 >= 15,
                "{what}: b2 did not answer the last 1.5 s"
            );
            let aborts: Vec<&(String, u32)> =
                runs.iter().filter(|(a, _)| a == "error aborted").collect();
            if inside {
                assert_eq!(aborts, [&("error aborted".to_string(), 1)], "{what}");
                assert_eq!(closed, 1.0, "{what}: sockets closed");
                let d = direct.unwrap();
                assert_eq!(backends(&d), ["default/b1"], "{what}: direct {d:?}");
                assert!(d.iter().all(|(a, _)| a != "error aborted"), "direct {d:?}");
            } else {
                assert!(aborts.is_empty(), "{what}");
                assert_eq!(closed, 0.0, "{what}: sockets closed");
            }
        }
    }
    eprintln!("{}", report.join("\n"));
}

/// The node's own sockets (`services.nodeSockets`, with kube-proxy's
/// clusterCIDR) to ClusterIPs, against kube-proxy: the same backends, and
/// the same source address each backend sees. kube-proxy keeps the source
/// the route toward the ClusterIP gave (10.78.1.1, in its clusterCIDR: the
/// `kept` shapes) and masquerades one outside it (192.168.77.1 and fd77::1,
/// the route's source toward the `masq` shapes' ClusterIPs): the
/// translation binds the first and leaves the second to the backend's
/// route, as MASQUERADE chooses. A backend on the node itself (hostNetwork,
/// `own`) and a Service without a ready backend stay kube-proxy's.
#[test]
fn kpr_node_sockets_to_clusterips_as_kube_proxy() {
    let f = node_sockets_fixture();
    let (node, cg, b) = (&f.node, &f.cg, &f.b);
    let _far = xdpcni_e2e::oracle::remote(node).unwrap();
    let n = &node.net.node;
    // The masq shapes' ClusterIPs are routed from a source outside the
    // clusterCIDR, before the agent first sees them.
    let masq_vip: [IpAddr; 2] = [
        "10.96.77.77".parse().unwrap(),
        "fd96::7777".parse().unwrap(),
    ];
    n.ip(&["addr", "add", "192.168.77.1/32", "dev", "lo"])
        .unwrap();
    n.ip(&["-6", "addr", "add", "fd77::1/128", "dev", "lo", "nodad"])
        .unwrap();
    n.ip(&[
        "route",
        "add",
        "10.96.77.77/32",
        "via",
        REMOTE4,
        "src",
        "192.168.77.1",
    ])
    .unwrap();
    n.ip(&[
        "-6",
        "route",
        "add",
        "fd96::7777/128",
        "via",
        REMOTE6,
        "src",
        "fd77::1",
    ])
    .unwrap();
    // A hostNetwork backend: a server in the node's namespace, reached at
    // the node's own address on the link to "another node".
    let own: [IpAddr; 2] = [
        "10.78.1.1".parse().unwrap(),
        "fd78:0:0:1::1".parse().unwrap(),
    ];
    let _host_server = xdpcni_e2e::cni::NodeProcess::spawn_env(
        n,
        &xdpcni_e2e::cluster::podtool().unwrap(),
        &["serve", "80", "81"],
        &[("PODTOOL_NAME", "node/host")],
        &node.net.dir.path().join("serve-host.log"),
    )
    .unwrap();
    let remote: [IpAddr; 2] = [REMOTE4.parse().unwrap(), REMOTE6.parse().unwrap()];
    let nns = n.name().to_string();
    let mut shapes = Vec::new();
    for (v6, family) in [(false, "IPv4"), (true, "IPv6")] {
        let i = usize::from(v6);
        let fam = &family[2..];
        let pods = vec![b[0].ip(v6), b[1].ip(v6)];
        let mut add = |name: &str, spec: Value, ready: Vec<IpAddr>, not_ready: Vec<IpAddr>| {
            let mut sh = shape(&format!("{name}-{fam}"), json!({}), family, ready);
            sh.spec = spec;
            sh.not_ready = not_ready;
            shapes.push(sh);
        };
        add("kept", json!({}), pods.clone(), vec![]);
        add("far", json!({}), vec![b[0].ip(v6), remote[i]], vec![]);
        add(
            "masq",
            json!({ "clusterIP": masq_vip[i].to_string() }),
            vec![b[0].ip(v6), remote[i]],
            vec![],
        );
        add("empty", json!({}), vec![], vec![b[1].ip(v6)]);
        add(
            "sticky",
            json!({ "sessionAffinity": "ClientIP" }),
            pods,
            vec![],
        );
        add("own", json!({}), vec![own[i]], vec![]);
    }
    let vips: Vec<IpAddr> = shapes.iter().map(|s| create(node, s).unwrap()[0]).collect();
    wait_rules(node, &shapes.iter().collect::<Vec<_>>()).unwrap();
    for s in &shapes {
        wait_for("the agent's frontends", Duration::from_secs(10), || {
            frontends_of(node, &s.name) == 3
        })
        .unwrap();
    }
    for ip in remote.iter().chain(&own) {
        wait_for(
            "the remote and the node's servers",
            Duration::from_secs(10),
            || {
                cg.podtool(false, &nns, &["greet", &ip.to_string(), "80", "1"])
                    .is_ok()
            },
        )
        .unwrap();
    }
    let name_of = |ip: &IpAddr| -> String {
        if remote.contains(ip) {
            "remote/r1".into()
        } else if own.contains(ip) {
            "node/host".into()
        } else if b[0].ips.contains(ip) {
            "default/b1".into()
        } else {
            "default/b2".into()
        }
    };
    let mut report = Vec::new();
    for (s, &vip) in shapes.iter().zip(&vips) {
        let reachable = s.ready.clone();
        let left = reachable.is_empty() || reachable.iter().any(|ip| own.contains(ip));
        for proto in ["tcp", "udp", "udp-connected"] {
            // podtool's connected UDP socket is bound to a port before it
            // connects: it cannot be bound to the kept source any more, so
            // a shape whose source kube-proxy keeps leaves it to kube-proxy.
            let left = left || (proto == "udp-connected" && !s.name.starts_with("masq"));
            // Refusals, and the backend on the node (timeouts for UDP),
            // need few probes.
            let n = if left && !reachable.is_empty() && proto == "tcp" {
                20
            } else if reachable.is_empty() || s.name.starts_with("own") {
                3
            } else {
                20
            };
            let t0 = translated(node).unwrap();
            let ours = probe(cg, &nns, true, proto, (vip, 8080), n).unwrap();
            let t1 = translated(node).unwrap();
            let theirs = probe(cg, &nns, false, proto, (vip, 8080), n).unwrap();
            let t2 = translated(node).unwrap();
            let what = format!("{} {vip} {proto}", s.name);
            report.push(format!(
                "{what}: translated {ours:?}, kube-proxy {theirs:?}"
            ));
            assert_eq!(t2, t1, "{what}: the run outside the cgroup was translated");
            let calls = if proto == "udp" { 2 * n } else { n };
            let want = if left { 0 } else { u64::from(calls) };
            assert_eq!(t1 - t0, want, "{what}: translated calls");
            if s.spec.get("sessionAffinity").is_some() {
                // One backend each side (either), seeing the same source.
                let src = |m: &Seen| -> Vec<String> {
                    m.keys()
                        .map(|k| k.split(' ').nth(1).unwrap_or_default().to_string())
                        .collect()
                };
                assert_eq!(ours.len(), 1, "{what}: {ours:?}");
                assert_eq!(theirs.len(), 1, "{what}: {theirs:?}");
                assert_eq!(src(&ours), src(&theirs), "{what}");
                continue;
            }
            // The same backends, each seeing the same source.
            assert_eq!(
                ours.keys().collect::<Vec<_>>(),
                theirs.keys().collect::<Vec<_>>(),
                "{what}"
            );
            // kube-proxy itself does not carry the node's UDP to a backend
            // at the node's own address (timeouts; the translation leaves
            // it to kube-proxy, and the two sides agree above).
            let own_udp = s.name.starts_with("own") && proto != "tcp";
            if !reachable.is_empty() && !own_udp {
                let mut want: Vec<String> = reachable.iter().map(name_of).collect();
                want.sort();
                let names: Vec<String> = theirs
                    .keys()
                    .map(|k| k.split(' ').next().unwrap_or_default().to_string())
                    .collect();
                assert_eq!(names, want, "{what}: kube-proxy's backends: {theirs:?}");
            }
        }
    }
    eprintln!("{}", report.join("\n"));
}

/// External IPs that are no address of the node.
const FOREIGN: [&str; 2] = ["192.0.2.7", "2001:db8::7"];

/// The TCP ports of the oracle's Services alone.
fn tcp_only() -> Value {
    json!([
        { "name": "http", "port": 8080, "targetPort": 80 },
        { "name": "alt", "port": 8081, "targetPort": "alt" },
    ])
}

/// Whether the agent's status lists frontend `addr` (as "ip:port").
fn has_frontend(node: &KubeNode, addr: &str) -> bool {
    status(node).unwrap()["services"]["frontends"]
        .as_array()
        .is_some_and(|a| a.iter().any(|f| f["frontend"] == addr))
}

/// The node's own sockets (`services.nodeSockets`) to node ports (at each
/// node address: the link's, the pods' gateway on lo, 127.0.0.1),
/// externalIPs and LoadBalancer IPs, node ports and balancer IPs under
/// `externalTrafficPolicy` Cluster and Local, against kube-proxy: the same
/// backends (a local pod and "another node's"), each seeing the same
/// source. kube-proxy 1.20 masquerades a node's call to a node port or
/// balancer IP under Cluster and to an externalIP always, and under Local
/// unless its source is in the clusterCIDR (10.78.1.1 here, the route's
/// source toward the balancer IPs and the link's own address): those
/// `kept` sources the translation binds. An externalIP that is no address
/// of the node kube-proxy does not serve to the node's sockets: neither is
/// it translated (both time out).
#[test]
fn kpr_node_sockets_to_node_ports_external_and_balancer_ips_as_kube_proxy() {
    let f = node_sockets_fixture();
    let (node, cg, b) = (&f.node, &f.cg, &f.b);
    let _far = xdpcni_e2e::oracle::remote(node).unwrap();
    let nns = node.net.node.name().to_string();
    let remote: [IpAddr; 2] = [REMOTE4.parse().unwrap(), REMOTE6.parse().unwrap()];
    for ip in &remote {
        wait_for("the remote server", Duration::from_secs(10), || {
            cg.podtool(false, &nns, &["greet", &ip.to_string(), "80", "1"])
                .is_ok()
        })
        .unwrap();
    }
    // (shape, spec, balancer IPs, [(address to call, source kept)] per family)
    type Calls = [Vec<(&'static str, bool)>; 2];
    let node_addrs = |local: bool| -> Calls {
        [
            vec![
                ("10.78.1.1", local),
                ("10.99.0.1", false),
                ("127.0.0.1", false),
            ],
            vec![("fd78:0:0:1::1", local), ("fd99::1", false)],
        ]
    };
    let table: Vec<(&str, Value, Calls)> = vec![
        ("np", json!({ "type": "NodePort" }), node_addrs(false)),
        (
            "npl",
            json!({ "type": "NodePort", "externalTrafficPolicy": "Local" }),
            node_addrs(true),
        ),
        // An externalIP that is the node's own (always masqueraded), and
        // one that is not: kube-proxy 1.20 serves no node socket that one.
        (
            "ext",
            json!({ "externalIPs": [] }),
            [
                vec![("10.78.1.1", false), ("192.0.2.7", false)],
                vec![("fd78:0:0:1::1", false), ("2001:db8::7", false)],
            ],
        ),
        // A LoadBalancer of Kubernetes 1.20 has one protocol: TCP alone.
        (
            "lb",
            json!({ "type": "LoadBalancer", "ports": tcp_only() }),
            [vec![("198.51.100.9", false)], vec![("2001:db8::9", false)]],
        ),
        (
            "lbl",
            json!({ "type": "LoadBalancer", "externalTrafficPolicy": "Local", "ports": tcp_only() }),
            [vec![("198.51.100.10", true)], vec![("2001:db8::a", true)]],
        ),
    ];
    let mut probes: Vec<(String, IpAddr, u16, Option<u16>, bool, bool)> = Vec::new();
    let mut shapes = Vec::new();
    for (v6, family) in [(false, "IPv4"), (true, "IPv6")] {
        let i = usize::from(v6);
        for (name, spec, calls) in &table {
            let mut sh = shape(
                &format!("{name}-{}", &family[2..]),
                json!({}),
                family,
                vec![b[0].ip(v6), remote[i]],
            );
            let mut spec = spec.clone();
            if let Some(ext) = spec.get_mut("externalIPs") {
                // The family's own external IPs.
                *ext = calls[i].iter().map(|c| c.0).collect::<Vec<_>>().into();
            }
            sh.spec = spec;
            create(node, &sh).unwrap();
            if name.starts_with("lb") {
                let ips: Vec<IpAddr> = calls[i].iter().map(|c| c.0.parse().unwrap()).collect();
                xdpcni_e2e::oracle::set_balancer(node, &sh.name, &ips).unwrap();
            }
            let nps = xdpcni_e2e::oracle::node_ports(node, &sh.name).unwrap();
            for &(addr, kept) in &calls[i] {
                let ip: IpAddr = addr.parse().unwrap();
                let (tcp, udp) = if name.starts_with("np") {
                    (nps["http"], Some(nps["dns"]))
                } else if name.starts_with("lb") {
                    (8080, None)
                } else {
                    (8080, Some(8080))
                };
                let served = !FOREIGN.contains(&addr);
                probes.push((sh.name.clone(), ip, tcp, udp, kept, served));
            }
            shapes.push(sh);
        }
    }
    wait_rules(node, &shapes.iter().collect::<Vec<_>>()).unwrap();
    for (name, ip, tcp, udp, ..) in probes.iter().filter(|p| p.5) {
        for port in std::iter::once(tcp).chain(udp) {
            let fe = std::net::SocketAddr::new(*ip, *port).to_string();
            wait_for(
                &format!("{name}: the agent's {fe}"),
                Duration::from_secs(10),
                || has_frontend(node, &fe),
            )
            .unwrap();
        }
    }
    for (name, ip, tcp, udp, kept, served) in &probes {
        let protos: &[&str] = if udp.is_some() && *served {
            &["tcp", "udp", "udp-connected"]
        } else {
            &["tcp"]
        };
        for &proto in protos {
            let port = if proto == "tcp" { *tcp } else { udp.unwrap() };
            // A kept source cannot be bound to podtool's connected UDP
            // socket (bound to a port first): left to kube-proxy.
            let left = (*kept && proto == "udp-connected") || !served;
            // Two backends chosen at random: 20 calls reach both but for
            // one run in 2^19. Timeouts need no more than 2.
            let n = if *served { 20 } else { 2 };
            let t0 = translated(node).unwrap();
            let ours = probe(cg, &nns, true, proto, (*ip, port), n).unwrap();
            let t1 = translated(node).unwrap();
            let theirs = probe(cg, &nns, false, proto, (*ip, port), n).unwrap();
            let t2 = translated(node).unwrap();
            let what = format!("{name} {ip}:{port} {proto}");
            eprintln!("{what}: translated {ours:?}, kube-proxy {theirs:?}");
            if *served && theirs.keys().any(|k| k.starts_with("error")) {
                let (v4, v6) = rules(node);
                let mine: Vec<&str> = v4
                    .lines()
                    .chain(v6.lines())
                    .filter(|l| l.contains(name.as_str()))
                    .collect();
                eprintln!("kube-proxy's rules for {name}:\n{}", mine.join("\n"));
            }
            assert_eq!(t2, t1, "{what}: the run outside the cgroup was translated");
            let calls = if proto == "udp" { 2 * n } else { n };
            assert_eq!(
                t1 - t0,
                if left { 0 } else { u64::from(calls) },
                "{what}: translated calls"
            );
            // The same backends, each seeing the same source, and both.
            assert_eq!(
                ours.keys().collect::<Vec<_>>(),
                theirs.keys().collect::<Vec<_>>(),
                "{what}"
            );
            let names: Vec<&str> = theirs
                .keys()
                .map(|k| k.split(' ').next().unwrap_or_default())
                .collect();
            let want: &[&str] = if *served {
                &["default/b1", "remote/r1"]
            } else {
                &["error"]
            };
            assert_eq!(names, want, "{what}: {theirs:?}");
        }
    }
    // An address the node gains later serves its node ports at once (the
    // agent follows the kernel's announcements; its resync is minutes
    // away), as kube-proxy serves every local address; and stops with it.
    let (added, np) = ("10.78.1.60", probes[0].2);
    let fe = format!("{added}:{np}");
    let n = &node.net.node;
    n.ip(&["addr", "add", &format!("{added}/32"), "dev", "lo"])
        .unwrap();
    wait_for(&format!("the agent's {fe}"), Duration::from_secs(5), || {
        has_frontend(node, &fe)
    })
    .unwrap();
    let to = (added.parse().unwrap(), np);
    let t0 = translated(node).unwrap();
    let ours = probe(cg, &nns, true, "tcp", to, 20).unwrap();
    let t1 = translated(node).unwrap();
    let theirs = probe(cg, &nns, false, "tcp", to, 20).unwrap();
    eprintln!("{fe} (added) tcp: translated {ours:?}, kube-proxy {theirs:?}");
    assert_eq!(t1 - t0, 20, "{fe}: translated calls");
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>(),
        "{fe}"
    );
    n.ip(&["addr", "del", &format!("{added}/32"), "dev", "lo"])
        .unwrap();
    wait_for(&format!("{fe} gone"), Duration::from_secs(5), || {
        !has_frontend(node, &fe)
    })
    .unwrap();
}

/// What a health check port answered: status, Content-Type,
/// X-Content-Type-Options, body; `None` when nothing listens.
type HcAnswer = Option<(u16, String, String, String)>;

/// One GET of `addr`'s `/healthz` from the node's namespace.
fn health_check_get(node: &KubeNode, addr: std::net::SocketAddr) -> HcAnswer {
    let request = b"GET /healthz HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n".to_vec();
    let a = xdpcni_e2e::cni::http_exchange(&node.net.node, &addr.to_string(), request).ok()?;
    let header = |name: &str| a.header(name).unwrap_or_default().to_string();
    Some((
        a.status,
        header("content-type"),
        header("x-content-type-options"),
        a.body.clone(),
    ))
}

/// Makes `subsets` the Endpoints of Service `name`.
fn set_subsets(node: &KubeNode, name: &str, subsets: Value) {
    let patch = json!({ "subsets": subsets });
    let name = name.to_string();
    node.client(move |c| async move {
        kube::Api::<k8s_openapi::api::core::v1::Endpoints>::namespaced(c, "default")
            .patch(
                &name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await?;
        Ok(())
    })
    .unwrap();
}

/// The health check node port of a LoadBalancer under
/// `externalTrafficPolicy: Local`, answered first by kube-proxy alone and
/// then, kube-proxy gone, by the agent (`services.healthCheckNodePorts`):
/// for each state of the Service's endpoints (none; one local; two local
/// beside a not-ready local one and a ready one on another node; none
/// ready here but one elsewhere) both give the same status, headers and
/// body, at 127.0.0.1, the node's address and [::1]. A load balancer under
/// `externalTrafficPolicy: Cluster` has no health check port on either.
#[test]
fn kpr_health_check_node_ports_as_kube_proxy() {
    let cg = TestCgroup::new().unwrap();
    let cg_path = cg.path.clone();
    let mut node = KubeNode::start(|c| {
        c.services.cgroup = cg_path;
        c.services.health_check_node_ports = true;
    })
    .unwrap();
    let some = vec!["10.78.1.50".parse().unwrap()];
    let mut lb = shape("hcl", json!({}), "IPv4", some.clone());
    lb.spec =
        json!({ "type": "LoadBalancer", "externalTrafficPolicy": "Local", "ports": tcp_only() });
    create(&node, &lb).unwrap();
    let mut cluster = shape("hcc", json!({}), "IPv4", some);
    cluster.spec = json!({ "type": "LoadBalancer", "ports": tcp_only() });
    create(&node, &cluster).unwrap();
    let hc_port = |name: &str| -> Option<u16> {
        let name = name.to_string();
        node.client(move |c| async move {
            let svc = kube::Api::<k8s_openapi::api::core::v1::Service>::namespaced(c, "default")
                .get(&name)
                .await?;
            Ok(svc
                .spec
                .and_then(|s| s.health_check_node_port)
                .and_then(|p| u16::try_from(p).ok()))
        })
        .unwrap()
    };
    let port = hc_port("hcl").expect("the API server allocates a health check port");
    assert_eq!(hc_port("hcc"), None);
    let at: Vec<std::net::SocketAddr> = ["127.0.0.1", "10.78.1.1", "::1"]
        .iter()
        .map(|a| std::net::SocketAddr::new(a.parse().unwrap(), port))
        .collect();
    let addr = |ip: &str, node_name: &str| json!({ "ip": ip, "nodeName": node_name });
    let web = json!([{ "name": "http", "port": 80 }]);
    // (state, subsets, local endpoints it has)
    let states: Vec<(&str, Value, u64)> = vec![
        ("no endpoints", json!([]), 0),
        (
            "one local",
            json!([{ "addresses": [addr("10.78.1.50", NODE)], "ports": web }]),
            1,
        ),
        (
            "two local, one not ready, one elsewhere",
            json!([{
                "addresses": [addr("10.78.1.50", NODE), addr("10.78.1.51", NODE),
                              addr("10.78.2.9", "node-b")],
                "notReadyAddresses": [addr("10.78.1.52", NODE)],
                "ports": web,
            }]),
            2,
        ),
        (
            "ready elsewhere only",
            json!([{
                "addresses": [addr("10.78.2.9", "node-b")],
                "notReadyAddresses": [addr("10.78.1.52", NODE)],
                "ports": web,
            }]),
            0,
        ),
    ];

    // kube-proxy alone: the agent (which holds the port) stopped first.
    node.stop_agent(libc::SIGTERM).unwrap();
    wait_for(
        "the agent's health check port closed",
        Duration::from_secs(10),
        || health_check_get(&node, at[0]).is_none(),
    )
    .unwrap();
    let proxy = kube_proxy(&node).unwrap();
    let mut oracle: Vec<Vec<HcAnswer>> = Vec::new();
    let local_endpoints = |a: &HcAnswer| -> Option<Value> {
        let body = &a.as_ref()?.3;
        Some(serde_json::from_str::<Value>(body).ok()?["localEndpoints"].clone())
    };
    for (state, subsets, local) in &states {
        set_subsets(&node, "hcl", subsets.clone());
        // kube-proxy has taken the state in once it counts what it holds.
        wait_for(
            &format!("kube-proxy's answer for {state}"),
            Duration::from_secs(30),
            || local_endpoints(&health_check_get(&node, at[0])) == Some(json!(local)),
        )
        .unwrap();
        let answers: Vec<HcAnswer> = at.iter().map(|a| health_check_get(&node, *a)).collect();
        let status = answers[0].as_ref().unwrap().0;
        assert_eq!(
            status,
            if *local > 0 { 200 } else { 503 },
            "kube-proxy, {state}"
        );
        oracle.push(answers);
    }
    // The agent started while kube-proxy still holds the port: it says
    // so, and takes the port once kube-proxy is gone.
    set_subsets(&node, "hcl", json!([]));
    node.start_agent().unwrap();
    wait_for(
        "the agent's status: the port is taken",
        Duration::from_secs(30),
        || {
            status(&node).unwrap()["services"]["healthChecks"][0]["error"]
                .as_str()
                .is_some_and(|e| e.contains("in use"))
        },
    )
    .unwrap();
    drop(proxy);

    // The agent alone, through the same states.
    for ((state, subsets, _), want) in states.iter().zip(&oracle) {
        set_subsets(&node, "hcl", subsets.clone());
        let mut got = Vec::new();
        let same = wait_for(
            &format!("the agent's answer for {state}"),
            Duration::from_secs(30),
            || {
                got = at.iter().map(|a| health_check_get(&node, *a)).collect();
                got == *want
            },
        );
        assert!(
            same.is_ok(),
            "{state}: kube-proxy answered {want:#?}, the agent {got:#?}"
        );
        println!("{state}: both answered {:?}", want[0]);
    }
    let s = status(&node).unwrap();
    let checks = &s["services"]["healthChecks"];
    assert_eq!(checks[0]["port"], json!(port), "{checks}");
    assert_eq!(checks[0]["service"], "default/hcl", "{checks}");
    assert!(checks[0].get("error").is_none(), "{checks}");
    assert_eq!(checks.as_array().map(Vec::len), Some(1), "{checks}");
    let row = s["services"]["servedBy"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| {
            r["traffic"]
                .as_str()
                .unwrap()
                .starts_with("healthCheckNodePort")
        })
        .cloned()
        .unwrap();
    assert!(row["by"].as_str().unwrap().starts_with("xdpcni"), "{row}");
    // The Service gone: its port closes.
    node.client(|c| async move {
        kube::Api::<k8s_openapi::api::core::v1::Service>::namespaced(c, "default")
            .delete("hcl", &Default::default())
            .await?;
        Ok(())
    })
    .unwrap();
    wait_for(
        "the health check port of a deleted Service closed",
        Duration::from_secs(30),
        || health_check_get(&node, at[0]).is_none(),
    )
    .unwrap();
    drop(cg);
}

/// Whether the agent's status lists `addr` (as "ip:port") as a frontend
/// served to outside clients (north-south), with `backends` backends.
fn has_outside_frontend(node: &KubeNode, addr: &str, backends: u64) -> bool {
    status(node).unwrap()["services"]["frontends"]
        .as_array()
        .is_some_and(|a| {
            a.iter()
                .any(|f| f["frontend"] == addr && f["outside"] == true && f["backends"] == backends)
        })
}

/// Packets of verdict `label` counted on device `dev` of the node.
fn counted(node: &KubeNode, dev: &str, label: &str) -> u64 {
    let ifindex = node.net.node.ifindex(dev).unwrap();
    let v = *xdpcni_ebpf::abi::Verdict::ALL
        .iter()
        .find(|v| v.label() == label)
        .unwrap();
    xdpcni_ebpf::Maps::open_pinned(node.pin_dir())
        .unwrap()
        .counters(ifindex)
        .unwrap()
        .get(v)
        .packets
}

/// North-south (`services.northSouthDevices`): clients outside the node
/// call node ports (at the node's address on their uplink), an externalIP
/// and LoadBalancer IPs, under `externalTrafficPolicy` Cluster and Local,
/// TCP and UDP, IPv4 and IPv6. Two uplinks, each to a client namespace of
/// its own: the agent's program on uplink A alone, so A's client is
/// served by the program (for the backend on this node) and B's by
/// kube-proxy's rules alone, at the same time. Both must see the same:
/// the same backends answering (this node's pod and "another node's"),
/// each seeing the same source (the node's masquerade address under
/// Cluster, the client's own under Local), the frontend answering; a
/// Service with no ready backend refused alike, a Local one with none on
/// this node dropped alike. The program's counters show it carried A's
/// flows (`ns_to_pod` on A, `ns_reply` on the backend's veth) and no
/// flow to a frontend it leaves to kube-proxy.
#[test]
fn kpr_north_south_node_ports_external_and_balancer_ips_from_outside_as_kube_proxy() {
    let (dev_a, dev_b, dev_r) = (
        xdpcni_e2e::netns::unique_name("xua"),
        xdpcni_e2e::netns::unique_name("xub"),
        xdpcni_e2e::netns::unique_name("xr"),
    );
    let config_devs = vec![dev_a.clone(), dev_r.clone()];
    let f = fixture(move |c| {
        c.services.north_south_devices = config_devs;
        c.services.cluster_cidrs = vec![
            "10.78.0.0/16".parse().unwrap(),
            "fd78::/48".parse().unwrap(),
        ];
    });
    let (node, cg, b) = (&f.node, &f.cg, &f.b);
    // "Another node" behind a device the program also runs on, so its
    // replies are caught there: its flows are the program's too.
    let _far = xdpcni_e2e::oracle::remote_on(node, &dev_r).unwrap();
    let a = xdpcni_e2e::oracle::outside(node, &dev_a, 0).unwrap();
    let bo = xdpcni_e2e::oracle::outside(node, &dev_b, 1).unwrap();
    let remote: [IpAddr; 2] = [REMOTE4.parse().unwrap(), REMOTE6.parse().unwrap()];
    // (shape, spec, ready backends: b1 and r1 / r1 alone / none, balancer or external IPs)
    struct Case {
        name: &'static str,
        spec: Value,
        local: bool,
        ready: &'static str,
        ips: [&'static str; 2],
    }
    let cases = [
        Case {
            name: "np",
            spec: json!({ "type": "NodePort" }),
            local: false,
            ready: "both",
            ips: ["", ""],
        },
        Case {
            name: "npl",
            spec: json!({ "type": "NodePort", "externalTrafficPolicy": "Local" }),
            local: true,
            ready: "both",
            ips: ["", ""],
        },
        Case {
            name: "np0",
            spec: json!({ "type": "NodePort" }),
            local: false,
            ready: "none",
            ips: ["", ""],
        },
        Case {
            name: "npl0",
            spec: json!({ "type": "NodePort", "externalTrafficPolicy": "Local" }),
            local: true,
            ready: "remote",
            ips: ["", ""],
        },
        Case {
            name: "ext",
            spec: json!({ "externalIPs": [] }),
            local: false,
            ready: "both",
            ips: ["203.0.113.7", "2001:db8:77::7"],
        },
        Case {
            name: "lb",
            spec: json!({ "type": "LoadBalancer", "ports": tcp_only() }),
            local: false,
            ready: "both",
            ips: ["198.51.100.9", "2001:db8:99::9"],
        },
        Case {
            name: "lbl",
            spec: json!({ "type": "LoadBalancer", "externalTrafficPolicy": "Local", "ports": tcp_only() }),
            local: true,
            ready: "both",
            ips: ["198.51.100.10", "2001:db8:99::a"],
        },
    ];
    /// Service, family index, frontend per client [A, B], TCP port, UDP port, case.
    type Probe<'a> = (String, usize, [IpAddr; 2], u16, Option<u16>, &'a Case);
    let mut probes: Vec<Probe> = Vec::new();
    let mut shapes = Vec::new();
    for (v6, family) in [(false, "IPv4"), (true, "IPv6")] {
        let i = usize::from(v6);
        for c in &cases {
            let ready = match c.ready {
                "both" => vec![b[0].ip(v6), remote[i]],
                "remote" => vec![remote[i]],
                _ => vec![],
            };
            let mut sh = shape(
                &format!("ns{}-{}", c.name, &family[2..]),
                json!({}),
                family,
                ready,
            );
            if c.ready == "none" {
                sh.not_ready = vec![b[0].ip(v6)];
            }
            let mut spec = c.spec.clone();
            if let Some(ext) = spec.get_mut("externalIPs") {
                *ext = json!([c.ips[i]]);
            }
            sh.spec = spec;
            create(node, &sh).unwrap();
            if c.name.starts_with("lb") {
                let ip: IpAddr = c.ips[i].parse().unwrap();
                xdpcni_e2e::oracle::set_balancer(node, &sh.name, &[ip]).unwrap();
            }
            let nps = xdpcni_e2e::oracle::node_ports(node, &sh.name).unwrap();
            let (to, tcp, udp) = if c.name.starts_with("np") {
                ([a.node[i], bo.node[i]], nps["http"], Some(nps["dns"]))
            } else {
                let ip: IpAddr = c.ips[i].parse().unwrap();
                let udp = (c.name == "ext").then_some(8080);
                ([ip, ip], 8080, udp)
            };
            probes.push((sh.name.clone(), i, to, tcp, udp, c));
            shapes.push(sh);
        }
    }
    wait_rules(node, &shapes.iter().collect::<Vec<_>>()).unwrap();
    for (name, _, to, tcp, udp, c) in &probes {
        // Under Local, this node's alone (b1); r1 is node-b's.
        let backends = match (c.ready, c.local) {
            ("both", false) => 2,
            ("both", true) => 1,
            _ => 0,
        };
        for port in std::iter::once(tcp).chain(udp.as_ref()) {
            let fe = std::net::SocketAddr::new(to[0], *port).to_string();
            let waited = wait_for(
                &format!("{name}: the agent's outside {fe}"),
                Duration::from_secs(30),
                || has_outside_frontend(node, &fe, backends),
            );
            if let Err(e) = waited {
                let mine: Vec<Value> = status(node).unwrap()["services"]["frontends"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|f| f["service"] == format!("default/{name}"))
                    .cloned()
                    .collect();
                panic!("{e}: the agent has {mine:#?}");
            }
        }
    }
    assert!(
        status(node).unwrap()["services"]["servedBy"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["by"]
                .as_str()
                .unwrap()
                .starts_with(&format!("xdpcni, at tc on {dev_a}"))),
        "the status names the uplink"
    );
    let b1_veth = b[0].host.clone();
    let (mut carried, mut carried_remote) = (0, 0);
    for (name, i, to, tcp, udp, c) in &probes {
        let protos: &[&str] = if udp.is_some() {
            &["tcp", "udp", "udp-connected"]
        } else {
            &["tcp"]
        };
        for &proto in protos {
            let port = if proto == "tcp" { *tcp } else { udp.unwrap() };
            let n = if c.ready == "both" { 20 } else { 2 };
            let counts = || {
                [
                    counted(node, &dev_a, "ns_to_pod"),
                    counted(node, &b1_veth, "ns_reply"),
                    counted(node, &dev_a, "ns_to_node"),
                    counted(node, &dev_r, "ns_reply"),
                ]
            };
            let c0 = counts();
            let ours = probe(cg, a.netns.name(), false, proto, (to[0], port), n).unwrap();
            let c1 = counts();
            let d: Vec<u64> = c1.iter().zip(c0).map(|(a, b)| a - b).collect();
            let theirs = probe(cg, bo.netns.name(), false, proto, (to[1], port), n).unwrap();
            let what = format!("{name} {}:{port} {proto}", to[0]);
            eprintln!(
                "{what}: A (program) {ours:?}, B (kube-proxy) {theirs:?}; \
                 ns_to_pod +{}, ns_reply (b1) +{}, ns_to_node +{}, ns_reply (r1) +{}",
                d[0], d[1], d[2], d[3]
            );
            // Each client's own address shown as CLIENT: the rest must be equal.
            let norm = |seen: &Seen, client: IpAddr| -> Vec<String> {
                seen.keys()
                    .map(|k| k.replace(&client.to_string(), "CLIENT"))
                    .collect()
            };
            let (mine, kp) = (norm(&ours, a.client[*i]), norm(&theirs, bo.client[*i]));
            assert_eq!(mine, kp, "{what}");
            let names: Vec<&str> = kp
                .iter()
                .map(|k| k.split(' ').next().unwrap_or_default())
                .collect();
            let want: &[&str] = match (c.ready, c.local) {
                ("both", false) => &["default/b1", "remote/r1"],
                ("both", true) => &["default/b1"],
                _ => &["error"],
            };
            assert_eq!(names, want, "{what}: {theirs:?}");
            if c.local && c.ready == "both" {
                assert_eq!(kp, ["default/b1 CLIENT"], "{what}: Local keeps the client");
            }
            // The program carried the flows to b1 and to r1 (and only
            // those): answers from b1 came back through ns_reply on its
            // veth, from r1 through ns_reply on the device toward it.
            // (Not each: a UDP client port conntrack still holds from a
            // flow kube-proxy carried is kube-proxy's flow, to the backend
            // conntrack names.)
            let from = |who: &str| -> u32 {
                ours.iter()
                    .filter(|(k, _)| k.starts_with(who))
                    .map(|(_, n)| *n)
                    .sum()
            };
            for (who, pair) in [("default/b1", [0, 1]), ("remote/r1", [2, 3])] {
                if from(who) > 0 {
                    assert!(
                        d[pair[0]] > 0 && d[pair[1]] > 0,
                        "{what}: {who} not carried"
                    );
                    carried += from(who);
                    if who == "remote/r1" {
                        carried_remote += from(who);
                    }
                } else {
                    assert_eq!(
                        (d[pair[0]], d[pair[1]]),
                        (0, 0),
                        "{what}: carried a flow to {who} it leaves"
                    );
                }
            }
        }
    }
    assert!(carried > 0 && carried_remote > 0);
    // NAT entries for the flows the program carried (two per flow; a
    // client port used again to the same frontend and backend reuses its
    // flow's), in the status and the metrics.
    let st = status(node).unwrap();
    let entries = st["services"]["natEntries"].as_u64().unwrap();
    assert!(
        entries >= u64::from(carried),
        "{entries} entries, {carried} flows"
    );
    assert_eq!(
        st["services"]["natCapacity"],
        u64::from(xdpcni_ebpf::abi::MAX_SVC_NAT)
    );
    let metrics = node.metrics().unwrap();
    assert_eq!(
        metrics.get("xdpcni_service_nat_entries").copied(),
        Some(entries as f64)
    );
}

/// North-south flows over time, one connected UDP socket of an outside
/// client each, through the program's uplink (A) and kube-proxy's (B) at
/// once: a flow kube-proxy began (to another node's backend, the only
/// ready one) stays kube-proxy's and on its backend when a backend on this
/// node becomes ready (conntrack has it: the program leaves it); a flow the
/// program carries to b1 moves to b2 when b1 is replaced, as kube-proxy's
/// flush of a removed UDP endpoint's conntrack entries moves B's. A node
/// address added later serves the node ports to outside clients at once.
#[test]
fn kpr_north_south_flows_kube_proxy_began_stay_its_own_and_udp_follows_a_replaced_backend() {
    let (dev_a, dev_b) = (
        xdpcni_e2e::netns::unique_name("xua"),
        xdpcni_e2e::netns::unique_name("xub"),
    );
    let config_dev = dev_a.clone();
    let f = fixture(move |c| {
        c.services.north_south_devices = vec![config_dev];
    });
    let (node, cg, b) = (&f.node, &f.cg, &f.b);
    let _far = xdpcni_e2e::oracle::remote(node).unwrap();
    let a = xdpcni_e2e::oracle::outside(node, &dev_a, 0).unwrap();
    let bo = xdpcni_e2e::oracle::outside(node, &dev_b, 1).unwrap();
    let r1: IpAddr = REMOTE4.parse().unwrap();
    /// Name, ready first, ready after 2 s, the backends each side must hear, in order.
    type Case<'a> = (&'a str, Vec<IpAddr>, Vec<IpAddr>, &'a [&'a str]);
    let cases: [Case; 2] = [
        (
            "nsbegun",
            vec![r1],
            vec![r1, b[0].ip(false)],
            &["remote/r1"],
        ),
        (
            "nsswap",
            vec![b[0].ip(false)],
            vec![b[1].ip(false)],
            &["default/b1", "default/b2"],
        ),
    ];
    let mut report = Vec::new();
    for (name, first, then, want) in &cases {
        let mut sh = shape(name, json!({}), "IPv4", first.clone());
        sh.spec = json!({ "type": "NodePort" });
        create(node, &sh).unwrap();
        wait_rules(node, &[&sh]).unwrap();
        let np = xdpcni_e2e::oracle::node_ports(node, name).unwrap()["dns"];
        let fe = std::net::SocketAddr::new(a.node[0], np).to_string();
        wait_for(&format!("{name}: {fe}"), Duration::from_secs(10), || {
            has_outside_frontend(node, &fe, u64::try_from(first.len()).unwrap())
        })
        .unwrap();
        let in0 = counted(node, &dev_a, "ns_to_pod");
        let (ours, theirs) = std::thread::scope(|sc| {
            let ours = sc.spawn(|| follow(cg, a.netns.name(), false, (a.node[0], np), 6.0));
            let theirs = sc.spawn(|| follow(cg, bo.netns.name(), false, (bo.node[0], np), 6.0));
            std::thread::sleep(Duration::from_secs(2));
            set_ready(node, name, then).unwrap();
            (
                ours.join().unwrap().unwrap(),
                theirs.join().unwrap().unwrap(),
            )
        });
        let carried = counted(node, &dev_a, "ns_to_pod") - in0;
        report.push(format!(
            "{name}: A (program) {ours:?}, B (kube-proxy) {theirs:?}, ns_to_pod +{carried}"
        ));
        for (side, runs) in [("A", &ours), ("B", &theirs)] {
            assert_eq!(backends(runs), *want, "{name} {side}: {runs:?}");
            assert!(
                runs.last().unwrap().1 >= 15,
                "{name} {side}: the last backend did not answer the last 1.5 s: {runs:?}"
            );
        }
        if *name == "nsbegun" {
            assert_eq!(
                carried, 0,
                "{name}: the program took over kube-proxy's flow"
            );
        } else {
            assert!(carried > 0, "{name}: the program did not carry the flow");
        }
    }
    eprintln!("{}", report.join("\n"));
    // An address the node gains later serves the node ports to outside
    // clients at once (the agent follows the kernel's announcements; its
    // resync is minutes away), and stops with it.
    let np = xdpcni_e2e::oracle::node_ports(node, "nsswap").unwrap()["dns"];
    let fe = format!("10.78.1.61:{np}");
    let n = &node.net.node;
    n.ip(&["addr", "add", "10.78.1.61/32", "dev", "lo"])
        .unwrap();
    wait_for(
        &format!("the agent's outside {fe}"),
        Duration::from_secs(5),
        || has_outside_frontend(node, &fe, 1),
    )
    .unwrap();
    n.ip(&["addr", "del", "10.78.1.61/32", "dev", "lo"])
        .unwrap();
    wait_for(&format!("{fe} gone"), Duration::from_secs(5), || {
        !has_outside_frontend(node, &fe, 1)
    })
    .unwrap();
}

/// Waits until kube-proxy's rules for Service `name` DNAT to exactly the
/// addresses of `all` that `ready` holds (port 80).
fn wait_kube_proxy_backends(node: &KubeNode, name: &str, all: &[IpAddr], ready: &[IpAddr]) {
    wait_for(
        &format!("kube-proxy's backends of {name}"),
        Duration::from_secs(60),
        || {
            let (v4, v6) = rules(node);
            all.iter().all(|ip| {
                let (text, to) = if ip.is_ipv6() {
                    (&v6, format!("[{ip}]:80"))
                } else {
                    (&v4, format!("{ip}:80"))
                };
                let has = text
                    .lines()
                    .any(|l| l.contains(&format!("default/{name}:")) && l.contains(&to));
                has == ready.contains(ip)
            })
        },
    )
    .unwrap();
}

/// The backend of each answer in `seen` (its key's first word).
fn answered_by(seen: &Seen) -> std::collections::BTreeSet<String> {
    seen.keys()
        .map(|k| k.split(' ').next().unwrap_or_default().to_string())
        .collect()
}

/// North-south ClientIP affinity (`sessionAffinity: ClientIP`), through the
/// program's uplink (A, "another node" behind a device it runs on too) and
/// kube-proxy's (B) at once, a node port over b1, b2 and r1, TCP and UDP
/// (each its own frontend), IPv4 and IPv6: every new flow of one client
/// reaches one backend on each side; with that backend no longer ready,
/// every one reaches one other backend; once the affinity's timeout has
/// run out between flows, the choice is made again (over ten rounds more
/// than one backend on each side). The program carried A's flows.
#[test]
fn kpr_north_south_client_ip_affinity_as_kube_proxy() {
    let (dev_a, dev_b, dev_r) = (
        xdpcni_e2e::netns::unique_name("xua"),
        xdpcni_e2e::netns::unique_name("xub"),
        xdpcni_e2e::netns::unique_name("xr"),
    );
    let config_devs = vec![dev_a.clone(), dev_r.clone()];
    let f = fixture(move |c| c.services.north_south_devices = config_devs);
    let (node, cg, b) = (&f.node, &f.cg, &f.b);
    let _far = xdpcni_e2e::oracle::remote_on(node, &dev_r).unwrap();
    let a = xdpcni_e2e::oracle::outside(node, &dev_a, 0).unwrap();
    let bo = xdpcni_e2e::oracle::outside(node, &dev_b, 1).unwrap();
    let remote: [IpAddr; 2] = [REMOTE4.parse().unwrap(), REMOTE6.parse().unwrap()];
    let timeout = 2;
    let carried = || counted(node, &dev_a, "ns_to_pod") + counted(node, &dev_a, "ns_to_node");
    for (v6, family) in [(false, "IPv4"), (true, "IPv6")] {
        let i = usize::from(v6);
        let all = vec![b[0].ip(v6), b[1].ip(v6), remote[i]];
        let name = format!("nsaff-{}", &family[2..]);
        let mut sh = shape(&name, json!({}), family, all.clone());
        sh.spec = json!({
            "type": "NodePort",
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": { "clientIP": { "timeoutSeconds": timeout } },
        });
        create(node, &sh).unwrap();
        wait_rules(node, &[&sh]).unwrap();
        let nps = xdpcni_e2e::oracle::node_ports(node, &name).unwrap();
        for port in [nps["http"], nps["dns"]] {
            let fe = std::net::SocketAddr::new(a.node[i], port).to_string();
            wait_for(&format!("{name}: {fe}"), Duration::from_secs(30), || {
                has_outside_frontend(node, &fe, 3)
            })
            .unwrap();
        }
        for (proto, port) in [("tcp", nps["http"]), ("udp", nps["dns"])] {
            let what = format!("{name} {proto}");
            let c0 = carried();
            let ours = probe(cg, a.netns.name(), false, proto, (a.node[i], port), 20).unwrap();
            let theirs = probe(cg, bo.netns.name(), false, proto, (bo.node[i], port), 20).unwrap();
            eprintln!("{what}: A (program) {ours:?}, B (kube-proxy) {theirs:?}");
            let (mine, kp) = (answered_by(&ours), answered_by(&theirs));
            assert_eq!((mine.len(), kp.len()), (1, 1), "{what}: one backend each");
            assert!(carried() - c0 >= 20, "{what}: not carried");
            // The chosen backend no longer ready: each side's next flows
            // all reach one other backend.
            let gone: Vec<String> = mine.iter().chain(&kp).cloned().collect();
            let ready: Vec<IpAddr> = all
                .iter()
                .copied()
                .filter(|ip| {
                    let who = if *ip == remote[i] {
                        "remote/r1".to_string()
                    } else if *ip == b[0].ip(v6) {
                        "default/b1".to_string()
                    } else {
                        "default/b2".to_string()
                    };
                    !gone.contains(&who)
                })
                .collect();
            set_ready(node, &name, &ready).unwrap();
            let want = u64::try_from(ready.len()).unwrap();
            let fe = std::net::SocketAddr::new(a.node[i], port).to_string();
            wait_for(&format!("{what}: {fe}"), Duration::from_secs(30), || {
                has_outside_frontend(node, &fe, want)
            })
            .unwrap();
            wait_kube_proxy_backends(node, &name, &all, &ready);
            let ours = probe(cg, a.netns.name(), false, proto, (a.node[i], port), 10).unwrap();
            let theirs = probe(cg, bo.netns.name(), false, proto, (bo.node[i], port), 10).unwrap();
            eprintln!(
                "{what} after {gone:?} went: A (program) {ours:?}, B (kube-proxy) {theirs:?}"
            );
            for (side, seen) in [("A", &ours), ("B", &theirs)] {
                let by = answered_by(seen);
                assert_eq!(by.len(), 1, "{what} {side}: one backend: {seen:?}");
                assert!(
                    by.iter().all(|w| !gone.contains(w) && w != "error"),
                    "{what} {side}: {seen:?}"
                );
            }
            set_ready(node, &name, &all).unwrap();
            let fe = std::net::SocketAddr::new(a.node[i], port).to_string();
            wait_for(
                &format!("{what}: {fe} again"),
                Duration::from_secs(30),
                || has_outside_frontend(node, &fe, 3),
            )
            .unwrap();
            wait_kube_proxy_backends(node, &name, &all, &all);
        }
    }
    // The timeout: one TCP flow per side every timeout + 0.5 s; the choice
    // is made again each time (the three backends: ten rounds on one of
    // them alone would be chance once in 20,000 runs per side).
    let port = xdpcni_e2e::oracle::node_ports(node, "nsaff-v4").unwrap()["http"];
    let (mut mine, mut kp) = (
        std::collections::BTreeSet::new(),
        std::collections::BTreeSet::new(),
    );
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(timeout * 1000 + 500));
        mine.extend(answered_by(
            &probe(cg, a.netns.name(), false, "tcp", (a.node[0], port), 1).unwrap(),
        ));
        kp.extend(answered_by(
            &probe(cg, bo.netns.name(), false, "tcp", (bo.node[0], port), 1).unwrap(),
        ));
    }
    eprintln!("after each timeout: A (program) {mine:?}, B (kube-proxy) {kp:?}");
    assert!(mine.len() > 1 && kp.len() > 1, "{mine:?} {kp:?}");
}

/// North-south to LoadBalancer IPs with `loadBalancerSourceRanges`,
/// through the program's uplink (A) and kube-proxy's (B) at once, IPv4 and
/// IPv6: ranges holding both clients serve both alike (the backend, its
/// source); ranges holding neither leave both to the kernel alike
/// (kube-proxy's firewall chain does not translate the packet, and its
/// drop mark is met only on the way into the node: here the node routes
/// it nowhere and answers unreachable), the program counting `pass_nat`
/// and carrying nothing; ranges holding only A's client serve A alone.
/// The node port of the same Service is not filtered (kube-proxy 1.20
/// filters the balancer IP alone).
#[test]
fn kpr_north_south_load_balancer_source_ranges_as_kube_proxy() {
    let (dev_a, dev_b) = (
        xdpcni_e2e::netns::unique_name("xua"),
        xdpcni_e2e::netns::unique_name("xub"),
    );
    let config_dev = dev_a.clone();
    let f = fixture(move |c| c.services.north_south_devices = vec![config_dev]);
    let (node, cg, b) = (&f.node, &f.cg, &f.b);
    let a = xdpcni_e2e::oracle::outside(node, &dev_a, 0).unwrap();
    let bo = xdpcni_e2e::oracle::outside(node, &dev_b, 1).unwrap();
    // (name, ranges of each family, LB IPs, A served, B served)
    let cases = [
        (
            "nsrboth",
            [
                vec!["192.0.2.0/24", "198.18.1.0/24"],
                vec!["2001:db8::/64", "2001:db8:1::/64"],
            ],
            ["198.51.100.20", "2001:db8:99::20"],
            true,
            true,
        ),
        (
            "nsrnone",
            [vec!["203.0.113.0/24"], vec!["2001:db8:77::/64"]],
            ["198.51.100.21", "2001:db8:99::21"],
            false,
            false,
        ),
        (
            "nsronly",
            [vec!["192.0.2.10/32"], vec!["2001:db8::10/128"]],
            ["198.51.100.22", "2001:db8:99::22"],
            true,
            false,
        ),
    ];
    for (v6, family) in [(false, "IPv4"), (true, "IPv6")] {
        let i = usize::from(v6);
        for (name, ranges, ips, a_ok, b_ok) in &cases {
            let name = format!("{name}-{}", &family[2..]);
            let mut sh = shape(&name, json!({}), family, vec![b[0].ip(v6)]);
            sh.spec = json!({
                "type": "LoadBalancer",
                "ports": tcp_only(),
                "loadBalancerSourceRanges": ranges[i],
            });
            create(node, &sh).unwrap();
            let lb: IpAddr = ips[i].parse().unwrap();
            xdpcni_e2e::oracle::set_balancer(node, &name, &[lb]).unwrap();
            wait_rules(node, &[&sh]).unwrap();
            let fe = std::net::SocketAddr::new(lb, 8080).to_string();
            wait_for(&format!("{name}: {fe}"), Duration::from_secs(30), || {
                has_outside_frontend(node, &fe, 1)
            })
            .unwrap();
            // kube-proxy's firewall chain for it is in place.
            wait_for(
                &format!("{name}: kube-proxy's firewall"),
                Duration::from_secs(60),
                || {
                    let (r4, r6) = rules(node);
                    let r = if v6 { r6 } else { r4 };
                    r.lines().any(|l| {
                        l.contains("KUBE-FW-") && l.contains(&format!("default/{name}:http"))
                    })
                },
            )
            .unwrap();
            let n = if *a_ok || *b_ok { 10 } else { 2 };
            let d0 = counted(node, &dev_a, "pass_nat");
            let ours = probe(cg, a.netns.name(), false, "tcp", (lb, 8080), n).unwrap();
            let d1 = counted(node, &dev_a, "pass_nat");
            let theirs = probe(cg, bo.netns.name(), false, "tcp", (lb, 8080), n).unwrap();
            let what = format!("{name} {lb}");
            eprintln!(
                "{what}: A (program) {ours:?}, B (kube-proxy) {theirs:?}, pass_nat +{}",
                d1 - d0
            );
            let norm = |seen: &Seen, client: IpAddr| -> Vec<String> {
                seen.keys()
                    .map(|k| k.replace(&client.to_string(), "CLIENT"))
                    .collect()
            };
            for (side, seen, client, want) in [
                ("A", &ours, a.client[i], *a_ok),
                ("B", &theirs, bo.client[i], *b_ok),
            ] {
                let got = norm(seen, client);
                assert_eq!(got.len(), 1, "{what} {side}: {seen:?}");
                assert_eq!(
                    got[0].starts_with("default/b1 "),
                    want,
                    "{what} {side}: {seen:?}"
                );
            }
            if a_ok == b_ok {
                assert_eq!(
                    norm(&ours, a.client[i]),
                    norm(&theirs, bo.client[i]),
                    "{what}"
                );
            }
            if *a_ok {
                assert_eq!(d1, d0, "{what}: the program left an allowed client");
            } else {
                assert!(
                    d1 > d0,
                    "{what}: the program did not leave it to the kernel"
                );
            }
            // The node port of the same Service serves both: ranges are the
            // balancer IP's alone.
            let np = xdpcni_e2e::oracle::node_ports(node, &name).unwrap()["http"];
            for (side, ns, to, client) in [
                ("A", a.netns.name(), a.node[i], a.client[i]),
                ("B", bo.netns.name(), bo.node[i], bo.client[i]),
            ] {
                let seen = probe(cg, ns, false, "tcp", (to, np), 2).unwrap();
                let got = norm(&seen, client);
                assert_eq!(got.len(), 1, "{what} node port {side}: {seen:?}");
                assert!(
                    got[0].starts_with("default/b1"),
                    "{what} node port {side}: {seen:?}"
                );
            }
        }
    }
}
