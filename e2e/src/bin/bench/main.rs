//! The benchmark: each path (Debian's reference `ptp` plugin, xdpcni with
//! kernel routing, and xdpcni in every XDP mode) gets its own node of
//! namespaces whose pods are made by real CNI calls; every workload runs on
//! every path, interleaved, several times; the table gives median and min-max
//! with the ratio to the ptp baseline measured in the same run. Also writes
//! every sample as JSON and a PNG chart (python3 + matplotlib).
//!
//! `cargo build --release --workspace --bins` (the bench execs the `xdpcni`
//! binary next to it, which `cargo run --bin bench` alone does not rebuild),
//! then `target/release/bench [--quick] [--reps N]
//! [--secs S] [--out DIR]` as root. `--quick` is the CI smoke test: it checks
//! that every measurement runs, not the numbers.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr, UdpSocket},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicBool, AtomicU16, Ordering},
    time::{Duration, Instant},
};
use xdpcni_ebpf::testing::RawDatapath;

mod migration;
mod netpol;
mod paths;
mod policy;
mod same_node;
mod services;
mod targets;
mod xnode;

use migration::*;
use netpol::*;
use paths::*;
use policy::*;
use same_node::*;
use services::*;
use targets::*;
use xnode::*;

use anyhow::{bail, ensure, Context, Result};
use serde::Serialize;
use serde_json::{json, Value};
use xdpcni_e2e::{
    agent::{wait_mode, StandaloneAgent},
    cni::{Call, Network, REFERENCE_PLUGINS},
    in_netns,
    measure::{
        busy_between, cpu_times, frame_between, median, percentile, raw_sink_rate, report_tail,
        write_report, BpfStats, Fwd, Op, Target,
    },
    netns::Netns,
    node::AgentConfig,
    traffic::{every_cpu, raw_flood, tcp_rr, udp_flood},
    PinDir,
};
use xdpcni_ebpf::{abi::RedirectPolicy, Datapath, Maps};

static NEXT_PORT: AtomicU16 = AtomicU16::new(20000);
static INTERRUPTED: std::sync::LazyLock<std::sync::Arc<AtomicBool>> =
    std::sync::LazyLock::new(|| std::sync::Arc::new(AtomicBool::new(false)));

/// Ctrl-C / SIGTERM end the run between measurements, through the normal
/// error path, so every namespace and pin is removed by Drop (signal-hook
/// sets the flag).
fn install_signal_handlers() -> Result<()> {
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, std::sync::Arc::clone(&INTERRUPTED))
            .with_context(|| format!("handling signal {sig}"))?;
    }
    Ok(())
}

fn check_interrupt() -> Result<()> {
    ensure!(!INTERRUPTED.load(Ordering::Relaxed), "interrupted");
    Ok(())
}

fn port() -> u16 {
    NEXT_PORT.fetch_add(1, Ordering::Relaxed)
}

#[derive(Serialize)]
struct Sample {
    workload: String,
    path: String,
    rep: usize,
    value: f64,
}

/// The benchmark: every workload on every path, interleaved, with ratios to
/// the reference ptp plugin measured in the same run. Run as root.
#[derive(clap::Parser, Debug)]
#[command(version, about)]
struct Opts {
    /// CI smoke test: one repetition of one second each (checks that every
    /// measurement runs, not the numbers).
    #[arg(long)]
    quick: bool,
    /// Repetitions of each figure.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    reps: u64,
    /// Seconds per throughput measurement.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    secs: u32,
    /// Where bench.md, bench.json and bench.png go.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
    /// Only workloads whose name contains this (e.g. "Pinned", "TCP 1
    /// stream"; repeat it for several): for profiling one of them or
    /// comparing two paths at length; the report is partial.
    #[arg(long)]
    only: Vec<String>,
    /// Only paths whose label contains this (e.g. "generic devmap").
    #[arg(long)]
    path: Option<String>,
}

