//! The plugin SIGKILLed at every step of ADD and of DEL (it stops itself at a
//! named crash point, `XDPCNI_TEST_STOP_AT`, and the test kills it there, as
//! an OOM kill or a node power cut would), followed by what a runtime does
//! next: DEL (twice: runtimes retry), then GC. Nothing may be left (veth, IP
//! allocation, record, endpoint, devmap entry, counter slot, link pin, hold),
//! and the next ADD of the same container must succeed. The ADDs are of a
//! Kubernetes pod on a node whose agent has not written the policy gate, so
//! each is held: a hold made in part is cleaned up too. And the agent
//! SIGKILLed at every crash point of a pod's mode switch, then restarted:
//! it converges without a lost ping. (The datapath's migration killed at
//! each step is in migrate.rs, with the upgrades.)
//! Needs root, bpffs at /sys/fs/bpf and containernetworking-plugins.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::time::{Duration, Instant};

use serde_json::json;
use xdpcni_e2e::{
    agent::wait_mode,
    cni::{result_ips, Call, Network},
    in_netns,
    netns::Netns,
    node::{Node, PodPair},
    nodes::addr,
    traffic::{ping, tcp_transfer, BackgroundPing},
    PinDir,
};
use xdpcni_ebpf::{abi::EP_KERNEL_ONLY, Datapath, Maps};

/// Every crash point an ADD passes, in order (the fast path's, `converge:`,
/// are the agent's: `agent_standalone`'s crash tests stop it there).
const ADD_STEPS: &[&str] = &[
    "add:ipam",
    "add:veth",
    "add:hold",
    "add:pod",
    "add:routes",
    "add:record",
];

/// CNI_ARGS of the Kubernetes pod the crash tests ADD (held at ADD).
const K8S_ARGS: &str = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=crash";

/// Every crash point a DEL passes, in order.
const DEL_STEPS: &[&str] = &[
    "del:detached",
    "del:endpoints",
    "del:datapath",
    "del:veth",
    "del:ipam",
];

fn setup() -> (PinDir, Network, Netns) {
    let pins = PinDir::new("xk").unwrap();
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
    in_netns(&net.node, || Ok(Datapath::open(pins.path()).map(drop)?)).unwrap();
    (pins, net, Netns::new("xp").unwrap())
}

/// Nothing of any attachment is left on the node or in the datapath.
fn assert_nothing_left(net: &Network, pins: &PinDir, pod: &Netns, what: &str) {
    assert_eq!(
        net.host_veths().unwrap(),
        Vec::<String>::new(),
        "{what}: host veths left"
    );
    assert!(
        pod.link_json("eth0").is_err(),
        "{what}: eth0 left in the pod"
    );
    assert_eq!(
        net.allocated_ips(),
        Vec::<std::net::IpAddr>::new(),
        "{what}: IPs left allocated"
    );
    assert_eq!(net.records(), 0, "{what}: records left");
    let maps = Maps::open_pinned(pins.path()).unwrap();
    assert_eq!(
        maps.endpoints().unwrap().len(),
        0,
        "{what}: endpoint records left"
    );
    assert_eq!(
        maps.tx_port_list().unwrap(),
        Vec::<u32>::new(),
        "{what}: devmap entries left"
    );
    assert_eq!(
        maps.slot_owner_list().unwrap(),
        Vec::<(u32, u32)>::new(),
        "{what}: counter slots left"
    );
    let links = std::fs::read_dir(pins.path().join("links"))
        .unwrap()
        .count();
    assert_eq!(links, 0, "{what}: link pins left");
}

/// What a runtime does after a failed or lost call: DEL until it succeeds
/// (twice here, the second finding nothing), then GC with no valid
/// attachment.
fn runtime_cleans_up(net: &Network, id: &str, pod: &Netns, what: &str) {
    let path = pod.path();
    for round in 1..=2 {
        let d = net
            .call(&Call::new("DEL", id, Some(&path)), &json!({}))
            .unwrap();
        assert_eq!(d.status, 0, "{what}: DEL #{round}: {:?}", d.json);
    }
    let gc = net
        .call(
            &Call::new("GC", "", None),
            &json!({ "cni.dev/valid-attachments": [] }),
        )
        .unwrap();
    assert_eq!(gc.status, 0, "{what}: GC: {:?}", gc.json);
}

