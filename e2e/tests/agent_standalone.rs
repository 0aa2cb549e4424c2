//! The `xdpcni-agent` in standalone mode (no Kubernetes): pods made by the
//! real CNI plugin, policies from a pods file, modes checked over netlink,
//! traffic and counters, /metrics parsed as Prometheus text, and an agent
//! killed with SIGKILL and restarted while traffic flows. (Killed mid-switch:
//! crash.rs; hostile HTTP requests: hostile.rs.)
//! Needs root, bpffs at /sys/fs/bpf and containernetworking-plugins.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{
    net::IpAddr,
    path::PathBuf,
    time::{Duration, Instant},
};
use xdpcni_ebpf::testing::RawMaps;

use serde_json::{json, Value};
use xdpcni_e2e::{
    cni::{agent_binary, http_get, result_ips, Call, NodeProcess},
    in_netns,
    netns::Netns,
    node::Node,
    node::PodPair as Pair,
    traffic::{ping, tcp_transfer, BackgroundPing},
};
use xdpcni_ebpf::{abi::EP_KERNEL_ONLY, Datapath, Maps};

/// The churn test measures latency drift: it runs alone (write), the other
/// tests of this file share the machine among themselves (read).
static MACHINE: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn shared_machine() -> std::sync::RwLockReadGuard<'static, ()> {
    MACHINE
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The agent's default address (its config here names none).
const LISTEN: &str = xdpcni_agent::config::DEFAULT_LISTEN;

/// The node of these tests ([`Node::standalone`]).
fn new_node() -> Node {
    Node::standalone("xs").unwrap()
}

/// What these tests do on their node, failing the test on an error.
trait Standalone {
    fn wait_mode(&self, host: &str, want: &str, within: Duration) -> Duration;
    fn ready(&self) -> PathBuf;
}

impl Standalone for Node {
    /// Waits until `host` shows `want` (`xdp`, `xdpgeneric`, `tc` or `none`).
    fn wait_mode(&self, host: &str, want: &str, within: Duration) -> Duration {
        let start = Instant::now();
        loop {
            let now = xdpcni_e2e::agent::mode_of(&self.net.node, host).unwrap();
            if now == want {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < within,
                "{host}: {now} after {within:?}, wanted {want}; agent log: {}",
                self.log("agent.log")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The ready file the agent writes and the CNI's STATUS requires.
    fn ready(&self) -> PathBuf {
        self.config.ready_file.clone().unwrap()
    }
}

fn host(res: &Value) -> String {
    res["interfaces"][0]["name"].as_str().unwrap().to_string()
}

fn ipv4_of(res: &Value) -> IpAddr {
    *result_ips(res).iter().find(|i| i.is_ipv4()).unwrap()
}

fn metrics(node: &Node) -> prometheus_parse::Scrape {
    let (code, body) = http_get(&node.net.node, LISTEN, "/metrics")
        .unwrap_or_else(|e| panic!("GET /metrics: {e}; agent log: {}", node.log("agent.log")));
    assert_eq!(code, 200);
    prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).unwrap()
}

fn sample(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape.samples.iter().find_map(|s| {
        let matches = s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v));
        match (matches, &s.value) {
            (true, prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Gauge(v)) => {
                Some(*v)
            }
            (true, prometheus_parse::Value::Untyped(v)) => Some(*v),
            _ => None,
        }
    })
}

/// Every metric name the chart's Grafana dashboard queries is one a live
/// agent exports (a sample name, or a family of its `# TYPE` lines with
/// the suffix its type gives samples).
#[test]
fn dashboard_queries_name_only_metrics_the_agent_exports() {
    let _shared = shared_machine();
    let node = new_node();
    let _agent = node.start_agent("agent.log").unwrap();
    let (code, body) = http_get(&node.net.node, LISTEN, "/metrics").unwrap();
    assert_eq!(code, 200);
    let mut exported = std::collections::BTreeSet::new();
    for l in body.lines() {
        if let Some(rest) = l.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let (name, kind) = (it.next().unwrap(), it.next().unwrap());
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "histogram" => &["_bucket", "_count", "_sum"],
                _ => &[""],
            };
            for s in suffixes {
                exported.insert(format!("{name}{s}"));
            }
        }
    }
    let dash: Value = serde_json::from_str(include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../charts/xdpcni/dashboards/xdpcni.json"
    )))
    .unwrap();
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            exprs.push(t["expr"].as_str().unwrap().to_string());
        }
    }
    for v in dash["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"].as_str() {
            exprs.push(q.to_string());
        }
    }
    assert!(exprs.len() >= 15, "{exprs:?}");
    let mut used = std::collections::BTreeSet::new();
    for e in &exprs {
        let b = e.as_bytes();
        let mut i = 0;
        while let Some(at) = e[i..].find("xdpcni_") {
            let start = i + at;
            let end = start
                + e[start..]
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(e.len() - start);
            // A metric name, not the tail of another identifier.
            if start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_') {
                used.insert(e[start..end].to_string());
            }
            i = end;
        }
    }
    let unknown: Vec<_> = used.iter().filter(|u| !exported.contains(*u)).collect();
    assert!(
        unknown.is_empty(),
        "the dashboard queries metrics the agent does not export: {unknown:?}\nexported: {exported:?}"
    );
    // The panels the operator needs are there.
    for want in [
        "xdpcni_forward_packets_total",
        "xdpcni_kernel_packets_total",
        "xdpcni_drop_packets_total",
        "xdpcni_attach_mode",
        "xdpcni_pod_kernel_only",
        "xdpcni_reconcile_errors_total",
        "xdpcni_reconcile_duration_seconds_bucket",
        "xdpcni_map_entries",
        "xdpcni_map_capacity",
    ] {
        assert!(used.contains(want), "no panel queries {want}");
    }
    eprintln!(
        "dashboard: {} queries, {} metrics, all exported",
        exprs.len(),
        used.len()
    );
}