impl Opts {
    fn workload(&self, w: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| w.contains(o.as_str()))
    }
    /// Whether a phase measuring the workloads `ws` runs.
    fn any(&self, ws: &[&str]) -> bool {
        ws.iter().any(|w| self.workload(w))
    }
    /// An `--only` that names no workload, said with every name it could match.
    fn check_only(&self) -> Result<()> {
        let names: Vec<&str> = WORKLOADS.iter().map(|w| w.0).chain([W_STAGES]).collect();
        for o in &self.only {
            if !names.iter().any(|n| n.contains(o.as_str())) {
                bail!(
                    "--only {o:?} matches no workload (a workload runs when its name contains it); the workloads:\n  {}",
                    names.join("\n  ")
                );
            }
        }
        Ok(())
    }
    fn path_on(&self, b: &Bench) -> bool {
        self.path
            .as_deref()
            .is_none_or(|p| b.spec.label.contains(p))
    }
    fn full(&self) -> bool {
        self.only.is_empty() && self.path.is_none()
    }
}

fn parse_args() -> Opts {
    let mut o = <Opts as clap::Parser>::parse();
    if o.quick {
        o.reps = 1;
        o.secs = 1;
    }
    o
}

fn main() -> Result<()> {
    // What a node runs: the product binaries, not the tests' hooked builds.
    xdpcni_e2e::cni::use_product_binaries();
    let o = parse_args();
    o.check_only()?;
    install_signal_handlers()?;
    let run = measure(&o)?;
    if run.samples.is_empty() && run.stages.is_none() {
        bail!(
            "nothing measured: --path {:?} names no path of the workloads --only chose",
            o.path
        );
    }
    let rows = summarise(&run.samples);
    report(&o, &run, &rows)
}

/// What one run measured: every sample and the notes beside the table.
struct Measured {
    machine: String,
    samples: Vec<Sample>,
    notes: Vec<String>,
    /// The per-stage cost table (BPF_PROG_TEST_RUN), measured in this run.
    stages: Option<String>,
}