/// A whole ADD of `id` that must succeed: of the Kubernetes pod, held
/// (`held`), or of a pod without a namespace, which reaches the node.
fn add_ok(
    net: &Network,
    pins: &PinDir,
    id: &str,
    pod: &Netns,
    held: bool,
    what: &str,
) -> serde_json::Value {
    let path = pod.path();
    let mut call = Call::new("ADD", id, Some(&path));
    if held {
        call.args = K8S_ARGS;
    }
    let out = net.call(&call, &json!({})).unwrap();
    assert_eq!(out.status, 0, "{what}: ADD: {:?}\n{}", out.json, net.log());
    assert_eq!(result_ips(&out.json).len(), 2, "{what}: {:?}", out.json);
    let host = out.json["interfaces"][0]["name"].as_str().unwrap();
    let idx = net.node.ifindex(host).unwrap();
    assert_eq!(xdpcni_ebpf::is_held(pins.path(), idx), held, "{what}");
    if held {
        assert!(
            ping(pod, "10.99.0.1".parse().unwrap(), 1).is_err(),
            "{what}: held"
        );
    } else {
        ping(pod, "10.99.0.1".parse().unwrap(), 1).unwrap();
    }
    out.json
}

#[test]
fn crash_at_every_add_step_then_del_and_gc_leave_nothing() {
    let (pins, net, pod) = setup();
    let path = pod.path();
    for step in ADD_STEPS {
        let what = format!("ADD killed at {step}");
        let mut call = Call::new("ADD", "crash-add", Some(&path));
        call.args = K8S_ARGS;
        net.call_killed_at(&call, step)
            .unwrap_or_else(|e| panic!("{what}: {e:#}"));
        runtime_cleans_up(&net, "crash-add", &pod, &what);
        assert_nothing_left(&net, &pins, &pod, &what);
        // The same container comes up fine after it, held or not.
        add_ok(&net, &pins, "crash-add", &pod, true, &what);
        runtime_cleans_up(&net, "crash-add", &pod, &what);
        assert_nothing_left(&net, &pins, &pod, &what);
        add_ok(&net, &pins, "crash-add", &pod, false, &what);
        let d = net
            .call(&Call::new("DEL", "crash-add", Some(&path)), &json!({}))
            .unwrap();
        assert_eq!(d.status, 0, "{what}: {:?}", d.json);
        assert_nothing_left(&net, &pins, &pod, &what);
    }
}

#[test]
fn crash_at_every_del_step_then_del_and_gc_leave_nothing() {
    let (pins, net, pod) = setup();
    let path = pod.path();
    for step in DEL_STEPS {
        let what = format!("DEL killed at {step}");
        let prev = add_ok(&net, &pins, "crash-del", &pod, true, &what);
        // The runtime's DEL carries the ADD's result as prevResult.
        let mut conf = net.conf.clone();
        conf.prev_result = Some(prev);
        xdpcni_e2e::cni::exec_killed_at(
            &net.plugin,
            &net.cni_path,
            &net.node,
            &serde_json::to_value(&conf).unwrap(),
            &Call::new("DEL", "crash-del", Some(&path)),
            step,
        )
        .unwrap_or_else(|e| panic!("{what}: {e:#}"));
        runtime_cleans_up(&net, "crash-del", &pod, &what);
        assert_nothing_left(&net, &pins, &pod, &what);
    }
    // And the container comes back after all of them.
    add_ok(
        &net,
        &pins,
        "crash-del",
        &pod,
        false,
        "ADD after the DEL crashes",
    );
    runtime_cleans_up(&net, "crash-del", &pod, "final DEL");
    assert_nothing_left(&net, &pins, &pod, "final DEL");
}

