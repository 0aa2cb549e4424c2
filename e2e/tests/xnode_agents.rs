//! The fast path between nodes as the agents keep it: two nodes on one
//! wire, each with its real agent in Kubernetes mode against one real API
//! server, `routing.mode: hostGateway`, pods in mode `tc` made by the real
//! CNI. The agents write `remote_nets` and attach the uplink program in
//! their routing pass; the test watches what a user would: the status, the
//! counters, the pings.
//!
//! - On: both nodes' status says so (two pod CIDRs, the wire as uplink);
//!   ping, UDP and TCP both ways and both families go out by
//!   `redirect_neigh` and in by `from_node_peer`.
//! - The Node annotation turns it off (and back on) within a pass, with 10
//!   ms pings running and none lost; an unknown value is off and an Event.
//! - The agent killed (SIGKILL) and started again under 10 ms pings: none
//!   lost, the fast path carries on while the agent is gone.
//! - A Node deleted mid-stream: by the time its routes are gone its
//!   entries are too (the same pass), and nothing more is sent by the fast
//!   path to it.
//! - A mode switch to vxlan on both agents under 10 ms pings: none lost;
//!   the entries follow the routes into the tunnel, the uplink program
//!   moves from the wire to the VXLAN device, and traffic goes out by
//!   `redirect_neigh` into the tunnel and in by `from_node_peer` from it.
//!   A Node deleted mid-stream under vxlan: no packet to its VTEP after
//!   the pass that removes its routes.
//!
//! Needs root, bpffs, containernetworking-plugins, etcd and kube-apiserver
//! (scripts/k8s-build.sh).

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{net::IpAddr, time::Duration};

use xdpcni_agent::status::Status;
use xdpcni_e2e::{
    cni::{http_get, NodeProcess},
    kube::ApiServer,
    netns::Netns,
    node::AgentConfig,
    nodes::{addr, create_pods, wait_for, ClusterNode},
    traffic::{ping, tcp_transfer, udp_echo, BackgroundPing},
    unique_name,
};
use xdpcni_ebpf::{abi::Verdict, Maps, RemoteMaps};

/// node `i` (1 or 2): pod CIDRs 10.83.i.0/24, fd83:i::/64, InternalIPs
/// 192.168.83.i, fd83:ff::i on the wire; pods in mode tc.
fn node(i: u8) -> ClusterNode {
    let mut n = ClusterNode::new(
        &format!("node-{i}"),
        &format!("10.83.{i}.0/24"),
        &format!("fd83:{i}::/64"),
        &[&format!("192.168.83.{i}"), &format!("fd83:ff::{i}")],
    )
    .unwrap();
    n.config.xdp_mode = "tc".into();
    n
}

fn verdict(label: &str) -> Verdict {
    *Verdict::ALL.iter().find(|v| v.label() == label).unwrap()
}

/// Packets of `label` counted on device `dev` of node `n`.
fn count(n: &ClusterNode, dev: &str, label: &str) -> u64 {
    let ifindex = n.net.node.ifindex(dev).unwrap();
    Maps::open_pinned(n.pins.path())
        .unwrap()
        .counters(ifindex)
        .unwrap()
        .get(verdict(label))
        .packets
}

/// The agent's /v1/status on node `n`.
fn status(n: &ClusterNode) -> Status {
    n.status().unwrap()
}

/// The pod CIDRs in node `n`'s `remote_nets`.
fn remote_cidrs(n: &ClusterNode) -> Vec<String> {
    RemoteMaps::open_pinned(n.pins.path())
        .unwrap()
        .entries()
        .unwrap()
        .keys()
        .map(|(ip, p)| format!("{ip}/{p}"))
        .collect()
}

/// Whether the uplink program (by its id: the kernel truncates names) is
/// on `dev`'s tcx ingress of node `n`.
fn uplink_attached(n: &ClusterNode, dev: &str) -> bool {
    let id = n.program_id(xdpcni_ebpf::TC_FROM_NODE_PROGRAM).unwrap();
    n.net
        .node
        .tcx_ingress(dev)
        .unwrap()
        .iter()
        .any(|(_, i)| *i == id)
}

struct Two {
    n: [ClusterNode; 2],
    wire: [String; 2],
    api: ApiServer,
    kubeconfigs: [std::path::PathBuf; 2],
    agents: [Option<NodeProcess>; 2],
}