/// Builds every path and measures every workload on it, interleaved.
fn measure(o: &Opts) -> Result<Measured> {
    let reps = o.reps as usize;
    let dur = Duration::from_secs(u64::from(o.secs));
    let rounds = if o.quick { 200 } else { 5000 };
    let pods_for_add = if o.quick { 10 } else { 100 };
    let machine = format!(
        "{} vCPU, kernel {}",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        std::fs::read_to_string("/proc/sys/kernel/osrelease")?.trim()
    );
    eprintln!(
        "bench: building {} paths through real CNI calls...",
        PATHS.len()
    );
    let benches: Vec<Bench> = PATHS
        .iter()
        .map(|p| Bench::new(*p))
        .collect::<Result<_>>()?;
    let mut samples: Vec<Sample> = Vec::new();
    let mut push = |w: &str, path: &str, rep: usize, value: f64| {
        eprintln!("  rep {rep} {path:16} {w:24} {value:.3}");
        samples.push(Sample {
            workload: w.into(),
            path: path.into(),
            rep,
            value,
        });
    };
    let pinned_nodes: Vec<Bench> = PINNED_CPUMAP
        .iter()
        .map(|p| Bench::new(*p))
        .collect::<Result<_>>()?;
    // The pinned-sender workload: ptp and the devmap paths beside the cpumap
    // paths whose destination CPU is CPU 1.
    let pinned: Vec<&Bench> = benches
        .iter()
        .filter(|b| {
            b.spec.kind == Kind::Ptp
                || matches!(b.spec.kind, Kind::Xdpcni { mode, redirect: "devmap", .. } if mode != "off")
        })
        .chain(pinned_nodes.iter())
        .collect();
    let all_cpus = every_cpu();
    let direct = Bench::new(DIRECT)?;
    let mut extra = Vec::new();
    let mut pinned_busy: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut profile_lines = Vec::new();
    // e2e/bench/profile.sh starts perf on this line.
    eprintln!("bench: nodes ready, measuring");
    for rep in 0..reps {
        let order: Vec<&Bench> = rep_order(&benches, rep)
            .into_iter()
            .filter(|b| o.path_on(b))
            .collect();
        // The floor rows: the socket-to-socket workloads with no forwarding.
        let with_floor: Vec<&Bench> = order
            .iter()
            .copied()
            .chain(Some(&direct).filter(|b| o.path_on(b)))
            .collect();
        if o.workload(W_UDP64) {
            for b in &with_floor {
                push(W_UDP64, b.spec.label, rep, pps(b, 22, dur)? / 1e6);
            }
        }
        if o.workload(W_UDP1400) {
            for b in &with_floor {
                push(W_UDP1400, b.spec.label, rep, pps(b, 1400, dur)? / 1e6);
            }
        }
        if o.workload(W_TCP) {
            for b in &with_floor {
                push(W_TCP, b.spec.label, rep, tcp(b, o.secs)?);
            }
        }
        if o.workload(W_UDP_P50) || o.workload(W_UDP_P99) {
            for b in &with_floor {
                let mut rtts = latency(b, rounds)?;
                push(W_UDP_P50, b.spec.label, rep, percentile(&mut rtts, 0.5));
                push(W_UDP_P99, b.spec.label, rep, percentile(&mut rtts, 0.99));
            }
        }
        if o.workload(W_TCP_P50) || o.workload(W_TCP_P99) {
            for b in &with_floor {
                check_interrupt()?;
                let to = SocketAddr::new(b.ips[1], port());
                let mut rtts = tcp_rr(&b.pods[0], &b.pods[1], to, rounds, 100)?;
                push(W_TCP_P50, b.spec.label, rep, percentile(&mut rtts, 0.5));
                push(W_TCP_P99, b.spec.label, rep, percentile(&mut rtts, 0.99));
            }
        }
        if o.workload(W_FWD_XDP) {
            // A packet bpf_redirect_peer hands to the pod's eth0 enters its
            // receive path past the veth's (native) XDP hook: no XDP sink
            // sees it, so the peer paths (xdpcni tc and Cilium's) have no
            // row here: consuming in XDP is what native XDP is for.
            for b in order
                .iter()
                .filter(|b| b.spec.label != PEER_PATH && b.spec.label != TC_PATH)
            {
                let r = fwd(b, Sink::XdpDrop, &all_cpus, dur)?;
                push(W_FWD_XDP, b.spec.label, rep, r.rate / 1e6);
            }
        }
        if o.workload(W_FWD_RAW) {
            for b in &order {
                let r = fwd(b, Sink::RawTable, &all_cpus, dur)?;
                push(W_FWD_RAW, b.spec.label, rep, r.rate / 1e6);
            }
        }
        if o.workload(W_PROG_NS) {
            // One sample per repetition, among the others: a slow phase of
            // the machine does not land on all of them. Every fast path, and
            // Cilium's program beside tc: what the shared checks cost.
            for b in order
                .iter()
                .filter(|b| XDP_PATHS.contains(&b.spec.label) || b.spec.label == PEER_PATH)
            {
                let (line, ns) = profile(b, dur)?;
                push(W_PROG_NS, b.spec.label, rep, ns);
                profile_lines.push(line);
            }
        }
        if o.workload(W_PINNED) {
            let pinned: Vec<&Bench> = pinned.iter().copied().filter(|b| o.path_on(b)).collect();
            for b in rep_order(&pinned, rep).into_iter().copied() {
                let r = fwd(b, Sink::RawTable, &[Some(0)], dur)?;
                push(W_PINNED, b.spec.label, rep, r.rate / 1e6);
                // CPU 1's busy time per delivered frame: where the receive
                // work went (the sender keeps CPU 0 busy on every path).
                let cpu1 = r.busy.get(1).copied().unwrap_or(0.0);
                pinned_busy
                    .entry(b.spec.label)
                    .or_default()
                    .extend([r.busy.first().copied().unwrap_or(0.0), cpu1]);
            }
        }
    }
    for (label, v) in &pinned_busy {
        let n = (v.len() / 2).max(1) as f64;
        let cpu0 = v.iter().step_by(2).sum::<f64>() / n;
        let cpu1 = v.iter().skip(1).step_by(2).sum::<f64>() / n;
        extra.push(format!(
            "pinned sender, {label}: CPU 0 {:.0}% busy, CPU 1 {:.0}% busy (mean over repetitions)",
            cpu0 * 100.0,
            cpu1 * 100.0
        ));
    }
    // CNI ADD latency: ptp, xdpcni with the agent's default off and native
    // (ADD attaches nothing: the agent does, measured from ADD's return).
    for spec in [PATHS[0], PATHS[1], PATHS[2]]
        .into_iter()
        .filter(|_| o.full())
    {
        let (mut ms, mut attached) = add_latency(spec, pods_for_add)?;
        push(W_ADD_P50, spec.label, 0, percentile(&mut ms, 0.5));
        push(W_ADD_P99, spec.label, 0, percentile(&mut ms, 0.99));
        if !attached.is_empty() {
            push(W_ATTACH_P50, spec.label, 0, percentile(&mut attached, 0.5));
            push(W_ATTACH_P99, spec.label, 0, percentile(&mut attached, 0.99));
        }
    }
    // The ceiling and the headroom effect, on their own nodes.
    if o.full() {
        let headroom0 = Bench::new(PathSpec {
            label: HEADROOM_0,
            kind: Kind::Xdpcni {
                mode: "native",
                redirect: "devmap",
                headroom: 0,
                cpus: None,
                defaults: false,
                peer: false,
            },
        })?;
        let native = &benches[2];
        for rep in 0..reps {
            // Measured again beside headroom 0, a row of its own: the two
            // are compared in the same minutes.
            push(W_UDP64, HEADROOM_PAIR, rep, pps(native, 22, dur)? / 1e6);
            push(
                W_UDP64,
                headroom0.spec.label,
                rep,
                pps(&headroom0, 22, dur)? / 1e6,
            );
        }
        let hr = |b: &Bench| -> Result<String> {
            let v = b.record()?;
            Ok(format!(
                "requested {}, effective {}",
                v["headroomRequested"], v["headroomEffective"]
            ))
        };
        extra.push(format!("headroom 256 path: {}", hr(native)?));
        extra.push(format!("headroom 0 path: {}", hr(&headroom0)?));
        let ceiling_node = Bench::new(PATHS[2])?;
        for rep in 0..reps {
            for (label, mode) in CEILINGS {
                push(
                    W_CEILING,
                    label,
                    rep,
                    ceiling(&ceiling_node, 22, dur, *mode)? / 1e6,
                );
            }
        }
    }
    if o.any(&[
        W_NP_APPLY_P50,
        W_NP_APPLY_P99,
        W_NP_REMOVE_P50,
        W_NP_REMOVE_P99,
        W_NP_FWD,
    ]) {
        eprintln!("bench: NetworkPolicy on a Kubernetes node (API server, agent)...");
        netpol_bench(reps, dur, &mut push, &mut extra)?;
    }
    if o.any(&[W_MIGRATE, W_MIGRATE_READY]) {
        eprintln!("bench: datapath migration from the previous release...");
        let path = migration_bench(reps, pods_for_add, &mut push)?;
        extra.push(format!(
            "migration: the previous release ({}) pinned layout {} with {path}; each repetition a fresh node",
            std::fs::read_to_string("e2e/k8s/PREVIOUS_RELEASE")
                .unwrap_or_default()
                .lines()
                .filter(|l| !l.starts_with('#'))
                .collect::<String>()
                .trim(),
            xdpcni_ebpf::PREVIOUS_LAYOUT,
        ));
    }
    if o.any(&[W_SVC_TCP, W_SVC_UDP64, W_SVC_RR, W_SVC_HOST_RR]) {
        eprintln!("bench: Services on a Kubernetes node (ClusterIP, pod IP, kube-proxy's path)...");
        services_bench(reps, o.secs, rounds, &mut push, &mut extra)?;
    }
    if o.any(&[W_NS_TCP, W_NS_UDP64, W_NS_RR]) {
        eprintln!(
            "bench: north-south, a NodePort from outside (the uplink's program, kube-proxy)..."
        );
        north_south_bench(reps, o.secs, rounds, &mut push, &mut extra)?;
    }
    if o.any(&[
        W_NPF_TCP,
        W_NPF_UDP64,
        W_NPF_RR,
        W_NPF_SCALE,
        W_NPF_PROG,
        W_NPF_CLOSE_P50,
        W_NPF_CLOSE_P99,
        W_NPF_OPEN_P50,
        W_NPF_OPEN_P99,
    ]) {
        eprintln!("bench: NetworkPolicy on the fast path (fast, kernel, no policy; 1-1000 policies; updates)...");
        policy_fast_bench(reps, o.secs, rounds, &mut push, &mut extra)?;
    }
    if o.any(&[W_XNODE_TCP, W_XNODE_UDP64, W_XNODE_RR, W_XNODE_HOST]) {
        eprintln!("bench: TCP across nodes (hostGateway, vxlan) on two nodes with agents...");
        xnode_bench(reps, o.secs, rounds, &mut push, &mut extra)?;
    }
    extra.append(&mut profile_lines);
    // The program's cost stage by stage, on fixed frames: what the
    // bpf_stats rows add up to, and what each check costs.
    let stages = if o.workload(W_STAGES) {
        eprintln!("bench: the datapath's cost per stage (BPF_PROG_TEST_RUN)...");
        let (samples, repeat) = if o.quick { (5, 50) } else { (101, 200) };
        Some(xdpcni_e2e::cost::measure(samples, repeat)?.table())
    } else {
        None
    };
    // Make sure the fast paths really redirected (the peer path is checked
    // when it is attached: the kernel forwards none of its pings).
    for b in benches
        .iter()
        .chain(pinned_nodes.iter())
        .filter(|b| matches!(b.spec.kind, Kind::Xdpcni { mode, peer: false, .. } if mode != "off"))
        .filter(|_| o.full())
    {
        let maps = Maps::open_pinned(b._pins.path())?;
        let idx = b.net.node.ifindex(&b.hosts[0])?;
        let c = maps.counters(idx)?;
        // Devmap, cpumap or (tc) the peer: every forward verdict.
        let redirected = c.forwarded();
        ensure!(
            redirected > 0,
            "{}: nothing was redirected: {c:?}",
            b.spec.label
        );
        extra.push(format!(
            "{}: {redirected} packets redirected by XDP from pod 0",
            b.spec.label
        ));
    }
    Ok(Measured {
        machine,
        samples,
        notes: extra,
        stages,
    })
}

