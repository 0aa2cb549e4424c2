//! Flows that begin on one path and go on on the other keep their verdict.
//! A server that a policy isolates (only the client may reach it) switches
//! between the kernel path (annotated `off`: the nftables rules) and the
//! fast path (the policy in the datapath), both ways, while a TCP
//! connection and a UDP exchange of the client run: both carry on across
//! the switch, and another pod stays refused throughout.
//!
//! How: a flow the datapath has no record of and that conntrack has (UDP),
//! or that is past its SYN (TCP), is the kernel's: the programs pass it
//! (pass_policy) and the rules decide, as they did. A flow the datapath
//! recorded that moves to the kernel path is picked up by conntrack
//! mid-stream, under the table's rules for that (docs/netpol.md).
//! Needs root, bpffs, nftables, containernetworking-plugins, and
//! scripts/k8s-build.sh.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream, UdpSocket},
    os::fd::AsRawFd,
    time::{Duration, Instant},
};

use serde_json::json;
use xdpcni_e2e::{
    agent::wait_mode,
    cluster::{KubeNode, TestPod},
    in_netns,
};
use xdpcni_ebpf::{abi, Maps, PolicyStats};

/// Whether the connection still carries data: 1000 bytes written are
/// acknowledged (the send queue drains) within 1.5 s.
fn carries(c: &mut TcpStream) -> bool {
    if c.write_all(&[0x5a; 1000]).is_err() {
        return false;
    }
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(1500) {
        let mut pending: libc::c_int = 0;
        // SAFETY: TIOCOUTQ writes one int: the bytes not yet acknowledged.
        unsafe { libc::ioctl(c.as_raw_fd(), libc::TIOCOUTQ, &mut pending) };
        if pending == 0 {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// A TCP connection from `from` to `to`:80, its greeting read.
fn connect(from: &TestPod, to: &TestPod) -> TcpStream {
    let addr = SocketAddr::new(to.ip(false), 80);
    let want = format!("{}\n", to.id());
    in_netns(&from.netns, move || {
        let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        c.set_read_timeout(Some(Duration::from_millis(500)))?;
        let mut greeting = vec![0u8; want.len()];
        c.read_exact(&mut greeting)?;
        anyhow::ensure!(greeting == want.as_bytes(), "{greeting:?}");
        Ok(c)
    })
    .unwrap()
}

/// A UDP socket of `from` connected to `to`:80 (the pods echo there).
fn udp(from: &TestPod, to: &TestPod) -> UdpSocket {
    let addr = SocketAddr::new(to.ip(false), 80);
    in_netns(&from.netns, move || {
        let s = UdpSocket::bind("0.0.0.0:0")?;
        s.connect(addr)?;
        s.set_read_timeout(Some(Duration::from_millis(200)))?;
        Ok(s)
    })
    .unwrap()
}

/// Echoes answered of `n` sent one after the other on `s`.
fn echoes(s: &UdpSocket, n: usize) -> usize {
    let mut buf = [0u8; 64];
    (0..n)
        .filter(|i| {
            let msg = format!("echo {i}");
            s.send(msg.as_bytes()).is_ok()
                && matches!(s.recv(&mut buf), Ok(k) if buf[..k] == *msg.as_bytes())
        })
        .count()
}

/// Whether `from` is refused by `to` over TCP:80 (no connection in 500 ms).
fn refused(from: &TestPod, to: &TestPod) -> bool {
    let addr = SocketAddr::new(to.ip(false), 80);
    in_netns(&from.netns, move || {
        Ok(TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_err())
    })
    .unwrap()
}

fn policy_flagged(node: &KubeNode, pod: &TestPod) -> bool {
    Maps::open_pinned(node.pin_dir())
        .unwrap()
        .endpoint(pod.ip(false))
        .unwrap()
        .is_some_and(|e| e.flags & abi::EP_POLICY != 0)
}

fn wait_flagged(node: &KubeNode, pod: &TestPod, want: bool) {
    let start = Instant::now();
    while policy_flagged(node, pod) != want {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{} flagged for the datapath's check: wanted {want}\n{}",
            pod.id(),
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn netpol_flows_keep_their_verdict_when_their_pod_changes_path_both_ways() {
    let mut node = KubeNode::start(|_| {}).unwrap();
    node.namespace("x", json!({ "ns": "x" })).unwrap();
    let client = node
        .add_pod("x", "client", json!({ "app": "client" }), json!([]))
        .unwrap();
    let other = node
        .add_pod("x", "other", json!({ "app": "other" }), json!([]))
        .unwrap();
    let server = node
        .add_pod("x", "server", json!({ "app": "server" }), json!([]))
        .unwrap();
    node.create_policy(json!({ "metadata": { "name": "only-client", "namespace": "x" },
        "spec": { "podSelector": { "matchLabels": { "app": "server" } },
                  "ingress": [{ "from": [{ "podSelector": { "matchLabels": { "app": "client" } } }] }] } }))
    .unwrap();
    let shown = xdpcni_e2e::agent::default_shown();
    let stats = || PolicyStats::read_pinned(node.pin_dir()).unwrap();
    // The server's mode: `off` (the kernel path) or the node default.
    let server_mode = |off: bool| {
        let (annotation, shown) = if off {
            (json!("off"), "none")
        } else {
            (json!(null), shown)
        };
        node.annotate("x", "server", json!({ "xdpcni.io/xdp-mode": annotation }))
            .unwrap();
        wait_mode(&node.net.node, &server.host, shown, Duration::from_secs(10)).unwrap();
        wait_flagged(&node, &server, !off);
    };

    // Kernel path first: the server annotated off, the rules decide.
    server_mode(true);
    assert!(refused(&other, &server), "other refused on the kernel path");
    let mut tcp = connect(&client, &server);
    let u = udp(&client, &server);
    assert!(
        carries(&mut tcp) && echoes(&u, 20) == 20,
        "on the kernel path"
    );
    // To the fast path: the policy in the datapath.
    server_mode(false);
    let before = stats();
    assert!(
        carries(&mut tcp),
        "the kernel path's TCP connection goes on"
    );
    assert_eq!(echoes(&u, 50), 50, "the kernel path's UDP exchange goes on");
    let after = stats();
    assert!(
        after.kernel >= before.kernel + 50,
        "their packets were left to the rules (pass_policy): {before:?} -> {after:?}"
    );
    assert!(refused(&other, &server), "other refused on the fast path");
    // A new connection of the client takes the datapath's check.
    let before = stats();
    let mut tcp2 = connect(&client, &server);
    let u2 = udp(&client, &server);
    assert!(
        carries(&mut tcp2) && echoes(&u2, 20) == 20,
        "on the fast path"
    );
    let after = stats();
    assert!(
        after.new >= before.new + 2 && after.hit > before.hit,
        "new flows allowed and followed by the datapath: {before:?} -> {after:?}"
    );
    assert!(after.refused > 0, "other's SYNs refused by the datapath");

    // And back: the flows the datapath carried go on on the kernel path.
    server_mode(true);
    assert!(carries(&mut tcp2), "the fast path's TCP connection goes on");
    // The first exchanges may meet the switch's window (2 s: a new UDP
    // flow of the pod is checked both ways); the client is allowed both
    // ways here, so none is lost.
    assert_eq!(echoes(&u2, 50), 50, "the fast path's UDP exchange goes on");
    assert!(carries(&mut tcp), "the first connection too");
    assert!(
        refused(&other, &server),
        "other refused on the kernel path again"
    );

    // The agent down while the server leaves the fast path: the first pass
    // of the next agent still switches it as a pod isolated anew (the
    // pinned records say the datapath checked it), and forgets the
    // conntrack entries its fast-path flows may have left.
    server_mode(false);
    node.stop_agent(libc::SIGTERM).unwrap();
    node.annotate("x", "server", json!({ "xdpcni.io/xdp-mode": "off" }))
        .unwrap();
    node.start_agent().unwrap();
    wait_mode(
        &node.net.node,
        &server.host,
        "none",
        Duration::from_secs(10),
    )
    .unwrap();
    let ip = server.ip(false).to_string();
    let deadline = Instant::now() + Duration::from_secs(5);
    let switched = loop {
        let log = node.agent_log();
        let line = log
            .lines()
            .find(|l| l.contains("left for newly isolated pods deleted") && l.contains(&ip));
        if line.is_some() || Instant::now() > deadline {
            break line.map(str::to_string);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        switched.is_some(),
        "the server left the datapath's check in the restarted agent's first pass, unswitched:\n{}",
        node.agent_log()
    );
    assert!(carries(&mut tcp2), "the connection goes on across it");
    for p in [client, other, server] {
        node.del_pod(p).unwrap();
    }
}