impl Two {
    fn new() -> Self {
        let n1 = node(1);
        let n2 = node(2);
        let (w1, w2) = (unique_name("xw"), unique_name("xw"));
        n1.net.node.add_veth(&w1, &w2, Some(&n2.net.node)).unwrap();
        for (n, w) in [(&n1, &w1), (&n2, &w2)] {
            let ns = &n.net.node;
            let v4 = format!("{}/24", n.ip(false).unwrap());
            let v6 = format!("{}/64", n.ip(true).unwrap());
            ns.ip(&["addr", "add", &v4, "dev", w]).unwrap();
            ns.ip(&["-6", "addr", "add", &v6, "dev", w, "nodad"])
                .unwrap();
            ns.ip(&["link", "set", w, "up"]).unwrap();
        }
        ping(&n1.net.node, n2.ip(false).unwrap(), 1).unwrap();
        let api = ApiServer::start_on(&n1.net.node, "0.0.0.0").unwrap();
        let kc2 = api
            .kubeconfig_via(&n1.ip(false).unwrap().to_string())
            .unwrap();
        n1.create_object(&api, &n1.net.node).unwrap();
        n2.create_object(&api, &n1.net.node).unwrap();
        create_pods(&api, &n1.net.node, &[("a1", "node-1"), ("a2", "node-2")]).unwrap();
        Self {
            kubeconfigs: [api.kubeconfig.clone(), kc2],
            n: [n1, n2],
            wire: [w1, w2],
            api,
            agents: [None, None],
        }
    }

    /// (Re)starts agent `i` in routing `mode` (the pods stay).
    fn agent(&mut self, i: usize, mode: &str) {
        if let Some(a) = self.agents[i].take() {
            a.stop(libc::SIGTERM).unwrap();
        }
        let mode = mode.to_string();
        let cfg = move |c: &mut AgentConfig| c.routing.mode = mode;
        self.agents[i] = Some(self.n[i].agent(&self.kubeconfigs[i], cfg).unwrap());
    }

    fn logs(&self) -> String {
        self.n
            .iter()
            .map(|n| format!("--- {} agent:\n{}", n.name, n.agent_log()))
            .collect()
    }

    /// Waits until `f` holds of node `i`'s status.
    fn wait_status(&self, i: usize, what: &str, f: impl Fn(&Status) -> bool) {
        wait_for(what, Duration::from_secs(10), || f(&status(&self.n[i]))).unwrap_or_else(|e| {
            panic!("{e}: {:?}\n{}", status(&self.n[i]).cross_node, self.logs())
        });
    }

    /// Sets node `i`'s fast path annotation (None: removes it).
    fn annotate(&self, i: usize, value: Option<&str>) {
        let key = xdpcni_agent::routes::NODE_FAST_PATH_ANNOTATION;
        self.n[i]
            .annotate(&self.api, &self.n[0].net.node, key, value)
            .unwrap();
    }

    /// Notes of the Events with `reason` about node `i`.
    fn node_events(&self, i: usize, reason: &str) -> Vec<String> {
        self.n[i]
            .events(&self.api, &self.n[0].net.node, reason)
            .unwrap()
    }
}

fn on(s: &Status, uplink: &str) -> bool {
    let x = &s.cross_node;
    x.on && x.destinations == 2 && x.uplinks.iter().any(|u| u.interface == uplink)
}

/// 10 ms pings from `from` to `to` while `during` runs; none may be lost.
fn no_loss(what: &str, from: &Netns, to: IpAddr, during: impl FnOnce()) {
    let pings = BackgroundPing::start(from, to, 100_000).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    during();
    std::thread::sleep(Duration::from_millis(500));
    let st = pings.interrupt().unwrap();
    eprintln!("{what}: {} pings, {} lost", st.sent, st.lost);
    assert!(st.sent > 60, "{what}: pings ran: {st:?}");
    assert_eq!(st.lost, 0, "{what}: {st:?}");
}

