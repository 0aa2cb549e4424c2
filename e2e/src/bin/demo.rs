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
    netns::Netns,
    traffic::{ping, tcp_transfer, udp_echo},
    PinDir,
};
use xdpcni_ebpf::{
    abi::{Verdict, VerdictKind},
    Maps,
};

const LISTEN: &str = "127.0.0.1:9965";
const TCP_BYTES: usize = 32 << 20;

struct Pod {
    name: String,
    ns: Netns,
    host: String,
    ips: Vec<IpAddr>,
}

fn main() -> Result<()> {
    // What a node runs: the product binaries, not the tests' hooked builds.
    xdpcni_e2e::cni::use_product_binaries();
    println!("== a node namespace, the xdpcni-agent (standalone), three pods through the CNI");
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
    let _start = Instant::now();
    wait_ready(&net.node, LISTEN, Duration::from_secs(15), || {
        std::fs::read_to_string(net.dir.path().join("agent.log")).unwrap_or_default()
    })?;
    println!(
        "agent ready (pid {}), datapath pinned at {}",
        agent.pid(),
        pins.path().display()
    );

    let mut pods = Vec::new();
    for i in 1..=3 {
        let name = format!("p{i}");
        let ns = Netns::new("xp")?;
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name}");
        let path = ns.path();
        let mut call = Call::new("ADD", &name, Some(&path));
        call.args = &args;
        let out = net.call(&call, &json!({}))?;
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
        pods.push(Pod {
            name,
            ns,
            host,
            ips,
        });
    }
    let maps = Maps::open_pinned(pins.path())?;

    println!("\n== traffic between the pods in each mode (set through the agent's pods file)\n");
    println!(
        "| xdpcni.io/xdp-mode | xdpcni.io/redirect | devmap or tc peer | XDP cpumap | to the kernel | to the kernel, by verdict | best TCP Mbit/s |"
    );
    println!("| --- | --- | ---: | ---: | ---: | --- | ---: |");
    // Every kernel verdict seen, for the legend below the table.
    let mut seen: std::collections::BTreeSet<Verdict> = std::collections::BTreeSet::new();
    for (mode, redirect, want) in [
        ("off", "devmap", "none"),
        ("native", "devmap", "xdp"),
        ("native", "cpumap", "xdp"),
        ("generic", "devmap", "xdpgeneric"),
        ("generic", "cpumap", "xdpgeneric"),
        ("tc", "devmap", "tc"),
    ] {
        let mut file = serde_json::Map::new();
        for p in &pods {
            file.insert(
                format!("default/{}", p.name),
                json!({ "xdpcni.io/xdp-mode": mode, "xdpcni.io/redirect": redirect }),
            );
        }
        std::fs::write(&pods_file, Value::Object(file).to_string())?;
        let start = Instant::now();
        for p in &pods {
            loop {
                let now = xdpcni_e2e::agent::mode_of(&net.node, &p.host)?;
                if now == want {
                    break;
                }
                if start.elapsed() > Duration::from_secs(5) {
                    bail!("{} did not switch to {mode}", p.name);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // Let the agent finish the pass (endpoint records, offloads).
        std::thread::sleep(Duration::from_millis(400));
        // Packets of each verdict over every pod's host veth.
        let totals = || -> Result<BTreeMap<Verdict, u64>> {
            let mut out = BTreeMap::new();
            for p in &pods {
                for (v, s) in maps.counters(net.node.ifindex(&p.host)?)?.iter() {
                    *out.entry(v).or_default() += s.packets;
                }
            }
            Ok(out)
        };
        let before = totals()?;
        let mut best = 0f64;
        for (i, from) in pods.iter().enumerate() {
            let to = &pods[(i + 1) % pods.len()];
            for addr in &to.ips {
                ping(&from.ns, *addr, 2)?;
                udp_echo(&from.ns, &to.ns, *addr, 20, 1000)?;
            }
            best = best.max(tcp_transfer(&from.ns, &to.ns, to.ips[0], TCP_BYTES)?);
        }
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
        println!(
            "| {mode} | {redirect} | {} | {} | {} | {by_verdict} | {best:.0} |",
            grew(Verdict::RedirectDevmap) + grew(Verdict::RedirectPeer),
            grew(Verdict::RedirectCpumap),
            kernel.iter().map(|(_, n)| n).sum::<u64>(),
        );
    }
    println!(
        "\n\"off\": no program on the pods' veths, so no counter moves and the kernel routes everything."
    );
    println!("What went to the kernel in the fast-path modes, by verdict:");
    for v in &seen {
        println!("  {}: {}", v.label(), v.when());
    }

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

    println!("\n== cleaning up: CNI DEL, agent SIGTERM, datapath unpinned, namespaces deleted");
    for p in &pods {
        let out = net.call(&Call::new("DEL", &p.name, Some(&p.ns.path())), &json!({}))?;
        if out.status != 0 {
            bail!("CNI DEL {}: {}", p.name, out.json);
        }
    }
    agent.stop(libc::SIGTERM)?;
    Ok(())
}
