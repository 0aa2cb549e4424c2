//! The local demo, without Kubernetes: a node made of network namespaces,
//! the `xdpcni-agent` in standalone mode (it loads and pins the datapath),
//! three pods created through the real `xdpcni` CNI plugin with Debian's
//! host-local, and traffic between the pods in each mode, with the counters
//! that show which path it took. Cleans up after itself. Run as root:
//! `scripts/demo.sh`.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use serde_json::{json, Value};
use xdpcni_e2e::{
    cni::{agent_binary, http_get, result_ips, wait_ready, Call, Network, NodeProcess},
    measure::{median, udp_rate},
    netns::Netns,
    traffic::{every_cpu, ping, tcp_stream, tcp_transfer, udp_echo},
    PinDir,
};
use xdpcni_ebpf::{
    abi::{Verdict, VerdictKind},
    Maps,
};

const LISTEN: &str = "127.0.0.1:9965";
/// Each pod pair's TCP delivery check: hashed at both ends (slow, exact).
const TCP_CHECK_BYTES: usize = 4 << 20;
/// The rates, p1 -> p2, each this many times this long: a TCP stream with
/// nothing computed per byte (what the path carries, not what a hash
/// allows), and a flood of 64-byte UDP payloads (the per-packet cost).
const RATE_TIME: Duration = Duration::from_millis(500);
const RATE_REPS: usize = 3;
const UDP_PORT: u16 = 9100;

/// The modes the demo walks, with the attachment the agent shows for each.
const MODES: &[(&str, &str, &str)] = &[
    ("off", "devmap", "none"),
    ("native", "devmap", "xdp"),
    ("native", "cpumap", "xdp"),
    ("generic", "devmap", "xdpgeneric"),
    ("generic", "cpumap", "xdpgeneric"),
    ("tc", "devmap", "tc"),
];

struct Pod {
    name: String,
    ns: Netns,
    host: String,
    ips: Vec<IpAddr>,
}

/// The node: its pods, its agent, the agent's pods file, its network and
/// pins; dropped in that order (fields drop as declared).
struct Demo {
    pods: Vec<Pod>,
    agent: NodeProcess,
    pods_file: std::path::PathBuf,
    net: Network,
    pins: PinDir,
}

/// One mode's rate: the median and the range of its repetitions.
struct Rate {
    median: f64,
    min: f64,
    max: f64,
}

impl Rate {
    fn of(mut v: Vec<f64>) -> Self {
        Self {
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(0.0, f64::max),
            median: median(&mut v),
        }
    }
}

/// A mode's two rates: TCP Mbit/s, UDP 64-byte kpps.
struct Rates {
    mode: String,
    tcp: Rate,
    udp: Rate,
}

fn main() -> Result<()> {
    // What a node runs: the product binaries, not the tests' hooked builds.
    xdpcni_e2e::cni::use_product_binaries();
    println!("== a node namespace, the xdpcni-agent (standalone), three pods through the CNI");
    let mut demo = start()?;
    make_pods(&mut demo)?;
    let maps = Maps::open_pinned(demo.pins.path())?;

    println!("\n== traffic between the pods in each mode (set through the agent's pods file)\n");
    println!(
        "| xdpcni.io/xdp-mode | xdpcni.io/redirect | devmap or tc peer | XDP cpumap | to the kernel | to the kernel, by verdict | TCP Mbit/s | UDP 64 B kpps |"
    );
    println!("| --- | --- | ---: | ---: | ---: | --- | ---: | ---: |");
    // Every kernel verdict seen, for the legend below the table.
    let mut seen: std::collections::BTreeSet<Verdict> = std::collections::BTreeSet::new();
    let mut rates = Vec::new();
    for (mode, redirect, want) in MODES {
        rates.push(run_mode(&demo, &maps, mode, redirect, want, &mut seen)?);
    }
    println!(
        "\n\"off\": no program on the pods' veths, so no counter moves and the kernel routes everything."
    );
    println!("What went to the kernel in the fast-path modes, by verdict:");
    for v in &seen {
        println!("  {}: {}", v.label(), v.when());
    }
    compare_rates(&rates);
    show_metrics_and_status(&demo)?;
    clean_up(demo)
}