/// node-2's Node deleted under 10 ms pings from node-1's pod `from` to
/// node-2's `to2`: once
/// node-1's routes to it are gone, so are its entries, and nothing more
/// leaves `veth` by the fast path (the pings fail, as on the kernel path:
/// there is no route). Then the Node comes back and the fast path with it
/// (through `device`).
fn node_deleted_mid_stream(t: &Two, from: &Netns, to2: IpAddr, veth: &str, device: &str) {
    let pings = BackgroundPing::start(from, to2, 100_000).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    t.n[1].delete_object(&t.api, &t.n[0].net.node).unwrap();
    let pod4 = t.n[1].pod4.clone();
    wait_for(
        "node-1's route to node-2 removed",
        Duration::from_secs(5),
        || !t.n[0].agent_routes().contains(&pod4),
    )
    .unwrap();
    let left = remote_cidrs(&t.n[0]);
    assert!(left.is_empty(), "entries outlived their routes: {left:?}");
    let before = count(&t.n[0], veth, "redirect_neigh");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        count(&t.n[0], veth, "redirect_neigh"),
        before,
        "nothing sent by the fast path to a node without a route"
    );
    let st = pings.interrupt().unwrap();
    assert!(
        st.lost > 0,
        "no route, no path (as the kernel path): {st:?}"
    );
    t.n[1].create_object(&t.api, &t.n[0].net.node).unwrap();
    t.wait_status(0, "node-1's fast path back with node-2", |s| on(s, device));
    ping(from, to2, 2).unwrap();
}

