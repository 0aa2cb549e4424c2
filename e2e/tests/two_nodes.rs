//! Two nodes: two node network namespaces joined by a veth "wire", each with
//! its own xdpcni-agent in Kubernetes mode against one real API server (two
//! Node objects with their pod CIDRs and InternalIPs), pods made through the
//! real CNI on each, `routing.mode: hostGateway` (the nodes share the wire;
//! tests/overlay.rs has nodes that do not). Pod-to-pod across nodes goes
//! over the agents' host-gateway routes (ping, UDP, TCP, v4 and v6); same-node traffic still
//! takes the XDP fast path; a node's routes go with its Node object and come
//! back with it.
//! Needs root, bpffs, containernetworking-plugins, etcd and kube-apiserver
//! (scripts/k8s-build.sh).

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use xdpcni_e2e::{
    kube::ApiServer,
    node::AgentConfig,
    nodes::{addr, create_pods, wait_for, ClusterNode},
    traffic::{ping, tcp_transfer, udp_echo},
    unique_name,
};

/// node `i` (1 or 2): pod CIDRs 10.81.i.0/24, fd81:i::/64 and InternalIPs
/// 192.168.77.i, fd77::i on the wire.
fn node(i: u8) -> ClusterNode {
    ClusterNode::new(
        &format!("node-{i}"),
        &format!("10.81.{i}.0/24"),
        &format!("fd81:{i}::/64"),
        &[&format!("192.168.77.{i}"), &format!("fd77::{i}")],
    )
    .unwrap()
}

#[test]
fn two_nodes_route_pods_across_the_wire_and_keep_xdp_on_each_node() {
    let mut n1 = node(1);
    let mut n2 = node(2);
    let ip = |n: &ClusterNode, v6: bool| n.ip(v6).unwrap().to_string();
    // The wire: a veth pair from node-1's namespace into node-2's.
    let (w1, w2) = (unique_name("xw"), unique_name("xw"));
    n1.net.node.add_veth(&w1, &w2, Some(&n2.net.node)).unwrap();
    for (n, w) in [(&n1, &w1), (&n2, &w2)] {
        let node = &n.net.node;
        node.ip(&["addr", "add", &format!("{}/24", ip(n, false)), "dev", w])
            .unwrap();
        node.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{}/64", ip(n, true)),
            "dev",
            w,
            "nodad",
        ])
        .unwrap();
        node.ip(&["link", "set", w, "up"]).unwrap();
    }
    ping(&n1.net.node, n2.ip(false).unwrap(), 1).unwrap();

    // One API server (in node-1, reachable from node-2 over the wire), two
    // Node objects with their pod CIDRs and InternalIPs.
    let api = ApiServer::start_on(&n1.net.node, "0.0.0.0").unwrap();
    let kc2: PathBuf = api.kubeconfig_via(&ip(&n1, false)).unwrap();
    n1.create_object(&api, &n1.net.node).unwrap();
    n2.create_object(&api, &n1.net.node).unwrap();
    create_pods(
        &api,
        &n1.net.node,
        &[("a1", "node-1"), ("b1", "node-1"), ("a2", "node-2")],
    )
    .unwrap();

    // An agent per node, each in Kubernetes mode, host-gateway routing.
    let hg = |c: &mut AgentConfig| c.routing.mode = "hostGateway".into();
    let _agent1 = n1.agent(&api.kubeconfig, hg).unwrap();
    let _agent2 = n2.agent(&kc2, hg).unwrap();
    let (a1, ra1) = n1.add_pod("a1").unwrap();
    let (b1, rb1) = n1.add_pod("b1").unwrap();
    let (a2, ra2) = n2.add_pod("a2").unwrap();
    let route_to = |n: &ClusterNode, other: &ClusterNode| {
        let r = n.agent_routes();
        r.contains(&format!("{} via {}", other.pod4, ip(other, false)))
            && r.contains(&format!("{} via {}", other.pod6, ip(other, true)))
    };
    let start = Instant::now();
    while !(route_to(&n1, &n2) && route_to(&n2, &n1)) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "host-gateway routes: node-1 {:?}, node-2 {:?}\nnode-1 agent: {}\nnode-2 agent: {}",
            n1.agent_routes(),
            n2.agent_routes(),
            n1.agent_log(),
            n2.agent_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = start.elapsed();
    eprintln!(
        "routes in place {took:?} after the pods; node-1: {}",
        n1.agent_routes()
    );

    // Across the wire: ping, UDP and TCP, both families, both ways.
    for v6 in [false, true] {
        ping(&a1, addr(&ra2, v6).unwrap(), 3).unwrap();
        ping(&a2, addr(&ra1, v6).unwrap(), 3).unwrap();
        udp_echo(&a1, &a2, addr(&ra2, v6).unwrap(), 20, 1000).unwrap();
        let mbps = tcp_transfer(&a2, &a1, addr(&ra1, v6).unwrap(), 4 << 20).unwrap();
        eprintln!(
            "TCP node-2 -> node-1 ({}): {mbps:.0} Mbit/s",
            if v6 { "v6" } else { "v4" }
        );
    }
    // Same node: still the fast path (a1's forward counters move).
    let before = n1.forwarded(&ra1).unwrap();
    ping(&a1, addr(&rb1, false).unwrap(), 5).unwrap();
    udp_echo(&a1, &b1, addr(&rb1, true).unwrap(), 10, 200).unwrap();
    let same_node = n1.forwarded(&ra1).unwrap() - before;
    assert!(
        same_node >= 15,
        "same-node traffic redirected by XDP: {same_node}"
    );
    // Cross-node traffic is not redirected (there is no endpoint for it).
    let before = n1.forwarded(&ra1).unwrap();
    ping(&a1, addr(&ra2, false).unwrap(), 5).unwrap();
    assert_eq!(
        n1.forwarded(&ra1).unwrap(),
        before,
        "cross-node frames take the kernel path"
    );
    assert!(
        n1.net
            .node
            .ip(&["link", "show", xdpcni_host::overlay::DEVICE])
            .is_err(),
        "no VXLAN device in hostGateway"
    );

    // node-2's Node object deleted: node-1's routes to it go, and with them
    // the path; back with the object.
    n2.delete_object(&api, &n1.net.node).unwrap();
    let took = wait_for(
        "node-1's routes to node-2 removed",
        Duration::from_secs(5),
        || !n1.agent_routes().contains(&n2.pod4) && !n1.agent_routes().contains(&n2.pod6),
    )
    .unwrap();
    eprintln!("routes removed {took:?} after the Node was deleted");
    assert!(
        ping(&a1, addr(&ra2, false).unwrap(), 1).is_err(),
        "no route, no path"
    );
    n2.create_object(&api, &n1.net.node).unwrap();
    let took = wait_for(
        "node-1's routes to node-2 back",
        Duration::from_secs(5),
        || route_to(&n1, &n2),
    )
    .unwrap();
    eprintln!("routes back {took:?} after the Node returned");
    ping(&a1, addr(&ra2, false).unwrap(), 2).unwrap();
    ping(&a1, addr(&ra2, true).unwrap(), 2).unwrap();

    for (n, name, ns) in [(&n1, "a1", &a1), (&n1, "b1", &b1), (&n2, "a2", &a2)] {
        n.del_pod(name, ns).unwrap();
    }
    for n in [&n1, &n2] {
        let log = n.agent_log();
        assert!(!log.contains("ERROR"), "{} agent: {log}", n.name);
    }
}
