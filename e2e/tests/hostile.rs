//! Hostile pods and hostile users on a node: a pod flooding a neighbour
//! does not stop a third pod's traffic, an unprivileged user can neither
//! read nor change the pinned datapath, and requests of every kind to the
//! agent's HTTP endpoints change nothing. (Spoofing pods and the
//! kernel-only pod are in equivalence.rs, which has the raw-frame lab.)
//! Needs root, bpffs at /sys/fs/bpf, containernetworking-plugins, setpriv.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{
    net::{IpAddr, Ipv4Addr},
    os::unix::fs::PermissionsExt,
    path::Path,
    time::Duration,
};

use serde_json::{json, Value};
use xdpcni_e2e::{
    agent::{StandaloneAgent, LISTEN},
    cni::{http_get, http_raw, result_ips, Call, Network},
    netns::Netns,
    node::{Node, PodPair},
    packet,
    traffic::{ping, raw_flood, BackgroundPing},
    PinDir,
};
use xdpcni_ebpf::Maps;

/// Fields drop in this order: the agent first (a running agent would load
/// the datapath again into the pin directory once it is removed), the pin
/// directory last.
struct Pods {
    _agent: StandaloneAgent,
    pods: Vec<(Netns, Value)>,
    net: Network,
    pins: PinDir,
}

/// A node with the agent running and `n` pods ADDed and attached by it in
/// its default mode (generic).
fn node(n: usize) -> Pods {
    let pins = PinDir::new("xh").unwrap();
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
    let agent = StandaloneAgent::start(&net, pins.path(), |_| {}).unwrap();
    let pods = (0..n)
        .map(|i| {
            let ns = Netns::new("xp").unwrap();
            let path = ns.path();
            let out = net
                .call(&Call::new("ADD", &format!("h{i}"), Some(&path)), &json!({}))
                .unwrap();
            assert_eq!(out.status, 0, "{:?}", out.json);
            let host = out.json["interfaces"][0]["name"].as_str().unwrap();
            xdpcni_e2e::agent::wait_default_mode(&net.node, host)
                .unwrap_or_else(|e| panic!("{e}: {}", agent.log()));
            (ns, out.json)
        })
        .collect();
    Pods {
        _agent: agent,
        pods,
        net,
        pins,
    }
}

impl Drop for Pods {
    fn drop(&mut self) {
        for (i, (ns, _)) in self.pods.iter().enumerate() {
            let path = ns.path();
            let _ = self
                .net
                .call(&Call::new("DEL", &format!("h{i}"), Some(&path)), &json!({}));
        }
    }
}

fn v4(result: &Value) -> Ipv4Addr {
    result_ips(result)
        .into_iter()
        .find_map(|ip| match ip {
            IpAddr::V4(v) => Some(v),
            IpAddr::V6(_) => None,
        })
        .unwrap()
}

/// (host veth MAC, pod MAC, host ifindex) from the ADD result.
fn macs(result: &Value) -> ([u8; 6], [u8; 6]) {
    let mac = |i: usize| {
        xdpcni_e2e::netns::parse_mac(result["interfaces"][i]["mac"].as_str().unwrap()).unwrap()
    };
    (mac(0), mac(1))
}

#[test]
fn hostile_flood_from_one_pod_does_not_stop_a_third_pods_ping() {
    let node = node(3);
    let [(a, ra), (_, rb), (c, _)] = &node.pods[..] else {
        unreachable!()
    };
    let b_ip = v4(rb);
    // The third pod's ping to b, quiet node.
    let quiet = BackgroundPing::start(c, IpAddr::V4(b_ip), 200)
        .unwrap()
        .stats()
        .unwrap();
    // a floods b with 64-byte frames from every CPU (AF_PACKET, bypassing
    // a's qdisc: as fast as this machine sends) while c pings b.
    let (host_mac, pod_mac) = macs(ra);
    let frame = packet::eth(
        host_mac,
        pod_mac,
        0x0800,
        &packet::ipv4(v4(ra), b_ip, 64, 17, &packet::udp(4000, 9, &[0x5a; 22])),
    );
    assert_eq!(frame.len(), 64);
    // What a's host veth has delivered through the fast path.
    let a_host = node
        .net
        .node
        .ifindex(ra["interfaces"][0]["name"].as_str().unwrap())
        .unwrap();
    let forwarded = || {
        Maps::open_pinned(node.pins.path())
            .unwrap()
            .counters(a_host)
            .unwrap()
            .forwarded()
    };
    let before = forwarded();
    let cpus = std::thread::available_parallelism().map_or(2, usize::from);
    let (sent, flooded) = std::thread::scope(|s| {
        let flood = s.spawn(|| {
            raw_flood(a, "eth0", &frame, &vec![None; cpus], Duration::from_secs(5)).unwrap()
        });
        std::thread::sleep(Duration::from_millis(500));
        let stats = BackgroundPing::start(c, IpAddr::V4(b_ip), 300)
            .unwrap()
            .stats()
            .unwrap();
        (flood.join().unwrap(), stats)
    });
    let redirected = forwarded() - before;
    eprintln!(
        "flood: {sent} frames of 64 bytes sent in 5 s ({:.2} Mpps), {redirected} redirected to b by the fast path",
        sent as f64 / 5e6
    );
    eprintln!(
        "c -> b ping every 10 ms: quiet {}/{} lost, rtt avg {:?} max {:?} ms; under the flood {}/{} lost, rtt avg {:?} max {:?} ms",
        quiet.lost, quiet.sent, quiet.avg_ms, quiet.max_ms,
        flooded.lost, flooded.sent, flooded.avg_ms, flooded.max_ms
    );
    assert!(redirected > 100_000, "the flood went through the fast path");
    assert_eq!(quiet.lost, 0, "no loss on the quiet node");
    assert!(
        flooded.lost * 10 <= flooded.sent,
        "the third pod's ping loses at most 10% under the flood: {flooded:?}"
    );
}

