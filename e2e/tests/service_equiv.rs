//! The socket's translation against kube-proxy, side by side: one node with
//! its API server, the `xdpcni-agent` keeping the Service maps and a real
//! kube-proxy 1.20.2 (iptables mode, the same Endpoints) in the node's
//! namespace. For each Service shape, IPv4 and IPv6, TCP and UDP (connected
//! and unconnected), the same client pod probes the Service twice with
//! `podtool who`: inside the cgroup the agent's programs are attached to
//! (translated at the socket) and outside it (kube-proxy's DNAT alone, the
//! oracle). Both must show the same result: which backends answer, the
//! source each backend sees, the peer the client sees (podtool checks it is
//! the Service), and the error when nothing is ready; the programs' own
//! count proves which run they translated. Needs root, bpffs, cgroup v2,
//! iptables, containernetworking-plugins and scripts/k8s-build.sh.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::{Endpoints, Service};
use kube::{api::PostParams, Api};
use serde_json::{json, Value};
use xdpcni_e2e::{
    cgroup::TestCgroup,
    cluster::{KubeNode, LISTEN, NODE},
    cni::{http_get, NodeProcess},
    kube::k8s_binary,
    netns::{run_out, Netns},
};

/// The address of a pod of "another node": a namespace behind a link of
/// the node, in the cluster's pod range (kube-proxy's clusterCIDR), not in
/// this node's.
const REMOTE4: &str = "10.78.1.10";
const REMOTE6: &str = "fd78:0:0:1::10";

