//! NetworkPolicy: created -> enforced and deleted -> allowed latency, and
//! the kernel path's forwarding rate with and without 100 policies.

#[allow(clippy::wildcard_imports)]
use super::*;

/// Samples of each NetworkPolicy latency: 20 per repetition (100 in a
/// full run, where p99 is the 99th of 100; one in `--quick`).
pub fn latency_rounds(reps: usize) -> usize {
    if reps <= 1 {
        1
    } else {
        reps * 20
    }
}

/// The NetworkPolicy figures, on a node of its own with a kube-apiserver
/// and the agent in Kubernetes mode, pods a and b made through the CNI:
/// - created -> enforced: pods a and b on XDP (generic), a UDP echo from a
///   to b every millisecond; a policy closing b is created: how long until
///   the last echo; deleted: until the first again (`latency_rounds`
///   each);
/// - the kernel path's cost per packet: a's raw 64-byte sender into a
///   raw-table sink in b, both pods on kernel routing (`off`), with no
///   policy and with 100 policies selecting b (99 rules that do not match
///   a, the one that allows it last in b's chain).
pub fn netpol_bench(
    reps: usize,
    dur: Duration,
    push: &mut dyn FnMut(&str, &str, usize, f64),
    extra: &mut Vec<String>,
) -> Result<()> {
    use xdpcni_e2e::cluster::KubeNode;
    let node = KubeNode::start(|c| c.xdp_mode = "off".into())?;
    node.namespace("bench", json!({}))?;
    let a = node.add_pod("bench", "a", json!({ "app": "a" }), json!([]))?;
    let b = node.add_pod("bench", "b", json!({ "app": "b" }), json!([]))?;
    let policies = |n: f64| -> Result<()> {
        let start = Instant::now();
        loop {
            let m = node.metrics()?;
            if m.get("xdpcni_policy_policies").copied() == Some(n) {
                return Ok(());
            }
            ensure!(
                start.elapsed() < Duration::from_secs(30),
                "{n} policies not in force"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };

    // Created -> enforced, deleted -> allowed, with both pods on XDP.
    for p in ["a", "b"] {
        node.annotate("bench", p, json!({ "xdpcni.io/xdp-mode": "generic" }))?;
    }
    for h in [&a.host, &b.host] {
        wait_mode(&node.net.node, h, "xdpgeneric", Duration::from_secs(10))?;
    }
    let echo = Echo::start(&a.netns, SocketAddr::new(b.ip(false), 80))?;
    let closing = np_json(
        "close-b",
        json!({ "podSelector": { "matchLabels": { "app": "b" } }, "policyTypes": ["Ingress"] }),
    );
    let (mut applied, mut removed, mut writes) = (Vec::new(), Vec::new(), Vec::new());
    // Enough samples that p99 is not simply the largest of a handful
    // (~1 s each: 500 ms of silence decide "enforced").
    for rep in 0..latency_rounds(reps) {
        check_interrupt()?;
        std::thread::sleep(Duration::from_millis(300));
        let t0 = Instant::now();
        node.create_policy(closing.clone())?;
        writes.push(t0.elapsed().as_secs_f64() * 1e3);
        let ms = echo
            .silent_since(t0, Duration::from_secs(10))
            .with_context(|| {
                format!(
                    "{}\nconntrack:\n{}\n{}",
                    node.net
                        .node
                        .exec(&["nft", "list", "table", "inet", "xdpcni"])
                        .unwrap_or_default(),
                    node.net
                        .node
                        .exec(&["conntrack", "-L", "-o", "id,extended"])
                        .unwrap_or_default(),
                    node.agent_log()
                )
            })?;
        applied.push(ms);
        push(W_NP_APPLY_P50, NP_AGENT, rep, ms);
        let t1 = Instant::now();
        node.delete_policies()?;
        let ms = echo.answered_since(t1, Duration::from_secs(10))?;
        removed.push(ms);
        push(W_NP_REMOVE_P50, NP_AGENT, rep, ms);
    }
    echo.stop()?;
    push(W_NP_APPLY_P99, NP_AGENT, 0, percentile(&mut applied, 0.99));
    push(W_NP_REMOVE_P99, NP_AGENT, 0, percentile(&mut removed, 0.99));
    // Where the time goes: the API write (until the create call returns:
    // etcd's commit) and the agent's own transactions.
    let m = node.metrics()?;
    let tx = |k: &str| {
        m.get(&format!("xdpcni_policy_apply_duration_seconds_{k}"))
            .copied()
    };
    let tx_ms = match (tx("sum"), tx("count")) {
        (Some(s), Some(c)) if c > 0.0 => format!("{:.1} ms", s / c * 1e3),
        _ => "unknown".into(),
    };
    extra.push(format!(
        "NetworkPolicy created -> enforced: median {:.1} ms over {} samples, of which the API write (create call until it returns) {:.1} ms; the agent's nftables transaction {tx_ms} on average",
        median(&mut applied),
        applied.len(),
        median(&mut writes),
    ));

    // The kernel path with 100 policies vs none.
    for p in ["a", "b"] {
        node.annotate("bench", p, json!({ "xdpcni.io/xdp-mode": null }))?;
    }
    for h in [&a.host, &b.host] {
        wait_mode(&node.net.node, h, "none", Duration::from_secs(10))?;
    }
    let frame = frame_between(&node.net.node, &a.host, &a.netns, a.ip(false), b.ip(false))?;
    let sender = vec![None; 1];
    let mut none = Vec::new();
    let mut hundred = Vec::new();
    for rep in 0..reps {
        check_interrupt()?;
        let r = raw_sink_rate(&a.netns, &b.netns, &frame, &sender, dur)?.rate;
        none.push(r);
        push(W_NP_FWD, NP_NONE, rep, r / 1e6);
        for i in 0..99 {
            node.create_policy(np_json(
                &format!("np-{i:03}"),
                json!({ "podSelector": { "matchLabels": { "app": "b" } }, "ingress": [{
                    "from": [{ "ipBlock": { "cidr": format!("172.16.{i}.0/24") } }],
                    "ports": [{ "protocol": "UDP", "port": 1000 + i }] }] }),
            ))?;
        }
        node.create_policy(np_json(
            "zz-allow-a",
            json!({ "podSelector": { "matchLabels": { "app": "b" } },
                    "ingress": [{ "from": [{ "podSelector": { "matchLabels": { "app": "a" } } }] }] }),
        ))?;
        policies(100.0)?;
        let r = raw_sink_rate(&a.netns, &b.netns, &frame, &sender, dur)?.rate;
        hundred.push(r);
        push(W_NP_FWD, NP_100, rep, r / 1e6);
        node.delete_policies()?;
        policies(0.0)?;
    }
    let (n, h) = (median(&mut none), median(&mut hundred));
    extra.push(format!(
        "kernel path, one sender thread, 64-byte frames: {:.3} Mpps with no policy, {:.3} Mpps with 100 policies selecting the receiver ({:.2}x; {:.0} ns more per packet, the rules of 100 policies walked)",
        n / 1e6,
        h / 1e6,
        h / n,
        (1e9 / h - 1e9 / n)
    ));
    for p in [a, b] {
        node.del_pod(p)?;
    }
    Ok(())
}

/// A NetworkPolicy `name` in namespace `bench`.
pub fn np_json(name: &str, spec: Value) -> Value {
    json!({ "metadata": { "name": name, "namespace": "bench" }, "spec": spec })
}

/// A UDP echo every millisecond from a pod to a server, in a thread:
/// when the last answer came.
pub struct Echo {
    base: Instant,
    last: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Result<()>>,
}

impl Echo {
    pub fn start(from: &Netns, to: SocketAddr) -> Result<Self> {
        use std::sync::{atomic::AtomicU64, Arc};
        let base = Instant::now();
        let last = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let netns = from.path();
        let (l, s) = (Arc::clone(&last), Arc::clone(&stop));
        let thread = std::thread::spawn(move || -> Result<()> {
            let ns = std::fs::File::open(&netns)?;
            // SAFETY: a valid namespace fd; only this thread changes namespace.
            if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) } != 0
            {
                bail!("setns: {}", std::io::Error::last_os_error());
            }
            let sock = UdpSocket::bind("0.0.0.0:0")?;
            sock.set_read_timeout(Some(Duration::from_millis(1)))?;
            let mut buf = [0u8; 64];
            while !s.load(Ordering::Relaxed) {
                let _ = sock.send_to(b"x", to);
                if sock.recv_from(&mut buf).is_ok() {
                    l.store(base.elapsed().as_nanos() as u64, Ordering::Relaxed);
                }
            }
            Ok(())
        });
        Ok(Self {
            base,
            last,
            stop,
            thread,
        })
    }

    fn at(&self, t: Instant) -> u64 {
        t.duration_since(self.base).as_nanos() as u64
    }

    /// Milliseconds from `t0` to the last answer, once none has come for
    /// 500 ms.
    pub fn silent_since(&self, t0: Instant, within: Duration) -> Result<f64> {
        while self.last.load(Ordering::Relaxed) + 500_000_000 > self.at(Instant::now()) {
            ensure!(t0.elapsed() < within, "the change is not enforced");
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(self
            .last
            .load(Ordering::Relaxed)
            .saturating_sub(self.at(t0)) as f64
            / 1e6)
    }

    /// Milliseconds from `t0` to the first answer after it.
    pub fn answered_since(&self, t0: Instant, within: Duration) -> Result<f64> {
        while self.last.load(Ordering::Relaxed) < self.at(t0) {
            ensure!(t0.elapsed() < within, "not allowed again");
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok((self.last.load(Ordering::Relaxed) - self.at(t0)) as f64 / 1e6)
    }

    pub fn stop(self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("echo thread panicked"))?
    }
}