/// Every file and directory under `dir`, with `dir`.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Runs `sh -c script` as nobody; its exit status and stderr.
fn as_nobody(script: &str) -> (i32, String) {
    let out = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            "sh",
            "-c",
            script,
        ])
        .output()
        .expect("setpriv (util-linux)");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn hostile_unprivileged_user_cannot_read_or_change_the_pins() {
    let node = node(1);
    let dir = node.pins.path();
    let all = walk(dir);
    assert!(
        all.iter()
            .any(|p| p.starts_with(dir.join("links")) && p.is_file()),
        "a pod's link pin exists: {all:?}"
    );
    for p in &all {
        let mode = std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(
            mode & 0o077,
            0,
            "{}: mode {mode:o} lets others in",
            p.display()
        );
    }
    // The control: nobody can run a shell and write where anyone may.
    let (ok, err) = as_nobody("test -w /tmp && : > /dev/null");
    assert_eq!(ok, 0, "setpriv works: {err}");
    let endpoints = xdpcni_ebpf::layout_dir(dir).join("endpoints4");
    for (what, script) in [
        ("list the pin directory", format!("ls {}", dir.display())),
        ("add a pin", format!(": > {}/evil", dir.display())),
        ("make a directory", format!("mkdir {}/evil", dir.display())),
        ("remove a pin", format!("rm -f {}", endpoints.display())),
        (
            "open a map for writing",
            format!("test -w {}", endpoints.display()),
        ),
        (
            "detach a pod (remove its link pin)",
            format!("rm -rf {}/links", dir.display()),
        ),
    ] {
        let (code, err) = as_nobody(&script);
        assert_ne!(code, 0, "nobody could {what}: {err}");
    }
    // Everything is still there.
    assert_eq!(walk(dir), all, "the pins are unchanged");
    assert!(Maps::open_pinned(dir).is_ok());
}

#[test]
fn hostile_http_requests_change_nothing_and_the_agent_listens_on_loopback() {
    let node = Node::standalone("xh").unwrap();
    let _agent = node.start_agent("agent.log").unwrap();
    let PodPair {
        pa,
        pb,
        ha,
        hb,
        b_ip,
        ..
    } = node.pair_attached("xdp", Duration::from_secs(2)).unwrap();
    // No `listen` in the config: the node's loopback alone.
    let listening = node.net.node.exec(&["ss", "-Hltn"]).unwrap();
    let addrs: Vec<&str> = listening
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3))
        .collect();
    assert_eq!(addrs, vec![LISTEN], "listening sockets: {listening}");

    let before = node.state(&[&ha, &hb]).unwrap();
    let mut asked = 0;
    for path in ["/metrics", "/healthz", "/readyz"] {
        for method in ["POST", "PUT", "DELETE", "PATCH"] {
            let req = format!(
                "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nConnection: close\r\n\r\nmode"
            );
            let (code, _) = http_raw(&node.net.node, LISTEN, req.into_bytes()).unwrap();
            assert_eq!(code, 405, "{method} {path}");
            asked += 1;
        }
        assert_eq!(
            http_get(&node.net.node, LISTEN, path).unwrap().0,
            200,
            "GET {path}"
        );
    }
    for path in [
        "/",
        "/metrics/../debug",
        "/pods/a?xdp-mode=off",
        "/admin",
        "/%00",
    ] {
        let (code, _) = http_get(&node.net.node, LISTEN, path).unwrap();
        assert!(code == 404 || code == 400, "GET {path}: {code}");
        asked += 1;
    }
    // Garbage and an oversized header: refused or dropped, never served.
    let _ = http_raw(&node.net.node, LISTEN, vec![0xff; 4096]);
    let big = format!(
        "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
        "a".repeat(1 << 20)
    );
    let _ = http_raw(&node.net.node, LISTEN, big.into_bytes());
    // Many scrapes in a row.
    for _ in 0..50 {
        assert_eq!(http_get(&node.net.node, LISTEN, "/metrics").unwrap().0, 200);
    }
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(
        node.state(&[&ha, &hb]).unwrap(),
        before,
        "{asked} hostile requests changed the node"
    );
    assert_eq!(http_get(&node.net.node, LISTEN, "/readyz").unwrap().0, 200);
    ping(&pa, b_ip, 2).unwrap();
    node.del_pod("a", &pa).unwrap();
    node.del_pod("b", &pb).unwrap();
}