/// The node namespace and the agent on it, ready.
fn start() -> Result<Demo> {
    let pins = PinDir::new("xdemo")?;
    let net = Network::new(pins.path(), "1.1.0", Network::dual_stack())?;
    let pods_file = net.dir.path().join("pods.json");
    std::fs::write(&pods_file, "{}")?;
    let cfg = net.dir.path().join("agent.json");
    std::fs::write(
        &cfg,
        json!({
            "pinDir": pins.path(), "stateDir": net.dir.path().join("state"),
            "readyFile": net.dir.path().join("agent-ready"), "listen": LISTEN,
            "xdpMode": "native", "redirect": "devmap", "podsFile": pods_file, "intervalMs": 200,
        })
        .to_string(),
    )?;
    let agent = NodeProcess::spawn(
        &net.node,
        &agent_binary()?,
        &["standalone", "--config", &cfg.to_string_lossy()],
        &net.dir.path().join("agent.log"),
    )?;
    wait_ready(&net.node, LISTEN, Duration::from_secs(15), || {
        std::fs::read_to_string(net.dir.path().join("agent.log")).unwrap_or_default()
    })?;
    println!(
        "agent ready (pid {}), datapath pinned at {}",
        agent.pid(),
        pins.path().display()
    );
    Ok(Demo {
        net,
        pins,
        pods_file,
        agent,
        pods: Vec::new(),
    })
}

/// Three pods through CNI ADD.
fn make_pods(demo: &mut Demo) -> Result<()> {
    for i in 1..=3 {
        let name = format!("p{i}");
        let ns = Netns::new("xp")?;
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name}");
        let path = ns.path();
        let mut call = Call::new("ADD", &name, Some(&path));
        call.args = &args;
        let out = demo.net.call(&call, &json!({}))?;
        if out.status != 0 {
            bail!("CNI ADD {name}: {}", out.json);
        }
        let ips: Vec<IpAddr> = result_ips(&out.json);
        let host = out.json["interfaces"][0]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        println!(
            "  CNI ADD {name}: {} on {host}",
            ips.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
        demo.pods.push(Pod {
            name,
            ns,
            host,
            ips,
        });
    }
    Ok(())
}