/// A sample's value (counters parse as counters or untyped).
fn value(v: &prometheus_parse::Value) -> f64 {
    match v {
        prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Untyped(v) => *v,
        _ => 0.0,
    }
}

/// Each family's total over every pod and label.
fn family_sum(scrape: &prometheus_parse::Scrape, family: &str) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == family)
        .map(|s| value(&s.value))
        .sum()
}

/// N frames in, N counted: each family of the per-pod counters counts each
/// frame the pods send exactly once, summed over every pod and label as a
/// dashboard would (`sum(rate(...))`), and the families that count a
/// delivery again (the receive side, the cpumap's second stage) are their
/// own, so no query adds them to the sender's count by accident.
#[test]
fn metrics_count_n_frames_sent_as_n_in_every_family() {
    let _shared = shared_machine();
    const N: usize = 1000;
    let node = new_node();
    let agent = node.start_agent("agent.log").unwrap();
    let Pair {
        pa,
        ra,
        pb,
        hb,
        b_ip,
        ..
    } = node.pair_attached("xdp", Duration::from_secs(2)).unwrap();
    node.wait_mode(&hb, "xdp", Duration::from_secs(2));
    let a_ip = ipv4_of(&ra);
    let (IpAddr::V4(a4), IpAddr::V4(b4)) = (a_ip, b_ip) else {
        unreachable!()
    };
    // b listens, so the frames end in a socket (no ICMP errors back).
    let _sink = in_netns(&pb, || Ok(std::net::UdpSocket::bind("0.0.0.0:9")?)).unwrap();
    let mac = |r: &Value, i: usize| {
        xdpcni_e2e::netns::parse_mac(r["interfaces"][i]["mac"].as_str().unwrap()).unwrap()
    };
    let frames = |src: std::net::Ipv4Addr, dst: std::net::Ipv4Addr| -> Vec<Vec<u8>> {
        (0..N)
            .map(|i| {
                let udp = xdpcni_e2e::packet::udp(4000 + (i % 64) as u16, 9, &[0x5a; 32]);
                xdpcni_e2e::packet::eth(
                    mac(&ra, 0),
                    mac(&ra, 1),
                    0x0800,
                    &xdpcni_e2e::packet::ipv4(src, dst, 64, 17, &udp),
                )
            })
            .collect()
    };
    let families = [
        "xdpcni_forward_packets_total",
        "xdpcni_kernel_packets_total",
        "xdpcni_drop_packets_total",
        "xdpcni_received_packets_total",
        "xdpcni_cpumap_stage_packets_total",
    ];
    // ARP, ND and multicast the pods' kernels send on their own are
    // counted too: left out of the kernel family's comparison.
    let noise = |s: &prometheus_parse::Scrape| -> f64 {
        ["pass_not_ip", "pass_nd", "pass_multicast"]
            .iter()
            .map(|v| {
                s.samples
                    .iter()
                    .filter(|x| {
                        x.metric == "xdpcni_kernel_packets_total"
                            && x.labels.get("verdict") == Some(*v)
                    })
                    .map(|x| value(&x.value))
                    .sum::<f64>()
            })
            .sum()
    };
    // Sends `frames`, returns each family's growth (kernel without noise).
    let delta = |frames: Vec<Vec<u8>>| -> Vec<f64> {
        let before = metrics(&node);
        assert_eq!(
            xdpcni_e2e::traffic::send_frames(&pa, "eth0", &frames).unwrap(),
            N
        );
        std::thread::sleep(Duration::from_millis(300));
        let after = metrics(&node);
        families
            .iter()
            .map(|f| {
                let d = family_sum(&after, f) - family_sum(&before, f);
                if f.contains("kernel") {
                    d - (noise(&after) - noise(&before))
                } else {
                    d
                }
            })
            .collect()
    };
    let n = N as f64;
    // a -> b over the devmap: one forward (a), one receive (b).
    assert_eq!(delta(frames(a4, b4)), [n, 0.0, 0.0, n, 0.0], "devmap");
    // To no pod: the kernel's, once.
    assert_eq!(
        delta(frames(a4, "192.0.2.1".parse().unwrap())),
        [0.0, n, 0.0, 0.0, 0.0],
        "kernel"
    );
    // Spoofed source: dropped, once.
    assert_eq!(
        delta(frames("10.200.0.9".parse().unwrap(), b4)),
        [0.0, 0.0, n, 0.0, 0.0],
        "drop"
    );
    // b behind a cpumap: still one forward; the second stage and the
    // receive side in their own families.
    node.set_pods(
        &json!({ "default/b": { "xdpcni.io/redirect": "cpumap", "xdpcni.io/cpus": "0" } }),
    )
    .unwrap();
    let start = Instant::now();
    while Maps::open_pinned(node.pins.path())
        .unwrap()
        .endpoint(b_ip)
        .unwrap()
        .is_none_or(|e| e.redirect != 1)
    {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "b not on the cpumap"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(delta(frames(a4, b4)), [n, 0.0, 0.0, n, n], "cpumap");
    let s = metrics(&node);
    assert_eq!(
        sample(
            &s,
            "xdpcni_forward_packets_total",
            &[("pod", "a"), ("verdict", "redirect_cpumap")]
        ),
        Some(n)
    );
    assert_eq!(
        sample(
            &s,
            "xdpcni_received_packets_total",
            &[("pod", "b"), ("verdict", "rx_fastpath")]
        ),
        Some(2.0 * n),
        "received by b over both redirects"
    );
    drop(agent);
}

#[test]
fn pods_file_policies_switch_modes_without_losing_packets() {
    let _shared = shared_machine();
    let node = new_node();
    let agent = node.start_agent("agent.log").unwrap();
    assert!(
        node.ready().exists(),
        "the agent writes the CNI's ready file"
    );
    let status = node
        .net
        .call(&Call::new("STATUS", "", None), &json!({}))
        .unwrap();
    assert_eq!(
        status.status, 0,
        "STATUS with the agent ready: {:?}",
        status.json
    );

    let Pair {
        pa,
        ra,
        pb,
        rb,
        ha,
        b_ip,
        ..
    } = node.pair_attached("xdp", Duration::from_secs(2)).unwrap();
    ping(&pa, b_ip, 2).unwrap();

    // Switch a: generic, tc, off, tc, native, tc, generic, native, while a
    // pings b every 10 ms: every switch into and out of tc, from each mode.
    let pinger = BackgroundPing::start(&pa, b_ip, 1000).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    for (mode, want) in [
        ("generic", "xdpgeneric"),
        ("tc", "tc"),
        ("off", "none"),
        ("tc", "tc"),
        ("native", "xdp"),
        ("tc", "tc"),
        ("generic", "xdpgeneric"),
        ("native", "xdp"),
    ] {
        node.set_pods(&json!({ "default/a": { "xdpcni.io/xdp-mode": mode } }))
            .unwrap();
        let took = node.wait_mode(&ha, want, Duration::from_secs(2));
        eprintln!("switched a to {mode} in {took:?}");
        // The offloads follow the mode.
        std::thread::sleep(Duration::from_millis(300));
        // The "tcp-segmentation-offload" group: every tx-tcp*-segmentation
        // feature (6.18's tx-tcp-accecn-segmentation included) follows.
        let tso = pa.offload("eth0", "tcp-segmentation-offload").unwrap();
        let csum = pa.offload("eth0", "tx-checksumming").unwrap();
        match mode {
            // Hybrid: TSO kept, super-packets passed to the kernel.
            "generic" | "tc" => assert_eq!((tso.as_str(), csum.as_str()), ("on", "on")),
            "off" => assert_eq!((tso.as_str(), csum.as_str()), ("on", "on")),
            _ => assert_eq!(csum, "off"),
        }
        if mode == "off" {
            let maps = Maps::open_pinned(node.pins.path()).unwrap();
            let ep = maps.endpoint(ipv4_of(&ra)).unwrap().unwrap();
            assert_eq!(
                ep.flags & EP_KERNEL_ONLY,
                EP_KERNEL_ONLY,
                "off pods are kernel-only"
            );
        }
        tcp_transfer(&pa, &pb, b_ip, 1 << 20).unwrap();
    }
    assert_eq!(
        pinger.lost().unwrap(),
        0,
        "no ping lost across eight mode switches"
    );

    // A bad value: an Event in Kubernetes, here the log and a counter; the
    // pod keeps working on the node default (native).
    node.set_pods(
        &json!({ "default/a": { "xdpcni.io/xdp-mode": "turbo", "xdpcni.io/cpus": "0-99" } }),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(600));
    node.wait_mode(&ha, "xdp", Duration::from_secs(2));
    ping(&pa, b_ip, 2).unwrap();
    let log = node.log("agent.log");
    assert!(log.contains("turbo") && log.contains("fallback"), "{log}");

    // cpumap for b: frames to b go through a CPU of the list.
    node.set_pods(
        &json!({ "default/b": { "xdpcni.io/redirect": "cpumap", "xdpcni.io/cpus": "0" } }),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(600));
    let maps = Maps::open_pinned(node.pins.path()).unwrap();
    let ep = maps.endpoint(b_ip).unwrap().unwrap();
    assert_eq!((ep.redirect, ep.cpu_mask), (1, 1));
    ping(&pa, b_ip, 3).unwrap();

    // /metrics through a Prometheus text parser (it reflects the last
    // reconcile pass, at most intervalMs old).
    std::thread::sleep(Duration::from_millis(500));
    let scrape = metrics(&node);
    let redirected = sample(
        &scrape,
        "xdpcni_forward_packets_total",
        &[("pod", "a"), ("verdict", "redirect_devmap")],
    )
    .expect("per-pod redirect counter");
    assert!(redirected > 0.0);
    let via_cpumap = sample(
        &scrape,
        "xdpcni_forward_packets_total",
        &[("pod", "a"), ("verdict", "redirect_cpumap")],
    );
    assert!(
        via_cpumap.unwrap_or(0.0) >= 3.0,
        "{:#?}",
        scrape
            .samples
            .iter()
            .filter(|s| s.labels.get("pod") == Some("a"))
            .map(|s| (s.labels.get("verdict"), s.value.clone()))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        sample(
            &scrape,
            "xdpcni_attach_mode",
            &[("pod", "a"), ("mode", "native")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &scrape,
            "xdpcni_attach_mode",
            &[("pod", "a"), ("mode", "off")]
        ),
        Some(0.0)
    );
    assert!(sample(&scrape, "xdpcni_policy_problems_total", &[]).unwrap() >= 2.0);
    assert_eq!(sample(&scrape, "xdpcni_ready", &[]), Some(1.0));
    assert!(sample(&scrape, "xdpcni_reconcile_duration_seconds_count", &[]).unwrap() > 1.0);
    assert_eq!(http_get(&node.net.node, LISTEN, "/healthz").unwrap().0, 200);

    // An endpoint whose veth vanished without a DEL is collected: at the
    // next change of the records (here a new pod; otherwise within the
    // node work's 30 s resync; an idle pass reads no map).
    let mut maps = Maps::open_pinned(node.pins.path()).unwrap();
    let ghost: IpAddr = "10.78.0.250".parse().unwrap();
    let mut info = maps.endpoint(b_ip).unwrap().unwrap();
    info.ifindex = 999_999;
    maps.raw_upsert_endpoint(ghost, &info).unwrap();
    let (pc, _) = node.add_pod("default", "c").unwrap();
    let start = Instant::now();
    while maps.endpoint(ghost).unwrap().is_some() {
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "ghost endpoint not collected"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        maps.endpoint(b_ip).unwrap().is_some(),
        "live endpoints stay"
    );
    node.del_pod("c", &pc).unwrap();

    // SIGTERM: the agent exits cleanly and leaves the datapath attached.
    assert_eq!(agent.stop(libc::SIGTERM).unwrap(), Some(0));
    node.wait_mode(&ha, "xdp", Duration::from_secs(1));
    ping(&pa, b_ip, 2).unwrap();
    // uninstall: every link detached, every pin gone; kernel routing stays.
    let un = NodeProcess::spawn(
        &node.net.node,
        &agent_binary().unwrap(),
        &["uninstall", "--pin-dir", node.pins.path().to_str().unwrap()],
        &node.net.dir.path().join("uninstall.log"),
    )
    .unwrap();
    assert_eq!(un.wait().unwrap(), Some(0), "{}", node.log("uninstall.log"));
    node.wait_mode(&ha, "none", Duration::from_secs(1));
    node.wait_mode(&host(&rb), "none", Duration::from_secs(1));
    assert!(!node.pins.path().exists(), "pins removed");
    ping(&pa, b_ip, 2).unwrap();
    node.del_pod("a", &pa).unwrap();
    node.del_pod("b", &pb).unwrap();
}

#[test]
fn a_killed_agent_leaves_traffic_flowing_and_comes_back_unchanged() {
    let _shared = shared_machine();
    let node = new_node();
    let agent = node.start_agent("agent1.log").unwrap();
    let Pair {
        pa,
        pb,
        ha,
        hb,
        b_ip,
        ..
    } = node.pair_attached("xdp", Duration::from_secs(2)).unwrap();
    let ids = |h: &str| node.net.node.xdp_attached(h).unwrap().unwrap().1;
    let before = (ids(&ha), ids(&hb));

    let pinger = BackgroundPing::start(&pa, b_ip, 400).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        agent.stop(libc::SIGKILL).unwrap(),
        None,
        "killed by the signal"
    );
    // Down: traffic flows on the pinned datapath; a new pod gets its
    // network on kernel routing (its namespace has no policies: the gate
    // the agent left lets it through without a hold).
    let (pc, rc) = node.add_pod("default", "c").unwrap();
    assert_eq!(node.net.node.xdp_attached(&host(&rc)).unwrap(), None);
    ping(&pc, b_ip, 2).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // Back: nothing that was right changes; the new pod gets its mode.
    let _agent = node.start_agent("agent2.log").unwrap();
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(
        pinger.lost().unwrap(),
        0,
        "no ping lost while the agent was killed and restarted"
    );
    assert_eq!((ids(&ha), ids(&hb)), before, "program ids unchanged");
    node.wait_mode(&host(&rc), "xdp", Duration::from_secs(2));
    let log = node.log("agent2.log");
    let applied: Vec<&str> = log.lines().filter(|l| l.contains("applied")).collect();
    assert!(
        applied.iter().all(|l| l.contains("pod=c")),
        "the restarted agent changed nothing but the new pod: {log}"
    );
    for (n, p) in [("a", &pa), ("b", &pb), ("c", &pc)] {
        node.del_pod(n, p).unwrap();
    }
}

#[test]
fn churn_1000_add_del_cycles_8_parallel_leak_nothing_and_do_not_drift() {
    let _alone = MACHINE
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cycles: usize = xdpcni_e2e::env_or("XDPCNI_CHURN_CYCLES", 1000);
    const WORKERS: usize = 8;
    let node = new_node();
    let agent = node.start_agent("agent.log").unwrap();
    let pods: Vec<Netns> = (0..WORKERS).map(|_| Netns::new("xc").unwrap()).collect();
    // One cycle: ADD (timed, as the runtime waits for it), a ping to the
    // node through the new veth, DEL.
    let cycle = |worker: usize, i: usize| -> Duration {
        let pod = &pods[worker];
        let path = pod.path();
        let id = format!("churn-{worker}-{i}");
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=churn;K8S_POD_NAME={id}");
        let mut add = Call::new("ADD", &id, Some(&path));
        add.args = &args;
        let start = Instant::now();
        let out = node.net.call(&add, &json!({})).unwrap();
        let took = start.elapsed();
        assert_eq!(out.status, 0, "ADD {id}: {:?}", out.json);
        ping(pod, "10.99.0.1".parse().unwrap(), 1).unwrap();
        let d = node
            .net
            .call(&Call::new("DEL", &id, Some(&path)), &json!({}))
            .unwrap();
        assert_eq!(d.status, 0, "DEL {id}: {:?}", d.json);
        took
    };
    // Runs cycles [from, to) on WORKERS threads; the ADD latencies.
    let run = |from: usize, to: usize| -> Vec<Duration> {
        let next = std::sync::atomic::AtomicUsize::new(from);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..WORKERS)
                .map(|w| {
                    let (next, cycle) = (&next, &cycle);
                    s.spawn(move || {
                        let mut lat = Vec::new();
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if i >= to {
                                return lat;
                            }
                            lat.push(cycle(w, i));
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        })
    };
    let window = (cycles / 10).max(WORKERS);
    // Warm-up: the first window of cycles, then the agent's baseline.
    let mut first = run(0, window);
    std::thread::sleep(Duration::from_millis(600));
    let warm = rss_and_fds(agent.pid());
    let started = Instant::now();
    let _middle = run(window, cycles - window);
    let mut last = run(cycles - window, cycles);
    let total = started.elapsed();
    std::thread::sleep(Duration::from_millis(600));
    let end = rss_and_fds(agent.pid());
    let (p50a, p99a) = (percentile(&mut first, 50), percentile(&mut first, 99));
    let (p50b, p99b) = (percentile(&mut last, 50), percentile(&mut last, 99));
    eprintln!(
        "churn: {cycles} ADD/DEL cycles, {WORKERS} in parallel, {:.1} s after warm-up; \
         ADD p50/p99 first {window}: {p50a:.1}/{p99a:.1} ms, last {window}: {p50b:.1}/{p99b:.1} ms; \
         agent RSS {} -> {} kB, fds {} -> {}",
        total.as_secs_f64(),
        warm.0,
        end.0,
        warm.1,
        end.1
    );
    // Nothing leaked.
    assert_eq!(
        node.net.host_veths().unwrap(),
        Vec::<String>::new(),
        "veths"
    );
    assert_eq!(node.net.allocated_ips(), Vec::<IpAddr>::new(), "IPs");
    assert_eq!(node.net.records(), 0, "records");
    let maps = Maps::open_pinned(node.pins.path()).unwrap();
    assert_eq!(maps.endpoints().unwrap().len(), 0, "endpoints");
    assert_eq!(maps.tx_port_list().unwrap(), Vec::<u32>::new(), "devmap");
    assert_eq!(
        maps.slot_owner_list().unwrap(),
        Vec::<(u32, u32)>::new(),
        "slots"
    );
    let links = std::fs::read_dir(node.pins.path().join("links"))
        .unwrap()
        .count();
    assert_eq!(links, 0, "link pins");
    for p in &pods {
        assert!(p.link_json("eth0").is_err(), "eth0 left in a pod");
    }
    // The agent did not grow.
    assert!(
        end.0 * 10 <= warm.0 * 11,
        "agent RSS grew more than 10%: {} -> {} kB",
        warm.0,
        end.0
    );
    assert!(
        end.1 <= warm.1 + warm.1 / 10,
        "agent fds grew: {warm:?} -> {end:?}"
    );
    // No drift: the last ADDs are not much slower than the first.
    assert!(
        p50b <= p50a * 1.5 + 5.0,
        "ADD p50 drifted: {p50a:.1} -> {p50b:.1} ms"
    );
    let log = node.log("agent.log");
    assert!(!log.contains("ERROR"), "agent errors: {log}");
    // Normal DELs raise no alarm: no WARN line (in Kubernetes, each would
    // be a false Event on the pod).
    let warns: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
    assert!(
        warns.is_empty(),
        "{} WARN lines from {cycles} normal ADD/DEL cycles:\n{}",
        warns.len(),
        warns.join("\n")
    );
}

#[test]
fn vanish_room_in_the_endpoint_map_gives_kernel_routing_then_recovers() {
    let _shared = shared_machine();
    let node = new_node();
    let _agent = node.start_agent("agent.log").unwrap();
    let (pa, ra) = node.add_pod("default", "a").unwrap();
    let (hb_ns, rb) = node.add_pod("default", "b").unwrap();
    let (a_ip, b_ip) = (ipv4_of(&ra), ipv4_of(&rb));
    node.wait_mode(&host(&rb), "xdp", Duration::from_secs(2));
    // Fill the IPv4 endpoint map to its capacity with records on a's veth
    // (addresses no pod has: 100.64.0.0/10), in the hash alone: its
    // capacity is the subject, and each cache slot written costs a grace
    // period.
    let mut maps = Maps::open_pinned(node.pins.path()).unwrap();
    let info = maps.endpoint(a_ip).unwrap().unwrap();
    let mut filler = Vec::new();
    let capacity = xdpcni_ebpf::abi::c_layout::XDPCNI_MAX_ENDPOINTS as usize;
    let have = maps
        .endpoints()
        .unwrap()
        .iter()
        .filter(|(ip, _)| ip.is_ipv4())
        .count();
    for i in 0..(capacity - have) as u32 {
        let ip = IpAddr::V4(std::net::Ipv4Addr::from(0x6440_0000 + i));
        maps.raw_write_hash_only(ip, &info).unwrap();
        filler.push(ip);
    }
    // A new pod: ADD succeeds (it writes no endpoint record: the agent
    // does), and the agent leaves it on kernel routing, saying why below.
    let (pc, rc) = node.add_pod("default", "c").unwrap();
    let (hc, c_ip) = (host(&rc), ipv4_of(&rc));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        node.net.node.xdp_attached(&hc).unwrap(),
        None,
        "no XDP on c"
    );
    assert!(maps.endpoint(c_ip).unwrap().is_none());
    ping(&pc, b_ip, 2).unwrap();
    ping(&hb_ns, c_ip, 2).unwrap();
    tcp_transfer(&pa, &pc, c_ip, 1 << 20).unwrap();
    // The agent says so too: log and metric.
    let start = Instant::now();
    loop {
        let full = sample(&metrics(&node), "xdpcni_map_full_pods", &[]);
        if full == Some(1.0) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "xdpcni_map_full_pods {full:?}; {}",
            node.log("agent.log")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        node.log("agent.log").contains("is full"),
        "{}",
        node.log("agent.log")
    );
    // Room again: c gets its XDP mode and its records without a new ADD.
    for ip in &filler {
        maps.raw_remove_endpoint(*ip).unwrap();
    }
    let took = node.wait_mode(&hc, "xdp", Duration::from_secs(3));
    eprintln!("c back on XDP {took:?} after the map had room");
    assert!(maps.endpoint(c_ip).unwrap().is_some());
    ping(&pc, b_ip, 2).unwrap();
    let start = Instant::now();
    while sample(&metrics(&node), "xdpcni_map_full_pods", &[]) != Some(0.0) {
        assert!(start.elapsed() < Duration::from_secs(3), "gauge stays up");
        std::thread::sleep(Duration::from_millis(100));
    }
    node.del_pod("a", &pa).unwrap();
    node.del_pod("b", &hb_ns).unwrap();
    node.del_pod("c", &pc).unwrap();
}

/// Nothing of pod `res`'s attachment is left in the datapath.
fn assert_datapath_forgot(node: &Node, res: &Value, what: &str) {
    let maps = Maps::open_pinned(node.pins.path()).unwrap();
    for ip in result_ips(res) {
        assert!(
            maps.endpoint(ip).unwrap().is_none(),
            "{what}: endpoint {ip}"
        );
    }
}

#[test]
fn vanish_host_veth_or_pod_netns_deleted_before_del() {
    let _shared = shared_machine();
    let node = new_node();
    let _agent = node.start_agent("agent.log").unwrap();
    let (pa, ra) = node.add_pod("default", "a").unwrap();
    let (pb, rb) = node.add_pod("default", "b").unwrap();
    let (pc, rc) = node.add_pod("default", "c").unwrap();
    let (ha, hb) = (host(&ra), host(&rb));
    node.wait_mode(&ha, "xdp", Duration::from_secs(2));
    let a_index = node.net.node.ifindex(&ha).unwrap();
    let b_index = node.net.node.ifindex(&hb).unwrap();
    let links = || -> Vec<String> {
        std::fs::read_dir(node.pins.path().join("links"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    };

    // a's host veth deleted behind everyone's back (the pod loses eth0).
    node.net.node.ip(&["link", "del", &ha]).unwrap();
    // b's netns deleted before its DEL (the runtime lost it).
    let b_path = pb.path();
    drop(pb);
    assert!(!b_path.exists());
    // The agent collects their link pins; the datapath keeps working for c.
    let start = Instant::now();
    while links()
        .iter()
        .any(|l| l.starts_with(&format!("{a_index}_")) || l.starts_with(&format!("{b_index}_")))
    {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "link pins of deleted veths kept: {:?}",
            links()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    ping(&pc, "10.99.0.1".parse().unwrap(), 2).unwrap();
    // CHECK says what is wrong; DEL then cleans up and succeeds, twice.
    let a_path = pa.path();
    let check = Call::new("CHECK", "a", Some(&a_path));
    let out = node.net.call(&check, &json!({ "prevResult": ra })).unwrap();
    assert_ne!(out.status, 0, "CHECK of a pod without its veth");
    assert!(
        out.json["msg"].as_str().unwrap().contains("eth0"),
        "{:?}",
        out.json
    );
    for _ in 0..2 {
        node.del_pod("a", &pa).unwrap();
        let d = node
            .net
            .call(&Call::new("DEL", "b", Some(&b_path)), &json!({}))
            .unwrap();
        assert_eq!(d.status, 0, "DEL with the netns gone: {:?}", d.json);
    }
    assert_datapath_forgot(&node, &ra, "a");
    assert_datapath_forgot(&node, &rb, "b");
    let left: Vec<IpAddr> = node.net.allocated_ips();
    assert_eq!(left.len(), 2, "only c's addresses stay allocated: {left:?}");
    assert_eq!(node.net.records(), 1, "only c's record");
    // And a comes back in the same netns.
    let (_, ra2) = {
        let args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=a";
        let path = pa.path();
        let mut call = Call::new("ADD", "a", Some(&path));
        call.args = args;
        let out = node.net.call(&call, &json!({})).unwrap();
        assert_eq!(out.status, 0, "{:?}", out.json);
        ((), out.json)
    };
    node.wait_mode(&host(&ra2), "xdp", Duration::from_secs(2));
    ping(&pa, ipv4_of(&rc), 2).unwrap();
    let log = node.log("agent.log");
    assert!(log.contains("deleted outside the CNI"), "said once: {log}");
    assert!(
        !log.contains("ERROR") && !log.contains("apply failed"),
        "a vanished veth is not retried as a failure: {log}"
    );
    node.del_pod("a", &pa).unwrap();
    node.del_pod("c", &pc).unwrap();
}

#[test]
fn vanish_pins_removed_by_hand_are_recreated_without_stopping_traffic() {
    let _shared = shared_machine();
    let node = new_node();
    let _agent = node.start_agent("agent.log").unwrap();
    let Pair {
        pa,
        pb,
        ha,
        hb,
        b_ip,
        ..
    } = node.pair_attached("xdp", Duration::from_secs(2)).unwrap();
    let pinger = BackgroundPing::start(&pa, b_ip, 300).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // Someone cleans up /sys/fs/bpf.
    std::fs::remove_dir_all(node.pins.path()).unwrap();
    let start = Instant::now();
    while !Datapath::missing_pins(node.pins.path()).is_empty()
        || std::fs::read_dir(node.pins.path().join("links"))
            .map(|d| d.count())
            .unwrap_or(0)
            < 2
    {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "not re-created: missing {:?}; {}",
            Datapath::missing_pins(node.pins.path()),
            node.log("agent.log")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "pins re-created and both pods re-attached {:?} after the removal",
        start.elapsed()
    );
    let stats = pinger.stats().unwrap();
    eprintln!("a -> b ping every 10 ms across the removal: {stats:?}");
    assert!(stats.lost <= 3, "traffic stopped: {stats:?}");
    node.wait_mode(&ha, "xdp", Duration::from_secs(2));
    node.wait_mode(&hb, "xdp", Duration::from_secs(2));
    // The fast path is back: a's pings to b are redirected again.
    let maps = Maps::open_pinned(node.pins.path()).unwrap();
    assert!(maps.endpoint(b_ip).unwrap().is_some(), "b's record is back");
    ping(&pa, b_ip, 3).unwrap();
    let a_index = node.net.node.ifindex(&ha).unwrap();
    let redirected = maps.counters(a_index).unwrap().forwarded();
    assert!(redirected >= 3, "redirected {redirected}");
    assert_eq!(
        sample(&metrics(&node), "xdpcni_datapath_reloads_total", &[]),
        Some(1.0)
    );
    node.del_pod("a", &pa).unwrap();
    node.del_pod("b", &pb).unwrap();
}

#[test]
fn vanish_pin_dir_not_on_bpffs_is_refused_clearly_then_works_on_bpffs() {
    let _shared = shared_machine();
    let mut node = new_node();
    // The pin directory on an ordinary file system (the test's /tmp).
    let not_bpffs = node.net.dir.path().join("pins");
    let good_pins = std::mem::replace(&mut node.config.pin_dir, not_bpffs.clone());
    let agent = node
        .spawn_agent(&agent_binary().unwrap(), "bad.log", &[])
        .unwrap();
    let start = Instant::now();
    let code = agent.wait().unwrap();
    assert!(start.elapsed() < Duration::from_secs(5), "it fails fast");
    let log = node.log("bad.log");
    assert_ne!(code, Some(0), "{log}");
    assert!(
        log.contains("bpffs") && log.contains(&not_bpffs.display().to_string()),
        "the error names the path and the problem: {log}"
    );
    assert!(
        !node.ready().exists(),
        "not ready: STATUS stays unavailable"
    );
    // A pod meanwhile: refused with "try again" (no datapath could hold it
    // for its policies), leaving nothing.
    let pod = Netns::new("xp").unwrap();
    let args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=a";
    let path = pod.path();
    let mut call = Call::new("ADD", "a", Some(&path));
    call.args = args;
    let out = node.net.call(&call, &json!({})).unwrap();
    assert_eq!(out.code(), Some(11), "{:?}", out.json);
    assert_eq!(node.net.records(), 0);
    // The cause gone (the pin directory on bpffs): the agent starts, the
    // runtime's retry succeeds, and the pod gets the node default.
    node.config.pin_dir = good_pins;
    let _agent = node.start_agent("agent.log").unwrap();
    let out = node.net.call(&call, &json!({})).unwrap();
    assert_eq!(out.status, 0, "{:?}", out.json);
    node.wait_mode(&host(&out.json), "xdp", Duration::from_secs(3));
    node.del_pod("a", &pod).unwrap();
}

#[test]
fn vanish_state_dir_unwritable_fails_add_cleanly_then_recovers() {
    let _shared = shared_machine();
    let node = new_node();
    let _agent = node.start_agent("agent.log").unwrap();
    // The state directory's path taken by a file: no record can be written.
    let state = node.net.dir.path().join("state");
    let _ = std::fs::remove_dir_all(&state);
    std::fs::write(&state, b"not a directory").unwrap();
    let pod = Netns::new("xp").unwrap();
    let path = pod.path();
    let out = node
        .net
        .call(&Call::new("ADD", "s1", Some(&path)), &json!({}))
        .unwrap();
    assert_ne!(out.status, 0, "{:?}", out.json);
    let msg = out.json["msg"].as_str().unwrap();
    assert!(
        msg.contains(&state.display().to_string()),
        "names the path: {msg}"
    );
    assert_eq!(out.json["code"], 5, "an I/O error: {:?}", out.json);
    // Nothing half-made: no veth, no address, no endpoint.
    assert_eq!(node.net.host_veths().unwrap(), Vec::<String>::new());
    assert_eq!(node.net.allocated_ips(), Vec::<IpAddr>::new());
    assert!(pod.link_json("eth0").is_err());
    let maps = Maps::open_pinned(node.pins.path()).unwrap();
    assert_eq!(maps.endpoints().unwrap().len(), 0);
    // DEL still succeeds (the runtime retries it).
    let d = node
        .net
        .call(&Call::new("DEL", "s1", Some(&path)), &json!({}))
        .unwrap();
    assert_eq!(d.status, 0, "{:?}", d.json);
    // The cause gone: the same container comes up.
    std::fs::remove_file(&state).unwrap();
    let out = node
        .net
        .call(&Call::new("ADD", "s1", Some(&path)), &json!({}))
        .unwrap();
    assert_eq!(out.status, 0, "{:?}", out.json);
    node.wait_mode(&host(&out.json), "xdp", Duration::from_secs(2));
    node.del_pod("s1", &pod).unwrap();
}

/// A record file the agent cannot parse is reported (once in the log, in
/// `xdpcni_reconcile_errors_total{stage="records"}` and in /v1/status), left
/// in place for a human, and the other pods keep their fast path.
#[test]
fn vanish_an_unreadable_record_is_reported_and_kept() {
    let _shared = shared_machine();
    let node = new_node();
    let _agent = node.start_agent("agent.log").unwrap();
    // b's namespace lives as long as the test (a dropped Netns is deleted).
    let Pair {
        pa,
        pb: _pb,
        ha,
        b_ip,
        ..
    } = node.pair_attached("xdp", Duration::from_secs(2)).unwrap();
    let bad = node.net.dir.path().join("state").join("broken_eth0.json");
    std::fs::write(&bad, b"{\"containerId\": \"broken\", truncated").unwrap();
    let status = || -> Value {
        let (code, body) = http_get(&node.net.node, LISTEN, "/v1/status").unwrap();
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    };
    let start = Instant::now();
    while status()["unreadableRecords"] != 1 {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "not reported: {}",
            status()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Several passes later: said once, counted, kept.
    std::thread::sleep(Duration::from_millis(800));
    let log = node.log("agent.log");
    assert_eq!(
        log.matches("a CNI record cannot be read").count(),
        1,
        "{log}"
    );
    assert!(log.contains("broken_eth0.json"), "{log}");
    assert!(
        sample(
            &metrics(&node),
            "xdpcni_reconcile_errors_total",
            &[("stage", "records")]
        )
        .unwrap()
            >= 1.0
    );
    assert!(
        bad.exists(),
        "the agent must not remove what it cannot read"
    );
    let s = status();
    assert_eq!(
        s["pods"].as_array().unwrap().len(),
        2,
        "{s:#}\n{}",
        node.log("agent.log")
    );
    node.wait_mode(&ha, "xdp", Duration::from_secs(1));
    ping(&pa, b_ip, 2).unwrap();
    // Mended by hand: no longer reported.
    std::fs::remove_file(&bad).unwrap();
    let start = Instant::now();
    while status()["unreadableRecords"] != 0 {
        assert!(start.elapsed() < Duration::from_secs(3), "still reported");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// (VmRSS in kB, open fds) of process `pid`.
fn rss_and_fds(pid: u32) -> (u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    (rss, fds)
}

/// The p-th percentile (0..=100) of `v` (sorted here), in ms.
fn percentile(v: &mut [Duration], p: usize) -> f64 {
    v.sort();
    let i = (v.len() * p / 100).min(v.len() - 1);
    v[i].as_secs_f64() * 1e3
}