#[test]
fn xnode_agents_keep_the_fast_path_with_the_routes_across_annotation_restart_removal_and_mode() {
    let mut t = Two::new();
    t.agent(0, "hostGateway");
    t.agent(1, "hostGateway");
    let (a1, r1) = t.n[0].add_pod("a1").unwrap();
    let (a2, r2) = t.n[1].add_pod("a2").unwrap();
    let veth1 = xdpcni_e2e::node::host_veth(&r1).unwrap();
    let veth2 = xdpcni_e2e::node::host_veth(&r2).unwrap();
    let [w1, w2] = t.wire.clone();
    t.wait_status(0, "node-1's fast path on", |s| on(s, &w1));
    t.wait_status(1, "node-2's fast path on", |s| on(s, &w2));
    wait_for("both pods on the fast path", Duration::from_secs(5), || {
        t.n[0].on_fast_path(&r1).unwrap() && t.n[1].on_fast_path(&r2).unwrap()
    })
    .unwrap();
    let mut cidrs = remote_cidrs(&t.n[0]);
    cidrs.sort();
    assert_eq!(cidrs, [t.n[1].pod4.clone(), t.n[1].pod6.clone()]);
    assert!(uplink_attached(&t.n[0], &w1) && uplink_attached(&t.n[1], &w2));

    // On: every kind of traffic both ways, out by redirect_neigh, in by
    // from_node_peer.
    let sent = count(&t.n[0], &veth1, "redirect_neigh");
    let got = count(&t.n[1], &w2, "from_node_peer");
    let back = count(&t.n[1], &veth2, "redirect_neigh");
    for v6 in [false, true] {
        ping(&a1, addr(&r2, v6).unwrap(), 3).unwrap();
        ping(&a2, addr(&r1, v6).unwrap(), 3).unwrap();
        udp_echo(&a1, &a2, addr(&r2, v6).unwrap(), 20, 1000).unwrap();
        tcp_transfer(&a2, &a1, addr(&r1, v6).unwrap(), 2 << 20).unwrap();
    }
    let sent = count(&t.n[0], &veth1, "redirect_neigh") - sent;
    let got = count(&t.n[1], &w2, "from_node_peer") - got;
    let back = count(&t.n[1], &veth2, "redirect_neigh") - back;
    eprintln!("node-1 sent {sent}, node-2 received {got}, node-2 sent {back} by the fast path");
    assert!(
        sent >= 46 && got >= 46 && back >= 100,
        "{sent} {got} {back}"
    );
    let (_, metrics) = http_get(&t.n[1].net.node, xdpcni_e2e::agent::LISTEN, "/metrics").unwrap();
    assert!(
        metrics.contains(r#"xdpcni_cross_node_fast_path{state="on"} 1"#)
            && metrics.contains(&format!(
                r#"xdpcni_uplink_packets_total{{interface="{w2}",verdict="from_node_peer"}}"#
            )),
        "{metrics}"
    );

    // The Node annotation turns it off, then on, under 10 ms pings.
    let to2 = addr(&r2, false).unwrap();
    no_loss("annotation off", &a1, to2, || {
        t.annotate(0, Some("false"));
        t.wait_status(0, "node-1's fast path off by its Node", |s| {
            s.cross_node.off.as_deref() == Some("node") && s.cross_node.uplinks.is_empty()
        });
    });
    assert!(remote_cidrs(&t.n[0]).is_empty());
    assert!(!uplink_attached(&t.n[0], &w1), "uplink program detached");
    let before = count(&t.n[0], &veth1, "redirect_neigh");
    ping(&a1, to2, 5).unwrap();
    assert_eq!(
        count(&t.n[0], &veth1, "redirect_neigh"),
        before,
        "off: the kernel sends"
    );
    t.annotate(0, Some("maybe"));
    t.wait_status(0, "an unknown value is off", |s| {
        s.cross_node.off.as_deref() == Some("bad_annotation")
    });
    wait_for("the Event on node-1", Duration::from_secs(5), || {
        t.node_events(0, "XdpcniBadAnnotation")
            .iter()
            .any(|n| n.contains(xdpcni_agent::routes::NODE_FAST_PATH_ANNOTATION))
    })
    .unwrap_or_else(|e| panic!("{e}: {}", t.logs()));
    no_loss("annotation removed", &a1, to2, || {
        t.annotate(0, None);
        t.wait_status(0, "node-1's fast path on again", |s| on(s, &w1));
    });

    // The agent killed and started again: the pinned datapath carries on.
    let before = count(&t.n[0], &veth1, "redirect_neigh");
    no_loss("agent killed and restarted", &a1, to2, || {
        t.agents[0].take().unwrap().stop(libc::SIGKILL).unwrap();
        std::thread::sleep(Duration::from_millis(500));
        t.agent(0, "hostGateway");
        t.wait_status(0, "node-1's fast path on after the restart", |s| on(s, &w1));
    });
    assert!(
        count(&t.n[0], &veth1, "redirect_neigh") > before + 50,
        "the fast path carried the pings"
    );

    // node-2's Node deleted mid-stream: when its routes are gone, so are
    // its entries; nothing more leaves by the fast path.
    node_deleted_mid_stream(&t, &a1, to2, &veth1, &w1);

    // A mode switch to vxlan, node by node, under 10 ms pings: the entries
    // follow the routes into the tunnel (its device, its gateways), the
    // uplink program leaves the wire for the VXLAN device; no ping is lost.
    let device = xdpcni_host::overlay::DEVICE;
    no_loss("hostGateway -> vxlan", &a1, to2, || {
        t.agent(0, "vxlan");
        t.agent(1, "vxlan");
        t.wait_status(0, "node-1's fast path through the tunnel", |s| {
            on(s, device) && s.cross_node.uplinks.len() == 1
        });
        t.wait_status(1, "node-2's fast path through the tunnel", |s| {
            on(s, device)
        });
    });
    assert!(t.n[0].agent_routes().contains(device));
    assert!(uplink_attached(&t.n[0], device) && !uplink_attached(&t.n[0], &w1));
    let sent = count(&t.n[0], &veth1, "redirect_neigh");
    let got = count(&t.n[1], device, "from_node_peer");
    for v6 in [false, true] {
        ping(&a1, addr(&r2, v6).unwrap(), 3).unwrap();
        tcp_transfer(&a1, &a2, addr(&r2, v6).unwrap(), 1 << 20).unwrap();
    }
    let sent = count(&t.n[0], &veth1, "redirect_neigh") - sent;
    let got = count(&t.n[1], device, "from_node_peer") - got;
    eprintln!("vxlan: node-1 sent {sent}, node-2's VXLAN device delivered {got} by the fast path");
    assert!(sent >= 6 && got >= 6, "{sent} {got}");
    // And a Node deleted mid-stream under vxlan: no packet to its VTEP
    // once its routes (and FDB) are gone.
    node_deleted_mid_stream(&t, &a1, to2, &veth1, device);

    for (i, name, ns) in [(0, "a1", &a1), (1, "a2", &a2)] {
        t.n[i].del_pod(name, ns).unwrap();
    }
    for n in &t.n {
        let log = n.agent_log();
        assert!(!log.contains("ERROR"), "{} agent: {log}", n.name);
    }
}
