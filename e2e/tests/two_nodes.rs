//! Two nodes: two node network namespaces joined by a veth "wire", each with
//! its own xdpcni-agent in Kubernetes mode against one real API server (two
//! Node objects with their pod CIDRs and InternalIPs), pods made through the
//! real CNI on each. Pod-to-pod across nodes goes over the agents'
//! host-gateway routes (ping, UDP, TCP, v4 and v6); same-node traffic still
//! takes the XDP fast path; a node's routes go with its Node object and come
//! back with it.
//! Needs root, bpffs, containernetworking-plugins, etcd and kube-apiserver
//! (scripts/k8s-build.sh).

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use xdpcni_e2e::{
    cni::{agent_binary, result_ips, wait_ready, Call, Network, NodeProcess},
    kube::ApiServer,
    netns::Netns,
    traffic::{ping, tcp_transfer, udp_echo},
    unique_name, PinDir,
};
use xdpcni_ebpf::Maps;

/// The agents' default listen address, in each node's namespace.
const LISTEN: &str = xdpcni_agent::config::DEFAULT_LISTEN;

/// One node of the pair.
struct TestNode {
    name: &'static str,
    pins: PinDir,
    net: Network,
    /// The node's address on the wire (its InternalIP), v4 and v6.
    ip4: &'static str,
    ip6: &'static str,
    pod4: &'static str,
    pod6: &'static str,
}

impl TestNode {
    fn new(name: &'static str, i: u8) -> Self {
        let (pod4, pod6, ip4, ip6) = match i {
            1 => ("10.81.1.0/24", "fd81:1::/64", "192.168.77.1", "fd77::1"),
            _ => ("10.81.2.0/24", "fd81:2::/64", "192.168.77.2", "fd77::2"),
        };
        let pins = PinDir::new("x2").unwrap();
        let net = Network::new(
            pins.path(),
            "1.1.0",
            json!([[{ "subnet": pod4 }], [{ "subnet": pod6 }]]),
        )
        .unwrap();
        Self {
            name,
            pins,
            net,
            ip4,
            ip6,
            pod4,
            pod6,
        }
    }

    fn object(&self) -> (Value, Value) {
        (
            json!({
                "metadata": { "name": self.name },
                "spec": { "podCIDR": self.pod4, "podCIDRs": [self.pod4, self.pod6] },
            }),
            json!({ "status": { "addresses": [
                { "type": "InternalIP", "address": self.ip4 },
                { "type": "InternalIP", "address": self.ip6 },
            ] } }),
        )
    }

    fn agent(&self, kubeconfig: &Path) -> NodeProcess {
        let cfg = self.net.dir.path().join("agent.json");
        std::fs::write(
            &cfg,
            json!({
                "pinDir": self.pins.path(), "stateDir": self.net.dir.path().join("state"),
                "xdpMode": "native", "redirect": "devmap", "intervalMs": 300,
            })
            .to_string(),
        )
        .unwrap();
        let log = self.net.dir.path().join("agent.log");
        let agent = NodeProcess::spawn_env(
            &self.net.node,
            &agent_binary().unwrap(),
            &["run", "--config", cfg.to_str().unwrap()],
            &[
                ("NODE_NAME", self.name),
                ("KUBECONFIG", kubeconfig.to_str().unwrap()),
            ],
            &log,
        )
        .unwrap();
        wait_ready(&self.net.node, LISTEN, Duration::from_secs(30), || {
            format!("{} agent: {}", self.name, self.agent_log())
        })
        .unwrap();
        agent
    }

