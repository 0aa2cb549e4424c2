//! NetworkPolicy on the fast path: a client and a server pod in a
//! namespace whose policies deny all ingress but the client's, three ways
//! side by side in each repetition: the fast path with the policies in the
//! datapath, the kernel path with the same policies (both pods `off`: the
//! nftables rules), and the fast path with no policy at all; then the
//! program's cost per packet with 1, 100 and 1000 policies selecting the
//! server, and how long a change takes to be enforced with 1000 policies in
//! force, on both paths.

#[allow(clippy::wildcard_imports)]
use super::*;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, PostParams};
use xdpcni_e2e::cluster::TestPod;

/// The paths of the policy rows.
pub const NPF_FAST: &str = "fast path, policy in the datapath";
pub const NPF_KERNEL: &str = "kernel path, the same policy";
pub const NPF_NONE: &str = "fast path, no policy";

/// The ports the allow policy names (iperf3, the UDP sink, the
/// request/response echo) and the test pods' UDP echo on 80.
const PORTS: [(&str, u16); 4] = [("TCP", 5201), ("UDP", 9000), ("TCP", 7000), ("UDP", 80)];

/// Namespaces of the three pairs, in path order.
const PAIRS: [(&str, &str); 3] = [
    (NPF_FAST, "np-fast"),
    (NPF_KERNEL, "np-kernel"),
    (NPF_NONE, "np-none"),
];

fn allow_ports() -> Value {
    Value::Array(
        PORTS
            .iter()
            .map(|(p, port)| json!({ "protocol": p, "port": port }))
            .collect(),
    )
}

/// The policies of a namespace `ns`: deny all ingress, then the client
/// allowed into the server on the bench's ports.
fn policies(ns: &str) -> Vec<Value> {
    vec![
        json!({ "metadata": { "name": "deny-all", "namespace": ns },
                "spec": { "podSelector": {}, "policyTypes": ["Ingress"] } }),
        allow_client(ns),
    ]
}

fn allow_client(ns: &str) -> Value {
    json!({ "metadata": { "name": "allow-client", "namespace": ns },
            "spec": { "podSelector": { "matchLabels": { "app": "server" } },
                      "ingress": [{ "from": [{ "podSelector": { "matchLabels": { "app": "client" } } }],
                                    "ports": allow_ports() }] } })
}

/// `n` more policies selecting `ns`'s server, each allowing a /32 that is
/// no pod's on the same ports (one rule group: the datapath's masks).
fn more_policies(ns: &str, from: usize, n: usize) -> Vec<Value> {
    (from..from + n)
        .map(|i| {
            json!({ "metadata": { "name": format!("extra-{i:04}"), "namespace": ns },
                    "spec": { "podSelector": { "matchLabels": { "app": "server" } },
                              "ingress": [{ "from": [{ "ipBlock": { "cidr": format!("172.16.{}.{}/32", i / 250, i % 250 + 1) } }],
                                            "ports": allow_ports() }] } })
        })
        .collect()
}