/// One row of the table: a workload on a path, over its repetitions.
struct Row {
    workload: &'static str,
    unit: &'static str,
    path: String,
    median: f64,
    min: f64,
    max: f64,
    /// To ptp's median, > 1 better; `None` without a ptp figure.
    ratio: Option<f64>,
}

/// Medians (min-max) of every workload on every path, in table order, with
/// the ratio to ptp measured in the same run.
fn summarise(samples: &[Sample]) -> Vec<Row> {
    let mut groups: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    for s in samples {
        groups
            .entry((s.workload.clone(), s.path.clone()))
            .or_default()
            .push(s.value);
    }
    let mut rows = Vec::new();
    for (w, unit, higher) in WORKLOADS {
        let base = groups
            .get(&(w.to_string(), PATHS[0].label.to_string()))
            .map(|v| median(&mut v.clone()));
        let mut paths: Vec<String> = PATHS.iter().map(|p| p.label.to_string()).collect();
        paths.extend(PINNED_CPUMAP.iter().map(|p| p.label.to_string()));
        paths.push(DIRECT.label.into());
        paths.push(HEADROOM_PAIR.into());
        paths.push(HEADROOM_0.into());
        paths.extend(CEILINGS.iter().map(|c| c.0.to_string()));
        paths.extend([NP_AGENT, NP_NONE, NP_100].map(String::from));
        paths.extend([SVC_CLUSTERIP, SVC_PODIP, SVC_KUBEPROXY].map(String::from));
        // Paths named at run time (the migration's pod count).
        let named: Vec<String> = groups
            .keys()
            .filter(|(gw, gp)| gw == w && !paths.contains(gp))
            .map(|(_, gp)| gp.clone())
            .collect();
        paths.extend(named);
        for p in paths {
            let Some(v) = groups.get(&(w.to_string(), p.clone())) else {
                continue;
            };
            let mut v = v.clone();
            let m = median(&mut v);
            let ratio = match base {
                Some(b) if b > 0.0 && m > 0.0 => Some(if *higher { m / b } else { b / m }),
                _ => None,
            };
            rows.push(Row {
                workload: w,
                unit,
                path: p,
                median: m,
                min: v[0],
                max: v[v.len() - 1],
                ratio,
            });
        }
    }
    rows
}