/// Every pod switched to `mode` through the pods file, seen attached as `want`.
fn switch_all(demo: &Demo, mode: &str, redirect: &str, want: &str) -> Result<()> {
    let mut file = serde_json::Map::new();
    for p in &demo.pods {
        file.insert(
            format!("default/{}", p.name),
            json!({ "xdpcni.io/xdp-mode": mode, "xdpcni.io/redirect": redirect }),
        );
    }
    std::fs::write(&demo.pods_file, Value::Object(file).to_string())?;
    let start = Instant::now();
    for p in &demo.pods {
        while xdpcni_e2e::agent::mode_of(&demo.net.node, &p.host)? != want {
            if start.elapsed() > Duration::from_secs(5) {
                bail!("{} did not switch to {mode}", p.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // Let the agent finish the pass (endpoint records, offloads).
    std::thread::sleep(Duration::from_millis(400));
    Ok(())
}

/// One mode: ping, UDP and a checked TCP transfer between every pair, then
/// the TCP rate; its table row, counted from the pods' counters.
fn run_mode(
    demo: &Demo,
    maps: &Maps,
    mode: &str,
    redirect: &str,
    want: &str,
    seen: &mut std::collections::BTreeSet<Verdict>,
) -> Result<Rates> {
    switch_all(demo, mode, redirect, want)?;
    let pods = &demo.pods;
    // Packets of each verdict over every pod's host veth.
    let totals = || -> Result<BTreeMap<Verdict, u64>> {
        let mut out = BTreeMap::new();
        for p in pods {
            for (v, s) in maps.counters(demo.net.node.ifindex(&p.host)?)?.iter() {
                *out.entry(v).or_default() += s.packets;
            }
        }
        Ok(out)
    };
    let before = totals()?;
    for (i, from) in pods.iter().enumerate() {
        let to = &pods[(i + 1) % pods.len()];
        for addr in &to.ips {
            ping(&from.ns, *addr, 2)?;
            udp_echo(&from.ns, &to.ns, *addr, 20, 1000)?;
        }
        tcp_transfer(&from.ns, &to.ns, to.ips[0], TCP_CHECK_BYTES)?;
    }
    let (from, to) = (&pods[0].ns, &pods[1].ns);
    let tcp = (0..RATE_REPS)
        .map(|_| tcp_stream(from, to, pods[1].ips[0], RATE_TIME))
        .collect::<Result<Vec<f64>>>()?;
    let dial = std::net::SocketAddr::new(pods[1].ips[0], UDP_PORT);
    let senders = every_cpu();
    let udp = (0..RATE_REPS)
        .map(|_| Ok(udp_rate(from, to, dial, dial, 64, &senders, RATE_TIME)? / 1e3))
        .collect::<Result<Vec<f64>>>()?;
    let after = totals()?;
    let grew =
        |v: Verdict| after.get(&v).copied().unwrap_or(0) - before.get(&v).copied().unwrap_or(0);
    let mut kernel: Vec<(Verdict, u64)> = Verdict::ALL
        .iter()
        .filter(|v| v.kind() == VerdictKind::Kernel)
        .map(|&v| (v, grew(v)))
        .filter(|(_, n)| *n > 0)
        .collect();
    kernel.sort_by_key(|k| std::cmp::Reverse(k.1));
    seen.extend(kernel.iter().map(|(v, _)| *v));
    let by_verdict = if kernel.is_empty() {
        "-".to_string()
    } else {
        kernel
            .iter()
            .map(|(v, n)| format!("{} {n}", v.label()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let rates = Rates {
        mode: format!("{mode} {redirect}"),
        tcp: Rate::of(tcp),
        udp: Rate::of(udp),
    };
    println!(
        "| {mode} | {redirect} | {} | {} | {} | {by_verdict} | {:.0} | {:.0} |",
        grew(Verdict::RedirectDevmap) + grew(Verdict::RedirectPeer),
        grew(Verdict::RedirectCpumap),
        kernel.iter().map(|(_, n)| n).sum::<u64>(),
        rates.tcp.median,
        rates.udp.median,
    );
    Ok(rates)
}

/// Each mode's rates against kernel routing (`off`): ratios of medians,
/// and whether each is beyond this run's noise (the two ranges apart).
fn compare_rates(rates: &[Rates]) {
    let Some(off) = rates.iter().find(|r| r.mode.starts_with("off")) else {
        return;
    };
    println!(
        "\np1 -> p2 against kernel routing (off): medians of {RATE_REPS} runs of {} s each, in \
         this run on this machine (docs/benchmark.md: the benchmark's figures over many runs)",
        RATE_TIME.as_secs_f64()
    );
    let said = |r: &Rate, o: &Rate| {
        let how = if r.min > o.max {
            "ahead, beyond the noise"
        } else if r.max < o.min {
            "behind, beyond the noise"
        } else {
            "within the noise (ranges overlap)"
        };
        format!("{:.2}x ({how})", r.median / o.median)
    };
    println!("  {:16} {:34} UDP 64-byte kpps", "mode", "TCP Mbit/s");
    println!(
        "  {:16} {:34} {:.0} ({:.0}-{:.0})",
        "off devmap",
        format!(
            "{:.0} ({:.0}-{:.0})",
            off.tcp.median, off.tcp.min, off.tcp.max
        ),
        off.udp.median,
        off.udp.min,
        off.udp.max
    );
    for r in rates.iter().filter(|r| !r.mode.starts_with("off")) {
        println!(
            "  {:16} {:34} {}",
            r.mode,
            said(&r.tcp, &off.tcp),
            said(&r.udp, &off.udp)
        );
    }
    println!(
        "  native: the kernel turns the pod's TSO off while native XDP is attached, so its TCP is \
         segmented in the pod (the mode for receivers that consume in XDP, not for sockets); \
         generic: super-packets take the kernel path (pass_gso)"
    );
}

/// The agent's view: a few metrics lines and `xdpcni-agent status`.
fn show_metrics_and_status(demo: &Demo) -> Result<()> {
    let net = &demo.net;
    let (_, metrics) = http_get(&net.node, LISTEN, "/metrics")?;
    println!("\n== a few lines of the agent's /metrics\n");
    for line in metrics
        .lines()
        .filter(|l| {
            l.contains("pod=\"p1\"") && (l.contains("redirect_") || l.contains("attach_mode"))
        })
        .take(6)
    {
        println!("  {line}");
    }

    println!("\n== xdpcni-agent status (what an operator runs on the node)\n");
    let agent_bin = agent_binary()?;
    let url = format!("http://{LISTEN}");
    let status = xdpcni_e2e::in_netns(&net.node, move || {
        Ok(std::process::Command::new(&agent_bin)
            .args(["status", "--url", &url])
            .output()?)
    })?;
    if !status.status.success() {
        bail!(
            "xdpcni-agent status failed: {}",
            String::from_utf8_lossy(&status.stderr)
        );
    }
    for line in String::from_utf8_lossy(&status.stdout).lines() {
        println!("  {line}");
    }
    Ok(())
}

fn clean_up(demo: Demo) -> Result<()> {
    println!("\n== cleaning up: CNI DEL, agent SIGTERM, datapath unpinned, namespaces deleted");
    for p in &demo.pods {
        let out = demo
            .net
            .call(&Call::new("DEL", &p.name, Some(&p.ns.path())), &json!({}))?;
        if out.status != 0 {
            bail!("CNI DEL {}: {}", p.name, out.json);
        }
    }
    demo.agent.stop(libc::SIGTERM)?;
    Ok(())
}