/// kube-proxy 1.20.2 in iptables mode in the node's namespace, reading
/// Endpoints (as the agent does on this API server), both families; killed
/// by its PID on Drop. Its rules go with the node's namespace.
fn kube_proxy(node: &KubeNode) -> NodeProcess {
    let dir = node.net.dir.path();
    let config = dir.join("kube-proxy.yaml");
    std::fs::write(
        &config,
        format!(
            r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {{kubeconfig: "{}"}}
mode: iptables
clusterCIDR: "10.78.0.0/16,fd78::/48"
hostnameOverride: {NODE}
featureGates: {{IPv6DualStack: true, EndpointSliceProxying: false}}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
iptables: {{minSyncPeriod: 0s}}
# Leave the host-wide conntrack settings alone.
conntrack: {{maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
"#,
            node.api.kubeconfig.display()
        ),
    )
    .unwrap();
    NodeProcess::spawn(
        &node.net.node,
        &k8s_binary("kube-proxy").unwrap(),
        &[&format!("--config={}", config.display())],
        &dir.join("kube-proxy.log"),
    )
    .unwrap()
}

/// "Another node's pod": `podtool serve` as `remote/r1` in a namespace
/// linked to the node, routed both ways.
struct Remote {
    _server: NodeProcess,
    _netns: Netns,
}

fn remote(node: &KubeNode) -> Remote {
    let netns = Netns::new("xr").unwrap();
    let host = xdpcni_e2e::unique_name("xr");
    node.net.node.add_veth(&host, "eth0", Some(&netns)).unwrap();
    let n = &node.net.node;
    n.ip(&["addr", "add", "10.78.1.1/24", "dev", &host])
        .unwrap();
    n.ip(&["addr", "add", "fd78:0:0:1::1/64", "dev", &host, "nodad"])
        .unwrap();
    n.ip(&["link", "set", &host, "up"]).unwrap();
    // A node has a default route (a cluster IP with no rule for it is
    // routed, so kube-proxy's REJECT answers, not the routing lookup), and
    // the node's ICMP errors are not rate-limited: each refusal is seen.
    n.ip(&["route", "add", "default", "via", REMOTE4]).unwrap();
    n.ip(&["-6", "route", "add", "default", "via", REMOTE6])
        .unwrap();
    n.sysctl("net.ipv4.icmp_ratelimit", "0").unwrap();
    n.sysctl("net.ipv6.icmp.ratelimit", "0").unwrap();
    netns
        .ip(&["addr", "add", &format!("{REMOTE4}/24"), "dev", "eth0"])
        .unwrap();
    netns
        .ip(&[
            "addr",
            "add",
            &format!("{REMOTE6}/64"),
            "dev",
            "eth0",
            "nodad",
        ])
        .unwrap();
    netns.ip(&["link", "set", "eth0", "up"]).unwrap();
    netns
        .ip(&["route", "add", "default", "via", "10.78.1.1"])
        .unwrap();
    netns
        .ip(&["-6", "route", "add", "default", "via", "fd78:0:0:1::1"])
        .unwrap();
    let server = NodeProcess::spawn_env(
        &netns,
        &xdpcni_e2e::cluster::podtool().unwrap(),
        &["serve", "80", "81"],
        &[("PODTOOL_NAME", "remote/r1")],
        &node.net.dir.path().join("serve-remote.log"),
    )
    .unwrap();
    Remote {
        _server: server,
        _netns: netns,
    }
}

/// The agent's status, as JSON.
fn status(node: &KubeNode) -> Value {
    let (code, body) = http_get(&node.net.node, LISTEN, "/v1/status").unwrap();
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

fn translated(node: &KubeNode) -> u64 {
    status(node)["services"]["translated"].as_u64().unwrap()
}

fn wait_for(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A Service of the test: its name, extra spec, families ("IPv4", "IPv6"
/// or both, IPv4 first), and the addresses of its Endpoints (ready and not
/// ready), which both the agent and kube-proxy read.
struct Shape {
    name: String,
    spec: Value,
    families: &'static [&'static str],
    ready: Vec<IpAddr>,
    not_ready: Vec<IpAddr>,
}

impl Shape {
    /// The addresses a connect to a cluster IP of family `v6` may reach:
    /// those of the Endpoints' family (its first address's; kube-proxy
    /// ignores the others, and so does the agent).
    fn reachable(&self, v6: bool) -> Vec<IpAddr> {
        let first = self.ready.iter().chain(&self.not_ready).next();
        if first.is_some_and(|f| f.is_ipv6() != v6) {
            return Vec::new();
        }
        self.ready
            .iter()
            .copied()
            .filter(|ip| ip.is_ipv6() == v6)
            .collect()
    }
}

/// Every Service port of the test: TCP and UDP to port 80 by number, and
/// TCP to 81 by the name `alt` (only the Endpoints resolve it).
fn ports() -> Value {
    json!([
        { "name": "http", "port": 8080, "targetPort": 80 },
        { "name": "dns", "port": 8080, "protocol": "UDP", "targetPort": 80 },
        { "name": "alt", "port": 8081, "targetPort": "alt" },
    ])
}

/// Creates the Endpoints and the Service of `shape`: its cluster IPs.
fn create(node: &KubeNode, shape: &Shape) -> Vec<IpAddr> {
    let addrs = |ips: &[IpAddr]| -> Vec<Value> {
        ips.iter()
            .map(|ip| json!({ "ip": ip.to_string(), "nodeName": NODE }))
            .collect()
    };
    let eps = json!({
        "metadata": { "name": shape.name },
        "subsets": [{
            "addresses": addrs(&shape.ready),
            "notReadyAddresses": addrs(&shape.not_ready),
            "ports": [
                { "name": "http", "port": 80 },
                { "name": "dns", "port": 80, "protocol": "UDP" },
                { "name": "alt", "port": 81 },
            ],
        }],
    });
    let mut spec = shape.spec.clone();
    spec["ports"] = ports();
    spec["ipFamilies"] = json!(shape.families);
    spec["ipFamilyPolicy"] = json!(if shape.families.len() == 2 {
        "RequireDualStack"
    } else {
        "SingleStack"
    });
    let svc = json!({ "metadata": { "name": shape.name }, "spec": spec });
    node.client(move |c| async move {
        Api::<Endpoints>::namespaced(c.clone(), "default")
            .create(&PostParams::default(), &serde_json::from_value(eps)?)
            .await?;
        let svc = Api::<Service>::namespaced(c, "default")
            .create(&PostParams::default(), &serde_json::from_value(svc)?)
            .await?;
        let ips = svc.spec.and_then(|s| s.cluster_ips).unwrap_or_default();
        Ok(ips
            .iter()
            .map(|i| i.parse())
            .collect::<Result<Vec<_>, _>>()?)
    })
    .unwrap()
}

/// One probe's result: each distinct answer ("BACKEND SOURCE" or "error
/// KIND") with its count.
type Seen = BTreeMap<String, u32>;

fn probe(
    cg: &TestCgroup,
    client: &str,
    inside: bool,
    proto: &str,
    to: (IpAddr, u16),
    n: u32,
) -> Seen {
    let args = [
        "who".to_string(),
        proto.to_string(),
        to.0.to_string(),
        to.1.to_string(),
        n.to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = cg
        .podtool(inside, client, &args)
        .unwrap_or_else(|e| panic!("{proto} {to:?}: {e}"));
    out.lines()
        .map(|l| {
            let (what, count) = l.rsplit_once(' ').unwrap();
            (what.to_string(), count.parse().unwrap())
        })
        .collect()
}

#[test]
fn service_translation_equals_kube_proxy_for_every_shape() {
    let cg = TestCgroup::new().unwrap();
    let cg_path = cg.path.clone();
    let node = KubeNode::start(|c| c.services.cgroup = cg_path).unwrap();
    let client = node
        .add_pod("default", "client", json!({}), json!([]))
        .unwrap();
    let backends: Vec<_> = ["b1", "b2", "b3"]
        .iter()
        .map(|n| node.add_pod("default", n, json!({}), json!([])).unwrap())
        .collect();
    let _far = remote(&node);
    let _proxy = kube_proxy(&node);
    let cns = client.netns.name().to_string();

    let remote_ips: Vec<IpAddr> = vec![REMOTE4.parse().unwrap(), REMOTE6.parse().unwrap()];
    let of = |ips: &[IpAddr], v6: bool| -> Vec<IpAddr> {
        ips.iter().copied().filter(|i| i.is_ipv6() == v6).collect()
    };
    let all_b: Vec<IpAddr> = backends.iter().flat_map(|p| p.ips.clone()).collect();
    let mut shapes = Vec::new();
    for (v6, families) in [(false, &["IPv4"][..]), (true, &["IPv6"][..])] {
        let f = if v6 { "6" } else { "4" };
        let shape = |name: &str, spec: Value, ready: Vec<IpAddr>, not_ready: Vec<IpAddr>| Shape {
            name: format!("{name}-{f}"),
            spec,
            families,
            ready: of(&ready, v6),
            not_ready: of(&not_ready, v6),
        };
        // Several backends of this node.
        shapes.push(shape("several", json!({}), all_b.clone(), vec![]));
        // One backend here, one on another node.
        let far: Vec<IpAddr> = backends[0].ips.iter().chain(&remote_ips).copied().collect();
        shapes.push(shape("far", json!({}), far, vec![]));
        // Nothing ready (a backend not ready yet): refused.
        shapes.push(shape("empty", json!({}), vec![], backends[1].ips.clone()));
        // ClientIP affinity: every connection of the client to one backend.
        let sticky = json!({ "sessionAffinity": "ClientIP" });
        shapes.push(shape("sticky", sticky, all_b.clone(), vec![]));
        // The client reaching itself through its own Service.
        shapes.push(shape("hairpin", json!({}), client.ips.clone(), vec![]));
    }
    // Dual-stack, its Endpoints (IPv4 first) listing both families: the
    // IPv4 cluster IP reaches b1; the IPv6 one has no backend for either
    // (its backends would be in EndpointSlices alone).
    shapes.push(Shape {
        name: "dual".into(),
        spec: json!({}),
        families: &["IPv4", "IPv6"],
        ready: backends[0].ips.clone(),
        not_ready: vec![],
    });
    let mut vips = BTreeMap::new();
    for s in &shapes {
        let ips = create(&node, s);
        assert_eq!(
            ips.len(),
            s.families.len(),
            "{}: cluster IPs {ips:?}",
            s.name
        );
        vips.insert(s.name.clone(), ips);
    }

    // The agent's frontends (3 ports x 2 families per Service) and
    // kube-proxy's rules (a comment naming each Service port) in place.
    wait_for("the agent's frontends", Duration::from_secs(10), || {
        status(&node)["services"]["frontends"]
            .as_array()
            .map_or(0, Vec::len)
            >= shapes.iter().map(|s| s.families.len() * 3).sum::<usize>()
    });
    wait_for("kube-proxy's rules", Duration::from_secs(60), || {
        let save = |tool: &str| {
            run_out(&["ip", "netns", "exec", node.net.node.name(), tool]).unwrap_or_default()
        };
        let (v4, v6) = (save("iptables-save"), save("ip6tables-save"));
        shapes.iter().all(|s| {
            s.families.iter().all(|f| {
                let rules = if *f == "IPv6" { &v6 } else { &v4 };
                ["http", "dns", "alt"]
                    .iter()
                    .all(|p| rules.contains(&format!("default/{}:{p}", s.name)))
            })
        })
    });
    // The remote backend answers straight (the topology is ready, IPv6
    // neighbours too).
    for ip in [REMOTE4, REMOTE6] {
        wait_for("the remote backend", Duration::from_secs(10), || {
            cg.podtool(false, &cns, &["greet", ip, "80", "1"]).is_ok()
        });
    }

    let name_of: BTreeMap<IpAddr, String> = backends
        .iter()
        .chain(std::iter::once(&client))
        .flat_map(|p| p.ips.iter().map(move |ip| (*ip, p.id())))
        .chain(remote_ips.iter().map(|ip| (*ip, "remote/r1".to_string())))
        .collect();

    let mut report = Vec::new();
    for s in &shapes {
        for &vip in &vips[&s.name] {
            let v6 = vip.is_ipv6();
            let src = client.ip(v6);
            let reachable = s.reachable(v6);
            // The client reaching itself: kube-proxy masquerades (the pod
            // sees the node as its client), so the programs leave it alone.
            let hairpin = reachable.contains(&src);
            // What kube-proxy's rules do to the client's flows: the backends
            // it answers from, each seeing the client's own address (or the
            // node's, hairpinned: kube-proxy's run shows which).
            let expect: BTreeSet<String> = reachable
                .iter()
                .map(|ip| format!("{} {src}", name_of[ip]))
                .collect();
            for (proto, port) in [
                ("tcp", 8080),
                ("udp", 8080),
                ("udp-connected", 8080),
                ("tcp", 8081),
            ] {
                // Unconnected UDP to nothing waits a second a probe.
                let n = if reachable.is_empty() { 3 } else { 30 };
                let t0 = translated(&node);
                let ours = probe(&cg, &cns, true, proto, (vip, port), n);
                let t1 = translated(&node);
                let theirs = probe(&cg, &cns, false, proto, (vip, port), n);
                let t2 = translated(&node);
                let what = format!("{} {vip} {proto}/{port}", s.name);
                report.push(format!(
                    "{what}: translated {ours:?}, kube-proxy {theirs:?}"
                ));
                assert_eq!(t2, t1, "{what}: the run outside the cgroup was translated");
                if reachable.is_empty() || hairpin {
                    assert_eq!(t1, t0, "{what}: left to kube-proxy, yet translated");
                } else {
                    // A connect each, or each unconnected datagram (two a probe).
                    let calls = if proto == "udp" { 2 * n } else { n };
                    assert_eq!(
                        t1 - t0,
                        u64::from(calls),
                        "{what}: not every call translated"
                    );
                }
                let keys = |m: &Seen| m.keys().cloned().collect::<BTreeSet<_>>();
                if s.spec.get("sessionAffinity").is_some() {
                    // One backend each (which one is each side's own draw).
                    for side in [&ours, &theirs] {
                        assert_eq!(side.len(), 1, "{what}: {side:?}");
                        assert!(expect.is_superset(&keys(side)), "{what}: {side:?}");
                    }
                    continue;
                }
                assert_eq!(keys(&ours), keys(&theirs), "{what}");
                if reachable.is_empty() {
                    let want = if proto == "udp" {
                        "error timeout"
                    } else {
                        "error refused"
                    };
                    assert_eq!(keys(&theirs), BTreeSet::from([want.to_string()]), "{what}");
                } else if hairpin {
                    let seen: Vec<&String> = theirs.keys().collect();
                    assert!(
                        seen.len() == 1
                            && seen[0].starts_with("default/client ")
                            && !expect.contains(seen[0]),
                        "{what}: kube-proxy's hairpin {theirs:?}"
                    );
                } else {
                    assert_eq!(keys(&theirs), expect, "{what}");
                }
            }
        }
    }
    eprintln!("{}", report.join("\n"));
}