/// Prints the table, the notes and the target lines, and writes bench.md,
/// bench.json and bench.png under `--out`.
fn report(o: &Opts, run: &Measured, rows: &[Row]) -> Result<()> {
    let medians: BTreeMap<(String, String), f64> = rows
        .iter()
        .map(|r| ((r.workload.to_string(), r.path.clone()), r.median))
        .collect();
    let mut table = String::new();
    table.push_str(&format!(
        "Machine: {}. {} repetitions x {} s per figure, medians (min-max); vs ptp > 1x is better.\n\n",
        run.machine, o.reps, o.secs
    ));
    table.push_str(
        "| workload | path | median | min-max | vs ptp |\n| --- | --- | ---: | ---: | ---: |\n",
    );
    let mut summary = Vec::new();
    for r in rows {
        let ratio = r
            .ratio
            .map_or_else(|| "-".to_string(), |x| format!("{x:.2}x"));
        table.push_str(&format!(
            "| {} | {} | {:.3} {} | {:.3}-{:.3} | {ratio} |\n",
            r.workload, r.path, r.median, r.unit, r.min, r.max
        ));
        summary.push(json!({"workload": r.workload, "unit": r.unit, "path": r.path, "median": r.median, "min": r.min, "max": r.max, "ratio": ratio}));
    }
    if let Some(stages) = &run.stages {
        table.push_str(&format!("\n{W_STAGES}:\n\n{stages}"));
    }
    let mut targets = targets(&medians);
    with_ranges(&mut targets, &run.samples, o.reps as usize);
    if !o.full() {
        table.push_str(
            "\nA partial run (--only or --path): its target lines decide nothing; one full run of every row does.\n",
        );
    }
    table.push_str(&report_tail(&run.notes, &targets));
    let targets: Vec<Value> = targets.iter().map(Target::json).collect();
    let doc = json!({ "machine": run.machine, "reps": o.reps, "secs": o.secs, "quick": o.quick, "summary": summary, "samples": run.samples, "notes": run.notes, "targets": targets });
    write_report(&o.out, "bench", &table, &doc, "plot.py")?;
    Ok(())
}