/// The policy rows, on a node of their own (API server, agent in
/// Kubernetes mode, the default tc mode).
pub fn policy_fast_bench(
    reps: usize,
    secs: u32,
    rounds: usize,
    push: &mut dyn FnMut(&str, &str, usize, f64),
    extra: &mut Vec<String>,
) -> Result<()> {
    use xdpcni_e2e::{cluster::KubeNode, traffic::tcp_rr_via};
    let node = KubeNode::start(|_| {})?;
    let mut pairs = Vec::new();
    for (label, ns) in PAIRS {
        node.namespace(ns, json!({ "ns": ns }))?;
        let client = node.add_pod(ns, "client", json!({ "app": "client" }), json!([]))?;
        let server = node.add_pod(ns, "server", json!({ "app": "server" }), json!([]))?;
        pairs.push((label, ns, client, server));
    }
    for p in ["client", "server"] {
        node.annotate("np-kernel", p, json!({ "xdpcni.io/xdp-mode": "off" }))?;
    }
    let mut all = policies("np-fast");
    all.extend(policies("np-kernel"));
    node.create_policies(all)?;
    let maps = Maps::open_pinned(node.pin_dir())?;
    // In force: the kernel pair on kernel routing, the fast pair's server
    // flagged for the datapath's check, 4 policies.
    let start = Instant::now();
    loop {
        let fast_server = &pairs[0].3;
        let flagged = maps
            .endpoint(fast_server.ip(false))?
            .is_some_and(|e| e.flags & xdpcni_ebpf::abi::EP_POLICY != 0);
        let kernel = xdpcni_e2e::agent::mode_of(&node.net.node, &pairs[1].3.host)? == "none";
        if flagged && kernel && node.metrics()?.get("xdpcni_policy_policies").copied() == Some(4.0)
        {
            break;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(30),
            "the policies are not in force (fast server flagged: {flagged}, kernel pair off: {kernel})\n{}",
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Past the windows of the pods just isolated (a new UDP flow of theirs
    // is checked both ways for 2 s: the client is isolated by the deny-all
    // too, so the server could not answer it).
    std::thread::sleep(Duration::from_millis(2500));
    let dur = Duration::from_secs(u64::from(secs));
    let mut share: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let order: Vec<usize> = (0..pairs.len()).collect();
    for rep in 0..reps {
        for &i in rep_order(&order, rep) {
            let (label, _, client, server) = &pairs[i];
            let sip = server.ip(false);
            let idx = node.net.node.ifindex(&client.host)?;
            let before = maps.counters(idx)?;
            push(
                W_NPF_TCP,
                label,
                rep,
                iperf_via(
                    &client.netns,
                    &server.netns,
                    SocketAddr::new(sip, PORTS[0].1),
                    sip,
                    secs,
                )?,
            );
            let to = SocketAddr::new(sip, PORTS[1].1);
            push(
                W_NPF_UDP64,
                label,
                rep,
                pps_via(&client.netns, &server.netns, to, to, 22, dur)? / 1e6,
            );
            check_interrupt()?;
            let to = SocketAddr::new(sip, PORTS[2].1);
            let mut rtts = tcp_rr_via(&client.netns, &server.netns, to, to, rounds, 100)?;
            push(W_NPF_RR, label, rep, percentile(&mut rtts, 0.5));
            let after = maps.counters(idx)?;
            let s = share.entry(label).or_default();
            s.0 += after.forwarded() - before.forwarded();
            s.1 += after.passed() - before.passed();
        }
    }
    for (label, (fast, kernel)) in &share {
        extra.push(format!(
            "NetworkPolicy rows, {label}: {:.1}% of the client's packets on the fast path ({fast} redirected, {kernel} to the kernel)",
            100.0 * *fast as f64 / (*fast + *kernel).max(1) as f64
        ));
    }
    let fast_share = share.get(NPF_FAST).copied().unwrap_or_default();
    ensure!(
        fast_share.0 > 50 * fast_share.1.max(1),
        "the policy pair's packets did not take the fast path: {fast_share:?}"
    );
    let st = xdpcni_ebpf::PolicyStats::read_pinned(node.pin_dir())?;
    extra.push(format!(
        "NetworkPolicy rows: the datapath's policy check {st:?}"
    ));

    // The program per packet with 1, 100 and 1000 policies selecting the server.
    let (_, _, client, server) = &pairs[0];
    let prog = || -> Result<aya::programs::ProgramInfo> {
        let progs = xdpcni_ebpf::layout_dir(node.pin_dir()).join("progs");
        Ok(
            aya::programs::SchedClassifier::from_pin(progs.join(xdpcni_ebpf::TC_FROM_POD_PROGRAM))?
                .info()?,
        )
    };
    let mut have = 1;
    let prog_ns = |client: &TestPod, server: &TestPod| -> Result<(f64, f64)> {
        let stats = BpfStats::enable()?;
        let before = prog()?;
        let to = SocketAddr::new(server.ip(false), PORTS[1].1);
        let rate = pps_via(&client.netns, &server.netns, to, to, 22, dur)?;
        let after = prog()?;
        drop(stats);
        let runs = after.run_count().saturating_sub(before.run_count());
        ensure!(runs > 0, "the program did not run");
        let ns = after
            .run_time()
            .saturating_sub(before.run_time())
            .as_nanos() as f64
            / runs as f64;
        Ok((rate, ns))
    };
    // No policy at all, on the same program: the pair of np-none.
    for rep in 0..reps {
        let (rate, ns) = prog_ns(&pairs[2].2, &pairs[2].3)?;
        push(W_NPF_PROG, NPF_NONE, rep, ns);
        push(W_NPF_SCALE, NPF_NONE, rep, rate / 1e6);
    }
    // Waits until the agent counts `n` policies selecting its pods.
    let in_force = |n: usize| -> Result<()> {
        let start = Instant::now();
        while node.metrics()?.get("xdpcni_policy_policies").copied() != Some(n as f64) {
            ensure!(
                start.elapsed() < Duration::from_secs(120),
                "{n} policies not in force"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    };
    for (n, label) in [(1, NPF_1), (100, NPF_100), (1000, NPF_1000)] {
        // The allow policy is one of them; the deny-all selects the server too.
        if n > have {
            node.create_policies(more_policies("np-fast", have, n - have))?;
            have = n;
        }
        in_force(n + 3)?;
        // And the server still in the datapath (its verdicts fit).
        ensure!(
            maps.endpoint(server.ip(false))?
                .is_some_and(|e| e.flags & xdpcni_ebpf::abi::EP_POLICY != 0),
            "the server left the fast path with {n} policies"
        );
        for rep in 0..reps {
            let (rate, ns) = prog_ns(client, server)?;
            push(W_NPF_PROG, label, rep, ns);
            push(W_NPF_SCALE, label, rep, rate / 1e6);
        }
    }

    // Changed -> enforced with 1000 policies selecting the server, on both
    // paths: the kernel pair's server gets its 1000 too, so that each
    // change rewrites the same (4000-element) sets on both. The client's
    // UDP echo to the server every millisecond, the allow policy deleted
    // (enforced: no echo for 500 ms) and made again.
    node.create_policies(more_policies("np-kernel", 1, have - 1))?;
    in_force(2 * have + 2)?;
    for (label, ns) in [PAIRS[0], PAIRS[1]] {
        let pair = pairs.iter().find(|p| p.1 == ns).context("pair")?;
        let echo = Echo::start(&pair.2.netns, SocketAddr::new(pair.3.ip(false), 80))?;
        let log_tail = || {
            let log = node.agent_log();
            let lines: Vec<&str> = log.lines().collect();
            let table = node
                .net
                .node
                .exec(&["nft", "list", "table", "inet", "xdpcni"])
                .unwrap_or_else(|e| e.to_string());
            let client = pair.2.ip(false).to_string();
            let about: Vec<&str> = table
                .lines()
                .filter(|l| l.contains(&client) || !l.starts_with("\t\t\t"))
                .collect();
            let ct = node
                .net
                .node
                .exec(&["conntrack", "-L", "-s", &client])
                .unwrap_or_else(|e| e.to_string());
            format!(
                "{label}: the agent's log ends\n{}\nthe table (its sets' elements but the client's):\n{}\nconntrack:\n{ct}",
                lines[lines.len().saturating_sub(40)..].join("\n"),
                about.join("\n")
            )
        };
        let allow: NetworkPolicy = serde_json::from_value(allow_client(ns))?;
        // One client, its connection open: the clock starts as the request
        // is sent, not before a new client's TLS handshake.
        let (echo_ref, log_ref, allow_ref) = (&echo, &log_tail, &allow);
        let (mut closed, mut opened, mut acked) = node.client(|c| async move {
            let api = Api::<NetworkPolicy>::namespaced(c, ns);
            let (mut closed, mut opened, mut acked) = (Vec::new(), Vec::new(), Vec::new());
            // 20 samples a path (p99: the largest but for noise), one in --quick.
            for _ in 0..netpol::latency_rounds(reps).min(20) {
                check_interrupt()?;
                std::thread::sleep(Duration::from_millis(300));
                let t0 = Instant::now();
                api.delete("allow-client", &DeleteParams::default()).await?;
                acked.push(t0.elapsed().as_secs_f64() * 1e3);
                closed.push(
                    echo_ref
                        .silent_since(t0, Duration::from_secs(20))
                        .with_context(log_ref)?,
                );
                let t1 = Instant::now();
                api.create(&PostParams::default(), allow_ref).await?;
                acked.push(t1.elapsed().as_secs_f64() * 1e3);
                opened.push(
                    echo_ref
                        .answered_since(t1, Duration::from_secs(20))
                        .with_context(log_ref)?,
                );
            }
            Ok((closed, opened, acked))
        })?;
        extra.push(format!(
            "NetworkPolicy rows, {label}: the API server answered a change in {:.1} ms (median)",
            median(&mut acked)
        ));
        echo.stop()?;
        for (w50, w99, v) in [
            (W_NPF_CLOSE_P50, W_NPF_CLOSE_P99, &mut closed),
            (W_NPF_OPEN_P50, W_NPF_OPEN_P99, &mut opened),
        ] {
            push(w50, label, 0, percentile(v, 0.5));
            push(w99, label, 0, percentile(v, 0.99));
        }
    }
    // The agent's own share: its log times each datapath write.
    // A number the agent logged as ` key=value` on line `l`.
    let field = |l: &str, k: &str| -> Option<f64> {
        let rest = &l[l.find(&format!(" {k}="))? + k.len() + 2..];
        rest.split_whitespace().next()?.parse().ok()
    };
    let log = node.agent_log();
    let mut writes: Vec<f64> = log
        .lines()
        .filter(|l| l.contains("NetworkPolicy verdicts in the datapath"))
        .filter_map(|l| field(l, "ms"))
        .collect();
    if !writes.is_empty() {
        extra.push(format!(
            "NetworkPolicy rows: {} writes of the datapath's verdicts, median {:.1} ms, largest {:.1} ms",
            writes.len(),
            median(&mut writes),
            writes.iter().copied().fold(0.0, f64::max)
        ));
    }
    // Its passes that changed the rules, step by step (the agent's log).
    let passes: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("NetworkPolicy pass"))
        .collect();
    let steps = [
        "model_ms",
        "compile_ms",
        "rules_ms",
        "datapath_ms",
        "reconcile_ms",
        "total_ms",
    ];
    let medians: Vec<String> = steps
        .iter()
        .filter_map(|k| {
            let mut v: Vec<f64> = passes.iter().filter_map(|l| field(l, k)).collect();
            (!v.is_empty()).then(|| format!("{} {:.1}", k.trim_end_matches("_ms"), median(&mut v)))
        })
        .collect();
    if !medians.is_empty() {
        extra.push(format!(
            "NetworkPolicy rows: the agent's {} passes that changed something, median ms per step: {}",
            passes.len(),
            medians.join(", ")
        ));
    }
    let m = node.metrics()?;
    let tx = |k: &str| {
        m.get(&format!("xdpcni_policy_apply_duration_seconds_{k}"))
            .copied()
    };
    if let (Some(s), Some(c)) = (tx("sum"), tx("count")) {
        extra.push(format!(
            "NetworkPolicy rows: {c:.0} nftables transactions, {:.1} ms on average (each writes what its change touched, the first the whole table; up to {} policies)",
            s / c.max(1.0) * 1e3,
            2 * have + 2
        ));
    }
    Ok(())
}