    fn agent_log(&self) -> String {
        std::fs::read_to_string(self.net.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// ADDs pod `name` through the CNI, as the runtime of this node would.
    fn add_pod(&self, name: &str) -> (Netns, Value) {
        let ns = Netns::new("xp").unwrap();
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name}");
        let path = ns.path();
        let mut call = Call::new("ADD", name, Some(&path));
        call.args = &args;
        let out = self.net.call(&call, &json!({})).unwrap();
        assert_eq!(out.status, 0, "ADD {name}: {:?}", out.json);
        (ns, out.json)
    }

    fn del_pod(&self, name: &str, ns: &Netns) {
        let path = ns.path();
        let out = self
            .net
            .call(&Call::new("DEL", name, Some(&path)), &json!({}))
            .unwrap();
        assert_eq!(out.status, 0, "DEL {name}: {:?}", out.json);
    }

    /// The routes the agent owns (`proto 90`), as `ip route` prints them.
    fn agent_routes(&self) -> String {
        let v4 = self.net.node.ip(&["route", "show", "proto", "90"]).unwrap();
        let v6 = self
            .net
            .node
            .ip(&["-6", "route", "show", "proto", "90"])
            .unwrap();
        format!("{v4}{v6}")
    }

    /// Packets pod `res`'s host veth sent on through the fast path.
    fn forwarded(&self, res: &Value) -> u64 {
        let host = res["interfaces"][0]["name"].as_str().unwrap();
        let ifindex = self.net.node.ifindex(host).unwrap();
        Maps::open_pinned(self.pins.path())
            .unwrap()
            .counters(ifindex)
            .unwrap()
            .forwarded()
    }
}

fn wait_for(what: &str, within: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    start.elapsed()
}

fn addr(res: &Value, v6: bool) -> IpAddr {
    *result_ips(res).iter().find(|i| i.is_ipv6() == v6).unwrap()
}

#[test]
fn two_nodes_route_pods_across_the_wire_and_keep_xdp_on_each_node() {
    let n1 = TestNode::new("node-1", 1);
    let n2 = TestNode::new("node-2", 2);
    // The wire: a veth pair from node-1's namespace into node-2's.
    let (w1, w2) = (unique_name("xw"), unique_name("xw"));
    n1.net.node.add_veth(&w1, &w2, Some(&n2.net.node)).unwrap();
    for (n, w) in [(&n1, &w1), (&n2, &w2)] {
        n.net
            .node
            .ip(&["addr", "add", &format!("{}/24", n.ip4), "dev", w])
            .unwrap();
        n.net
            .node
            .ip(&[
                "-6",
                "addr",
                "add",
                &format!("{}/64", n.ip6),
                "dev",
                w,
                "nodad",
            ])
            .unwrap();
        n.net.node.ip(&["link", "set", w, "up"]).unwrap();
    }
    ping(&n1.net.node, n2.ip4.parse().unwrap(), 1).unwrap();

    // One API server (in node-1, reachable from node-2 over the wire), two
    // Node objects with their pod CIDRs and InternalIPs.
    let api = ApiServer::start_on(&n1.net.node, "0.0.0.0").unwrap();
    let kc2: PathBuf = api.kubeconfig_via(n1.ip4).unwrap();
    let create_node = |n: &TestNode| {
        let (obj, status) = n.object();
        let name = n.name;
        api.with_client(&n1.net.node, |c| async move {
            let nodes: Api<Node> = Api::all(c);
            nodes
                .create(&PostParams::default(), &serde_json::from_value(obj)?)
                .await?;
            nodes
                .patch_status(name, &PatchParams::default(), &Patch::Merge(status))
                .await?;
            Ok(())
        })
        .unwrap();
    };
    create_node(&n1);
    create_node(&n2);
    api.with_client(&n1.net.node, |c| async move {
        let pods: Api<Pod> = Api::namespaced(c, "default");
        for (name, node) in [("a1", "node-1"), ("b1", "node-1"), ("a2", "node-2")] {
            pods.create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": { "name": name },
                    "spec": { "nodeName": node, "containers": [{ "name": "c", "image": "pause" }] },
                }))?,
            )
            .await?;
        }
        Ok(())
    })
    .unwrap();

    // An agent per node, each in Kubernetes mode.
    let _agent1 = n1.agent(&api.kubeconfig);
    let _agent2 = n2.agent(&kc2);
    let (a1, ra1) = n1.add_pod("a1");
    let (b1, rb1) = n1.add_pod("b1");
    let (a2, ra2) = n2.add_pod("a2");
    let route_to = |n: &TestNode, other: &TestNode| {
        let r = n.agent_routes();
        r.contains(&format!("{} via {}", other.pod4, other.ip4))
            && r.contains(&format!("{} via {}", other.pod6, other.ip6))
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
        ping(&a1, addr(&ra2, v6), 3).unwrap();
        ping(&a2, addr(&ra1, v6), 3).unwrap();
        udp_echo(&a1, &a2, addr(&ra2, v6), 20, 1000).unwrap();
        let mbps = tcp_transfer(&a2, &a1, addr(&ra1, v6), 4 << 20).unwrap();
        eprintln!(
            "TCP node-2 -> node-1 ({}): {mbps:.0} Mbit/s",
            if v6 { "v6" } else { "v4" }
        );
    }
    // Same node: still the fast path (a1's forward counters move).
    let before = n1.forwarded(&ra1);
    ping(&a1, addr(&rb1, false), 5).unwrap();
    udp_echo(&a1, &b1, addr(&rb1, true), 10, 200).unwrap();
    let same_node = n1.forwarded(&ra1) - before;
    assert!(
        same_node >= 15,
        "same-node traffic redirected by XDP: {same_node}"
    );
    // Cross-node traffic is not redirected (there is no endpoint for it).
    let before = n1.forwarded(&ra1);
    ping(&a1, addr(&ra2, false), 5).unwrap();
    assert_eq!(
        n1.forwarded(&ra1),
        before,
        "cross-node frames take the kernel path"
    );

    // node-2's Node object deleted: node-1's routes to it go, and with them
    // the path; back with the object.
    api.with_client(&n1.net.node, |c| async move {
        Api::<Node>::all(c)
            .delete("node-2", &Default::default())
            .await?;
        Ok(())
    })
    .unwrap();
    let took = wait_for(
        "node-1's routes to node-2 removed",
        Duration::from_secs(5),
        || !n1.agent_routes().contains(n2.pod4) && !n1.agent_routes().contains(n2.pod6),
    );
    eprintln!("routes removed {took:?} after the Node was deleted");
    assert!(
        ping(&a1, addr(&ra2, false), 1).is_err(),
        "no route, no path"
    );
    create_node(&n2);
    let took = wait_for(
        "node-1's routes to node-2 back",
        Duration::from_secs(5),
        || route_to(&n1, &n2),
    );
    eprintln!("routes back {took:?} after the Node returned");
    ping(&a1, addr(&ra2, false), 2).unwrap();
    ping(&a1, addr(&ra2, true), 2).unwrap();

    for (n, name, ns) in [(&n1, "a1", &a1), (&n1, "b1", &b1), (&n2, "a2", &a2)] {
        n.del_pod(name, ns);
    }
    for n in [&n1, &n2] {
        let log = n.agent_log();
        assert!(!log.contains("ERROR"), "{} agent: {log}", n.name);
    }
}