/// Each target computed again from each repetition's figures alone (a row
/// measured once gives its one figure to every repetition): the target's
/// min-max over the run, appended to what it compares.
fn with_ranges(targets: &mut [Target], samples: &[Sample], reps: usize) {
    let per_rep: Vec<Vec<Target>> = (0..reps)
        .map(|rep| {
            let mut m: BTreeMap<(String, String), f64> = BTreeMap::new();
            for s in samples {
                let key = (s.workload.clone(), s.path.clone());
                if s.rep == rep || !m.contains_key(&key) {
                    m.insert(key, s.value);
                }
            }
            self::targets::targets(&m)
        })
        .collect();
    for (i, t) in targets.iter_mut().enumerate() {
        let v: Vec<f64> = per_rep.iter().filter_map(|r| r[i].value).collect();
        let (lo, hi) = v
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        if !v.is_empty() {
            t.what += &format!(" (per repetition {lo:.2}-{hi:.2}, {} repetitions)", v.len());
        }
    }
}

/// The order of the paths in one repetition: every path once, starting from
/// a different one each repetition so none always goes first, and backwards
/// in every other repetition so that no path always runs just before the
/// same neighbour (a path measured right after another can inherit its
/// leftovers: the paired ratios would carry that bias).
fn rep_order<T>(paths: &[T], rep: usize) -> Vec<&T> {
    let n = paths.len();
    let mut order: Vec<&T> = (0..n).map(|i| &paths[(i + rep / 2) % n]).collect();
    if rep % 2 == 1 {
        order.reverse();
    }
    order
}

#[cfg(test)]
mod tests {
    use super::rep_order;

    #[test]
    fn every_path_runs_once_per_repetition_and_each_pair_in_both_orders() {
        let paths = [0, 1, 2, 3, 4];
        let mut before = [[0usize; 5]; 5];
        for rep in 0..10 {
            let order: Vec<usize> = rep_order(&paths, rep).into_iter().copied().collect();
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(sorted, paths, "repetition {rep}: {order:?}");
            for w in order.windows(2) {
                before[w[0]][w[1]] += 1;
            }
        }
        for (a, row) in before.iter().enumerate() {
            for (b, n) in row.iter().enumerate() {
                assert_eq!(
                    *n, before[b][a],
                    "{a} just before {b} as often as {b} just before {a}"
                );
            }
        }
        // The first path differs between consecutive pairs of repetitions.
        assert_ne!(rep_order(&paths, 0)[0], rep_order(&paths, 2)[0]);
    }
}
