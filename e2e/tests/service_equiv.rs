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
    time::Duration,
};

use serde_json::{json, Value};
use xdpcni_e2e::{
    cgroup::TestCgroup,
    cluster::KubeNode,
    oracle::{
        create, kube_proxy, probe, remote, status, translated, wait_for, wait_rules, Seen, Shape,
        REMOTE4, REMOTE6,
    },
};

#[test]
fn kpr_clusterip_from_pods_equals_kube_proxy_for_every_shape() {
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
    let _far = remote(&node).unwrap();
    let _proxy = kube_proxy(&node).unwrap();
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
            labels: json!({}),
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
        labels: json!({}),
        spec: json!({}),
        families: &["IPv4", "IPv6"],
        ready: backends[0].ips.clone(),
        not_ready: vec![],
    });
    let mut vips = BTreeMap::new();
    for s in &shapes {
        let ips = create(&node, s).unwrap();
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
        status(&node).unwrap()["services"]["frontends"]
            .as_array()
            .map_or(0, Vec::len)
            >= shapes.iter().map(|s| s.families.len() * 3).sum::<usize>()
    })
    .unwrap();
    wait_rules(&node, &shapes.iter().collect::<Vec<_>>()).unwrap();
    // The remote backend answers straight (the topology is ready, IPv6
    // neighbours too).
    for ip in [REMOTE4, REMOTE6] {
        wait_for("the remote backend", Duration::from_secs(10), || {
            cg.podtool(false, &cns, &["greet", ip, "80", "1"]).is_ok()
        })
        .unwrap();
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
                let t0 = translated(&node).unwrap();
                let ours = probe(&cg, &cns, true, proto, (vip, port), n).unwrap();
                let t1 = translated(&node).unwrap();
                let theirs = probe(&cg, &cns, false, proto, (vip, port), n).unwrap();
                let t2 = translated(&node).unwrap();
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