/// The offloads of `pod`'s eth0 that the mode `mode` needs (pod::offloads).
fn assert_offloads_of(pod: &Netns, mode: &str) {
    let mode = xdpcni_host::pod::XdpMode::parse(mode).unwrap();
    for (offload, on) in xdpcni_host::pod::offloads(mode) {
        let have = in_netns(pod, || Ok(xdpcni_host::ethtool::get("eth0", offload)?)).unwrap();
        assert_eq!(have, on, "{mode}: {offload:?} of eth0");
    }
}

#[test]
fn crash_mid_switch_agent_restart_converges_without_losing_pings() {
    let node = Node::standalone("xc").unwrap();
    // The first agent loads the datapath; the pods come up native.
    let first = node.start_agent("agent0.log").unwrap();
    let PodPair {
        pa,
        ra,
        pb,
        ha,
        b_ip,
        ..
    } = node.pair_attached("xdp", Duration::from_secs(2)).unwrap();
    assert_eq!(first.stop(libc::SIGTERM).unwrap(), Some(0));
    // 40 s of pings at 10 ms: longer than the eight rounds take.
    let pinger = BackgroundPing::start(&pa, b_ip, 4000).unwrap();
    // Each switch is killed at one of the crash points of the shared attach
    // logic (the agent's apply.rs), then a fresh agent takes over: into and out of
    // tc from each XDP mode and off, at each point.
    let rounds = [
        ("converge:offloads", "generic", "xdpgeneric"),
        ("converge:records", "tc", "tc"),
        ("converge:attached", "generic", "xdpgeneric"),
        ("converge:attached", "tc", "tc"),
        ("converge:detached", "off", "none"),
        ("converge:records", "native", "xdp"),
        ("converge:offloads", "tc", "tc"),
        ("converge:attached", "native", "xdp"),
    ];
    for (i, (step, mode, want)) in rounds.into_iter().enumerate() {
        let what = format!("switch to {mode} killed at {step}");
        let agent = node
            .start_agent_env(
                &format!("crash{i}.log"),
                &[(xdpcni_e2e::hooks::STOP_AT, step)],
            )
            .unwrap();
        node.set_pods(&json!({ "default/a": { "xdpcni.io/xdp-mode": mode } }))
            .unwrap();
        agent
            .wait_stopped(Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("{what}: {e:#}: {}", node.log(&format!("crash{i}.log"))));
        assert_eq!(agent.stop(libc::SIGKILL).unwrap(), None, "{what}");
        // Killed mid-switch: still forwarding, on whichever side it was.
        std::thread::sleep(Duration::from_millis(300));
        let _agent = node.start_agent(&format!("after{i}.log")).unwrap();
        let took = wait_mode(&node.net.node, &ha, want, Duration::from_secs(3))
            .unwrap_or_else(|e| panic!("{what}: {e:#}: {}", node.log(&format!("after{i}.log"))));
        eprintln!("{what}: converged {took:?} after the restart");
        // The restart also finishes what the killed switch left undone.
        let start = Instant::now();
        loop {
            let ok = std::panic::catch_unwind(|| assert_offloads_of(&pa, mode));
            if ok.is_ok() {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(3),
                "{what}: offloads not converged: {}",
                node.log(&format!("after{i}.log"))
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let maps = Maps::open_pinned(node.pins.path()).unwrap();
        let ep = maps.endpoint(addr(&ra, false).unwrap()).unwrap().unwrap();
        assert_eq!(
            ep.flags & EP_KERNEL_ONLY != 0,
            mode == "off",
            "{what}: the endpoint's kernel-only flag"
        );
        tcp_transfer(&pa, &pb, b_ip, 1 << 20).unwrap();
    }
    let lost = pinger.lost().unwrap();
    assert_eq!(lost, 0, "pings lost across eight killed switches");
    node.del_pod("a", &pa).unwrap();
    node.del_pod("b", &pb).unwrap();
}
