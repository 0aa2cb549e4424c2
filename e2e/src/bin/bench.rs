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

use anyhow::{bail, ensure, Context, Result};
use serde::Serialize;
use serde_json::{json, Value};
use xdpcni_e2e::{
    agent::{wait_mode, StandaloneAgent},
    cni::{Call, Network, REFERENCE_PLUGINS},
    in_netns,
    measure::{
        busy_between, cpu_times, frame_between, median, percentile, raw_sink_rate, report_tail,
        rx_packets, write_report, BpfStats, Fwd, Op, Target,
    },
    netns::Netns,
    traffic::{raw_flood, tcp_rr, udp_flood},
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

/// One unpinned sender thread per CPU.
fn every_cpu() -> Vec<Option<usize>> {
    vec![None; std::thread::available_parallelism().map_or(1, |n| n.get())]
}

fn port() -> u16 {
    NEXT_PORT.fetch_add(1, Ordering::Relaxed)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Ptp,
    /// No CNI and no forwarding: the two pods share one veth pair. The floor
    /// any path through a node can approach, not a path a CNI could offer.
    Direct,
    Xdpcni {
        mode: &'static str,
        redirect: &'static str,
        headroom: u16,
        /// `cpus` of the CNI config (cpumap CPUs), None: the default.
        cpus: Option<&'static str>,
        /// Leave mode and redirect out of the config: the CNI's defaults,
        /// checked against `mode`/`redirect` from the attachment record.
        defaults: bool,
        /// Cilium's same-node technique on the pods (mode `off`): a tc
        /// ingress program on each host veth redirecting to the peer.
        peer: bool,
    },
}

#[derive(Clone, Copy, Debug)]
struct PathSpec {
    label: &'static str,
    kind: Kind,
}

const fn xdp(label: &'static str, mode: &'static str, redirect: &'static str) -> PathSpec {
    PathSpec {
        label,
        kind: Kind::Xdpcni {
            mode,
            redirect,
            headroom: 256,
            cpus: None,
            defaults: false,
            peer: false,
        },
    }
}

/// The node default (what a pod without annotations gets): the agent's own
/// default mode, which `Bench::new` checks from what the agent attached.
const DEFAULT_PATH: &str = TC_PATH;

/// The pinned-sender workload's cpumap paths: the destination's cpumap CPU
/// is CPU 1, the sender is pinned to CPU 0.
const PINNED_CPUMAP: &[PathSpec] = &[
    PathSpec {
        label: "native cpumap, cpus 1",
        kind: Kind::Xdpcni {
            mode: "native",
            redirect: "cpumap",
            headroom: 256,
            cpus: Some("1"),
            defaults: false,
            peer: false,
        },
    },
    PathSpec {
        label: "generic cpumap, cpus 1",
        kind: Kind::Xdpcni {
            mode: "generic",
            redirect: "cpumap",
            headroom: 256,
            cpus: Some("1"),
            defaults: false,
            peer: false,
        },
    },
];

const PATHS: &[PathSpec] = &[
    PathSpec {
        label: "ptp (baseline)",
        kind: Kind::Ptp,
    },
    xdp("xdpcni off", "off", "devmap"),
    xdp("native devmap", "native", "devmap"),
    xdp("native cpumap", "native", "cpumap"),
    xdp("generic devmap", "generic", "devmap"),
    xdp("generic cpumap", "generic", "cpumap"),
    PathSpec {
        label: DEFAULT_PATH,
        kind: Kind::Xdpcni {
            mode: "tc",
            redirect: "devmap",
            headroom: 256,
            cpus: None,
            defaults: true,
            peer: false,
        },
    },
    PathSpec {
        label: PEER_PATH,
        kind: Kind::Xdpcni {
            mode: "off",
            redirect: "devmap",
            headroom: 256,
            cpus: None,
            defaults: false,
            peer: true,
        },
    },
];

/// xdpcni's tc mode: the datapath's decisions on tcx ingress, delivered
/// with bpf_redirect_peer.
const TC_PATH: &str = "xdpcni tc";

/// Cilium's same-node technique as a reference path: tc ingress and
/// `bpf_redirect_peer` on the host veths of CNI-made pods in mode `off`
/// (bench.bpf.c's `tc_redirect_peer`).
const PEER_PATH: &str = "tc redirect_peer (Cilium's same-node technique)";

/// A node of two pods made through real CNI calls (and, for xdpcni, the
/// real agent that attaches their fast path), torn down on Drop.
struct Bench {
    spec: PathSpec,
    net: Network,
    _pins: PinDir,
    pods: Vec<Netns>,
    ips: Vec<IpAddr>,
    hosts: Vec<String>,
    conf_patch: Value,
    agent: Option<StandaloneAgent>,
    /// The tc program of the peer path, attached while it lives.
    peer: Option<PeerRedirect>,
}

const DIRECT: PathSpec = PathSpec {
    label: "direct veth (no forwarding)",
    kind: Kind::Direct,
};

fn cni_conf(spec: PathSpec, net: &mut Network) -> Value {
    match spec.kind {
        Kind::Direct => json!({}),
        Kind::Ptp => {
            net.plugin = Path::new(REFERENCE_PLUGINS).join("ptp");
            net.conf["type"] = json!("ptp");
            json!({})
        }
        Kind::Xdpcni { headroom, .. } => json!({ "headroom": headroom }),
    }
}

/// The agent's node defaults for an xdpcni path (none: its own defaults).
fn agent_conf(spec: PathSpec) -> Value {
    match spec.kind {
        Kind::Xdpcni {
            mode,
            redirect,
            cpus,
            defaults,
            ..
        } => {
            let mut c = json!({});
            if !defaults {
                c["xdpMode"] = json!(mode);
                c["redirect"] = json!(redirect);
            }
            if let Some(cpus) = cpus {
                c["cpus"] = json!(cpus);
            }
            c
        }
        Kind::Direct | Kind::Ptp => Value::Null,
    }
}

impl Bench {
    fn new(spec: PathSpec) -> Result<Self> {
        let pins = PinDir::new("xb")?;
        let mut net = Network::new(pins.path(), "1.0.0", json!([[{"subnet": "10.78.0.0/24"}]]))?;
        let conf_patch = cni_conf(spec, &mut net);
        // The agent loads the datapath and attaches the pods' fast path.
        let agent = match spec.kind {
            Kind::Xdpcni { .. } => {
                Some(StandaloneAgent::start(&net, pins.path(), agent_conf(spec))?)
            }
            Kind::Direct | Kind::Ptp => None,
        };
        let mut b = Self {
            spec,
            net,
            _pins: pins,
            pods: Vec::new(),
            ips: Vec::new(),
            hosts: Vec::new(),
            conf_patch,
            agent,
            peer: None,
        };
        if spec.kind == Kind::Direct {
            b.direct()?;
            return Ok(b);
        }
        for i in 0..2 {
            let pod = Netns::new("xp")?;
            let id = format!("bench{i}");
            let out = b
                .net
                .call(&Call::new("ADD", &id, Some(&pod.path())), &b.conf_patch)?;
            ensure!(out.status == 0, "{} ADD: {}", spec.label, out.json);
            let ip: IpAddr = out.json["ips"][0]["address"]
                .as_str()
                .and_then(|a| a.split('/').next())
                .context("no ip")?
                .parse()?;
            b.hosts.push(
                out.json["interfaces"][0]["name"]
                    .as_str()
                    .unwrap_or("")
                    .into(),
            );
            b.ips.push(ip);
            b.pods.push(pod);
        }
        if let Kind::Xdpcni {
            mode,
            redirect,
            peer,
            ..
        } = spec.kind
        {
            // Both pods in the path's mode, as the agent attached them (for
            // the default path: what the agent does by default).
            let want = match mode {
                "native" => "xdp",
                "generic" => "xdpgeneric",
                "tc" => "tc",
                _ => "none",
            };
            for h in &b.hosts {
                wait_mode(&b.net.node, h, want, Duration::from_secs(5)).with_context(|| {
                    format!(
                        "{}: the agent's mode is not {mode} (update DEFAULT_PATH if its default changed): {}",
                        spec.label,
                        b.agent.as_ref().map(StandaloneAgent::log).unwrap_or_default()
                    )
                })?;
            }
            let maps = Maps::open_pinned(b._pins.path())?;
            let start = Instant::now();
            loop {
                let ep = maps.endpoint(b.ips[1])?;
                if ep.is_some_and(|e| {
                    e.redirect == RedirectPolicy::parse(redirect).map_or(0, |r| r.as_raw())
                }) {
                    break;
                }
                ensure!(
                    start.elapsed() < Duration::from_secs(5),
                    "{}: the agent did not register {} for {redirect}",
                    spec.label,
                    b.ips[1]
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            // Attached and pinned: the agent has nothing left to do here
            // and its passes would share the CPUs measured (and put back
            // what the ceiling swaps out).
            if let Some(agent) = b.agent.take() {
                agent.stop(libc::SIGTERM)?;
            }
            if peer {
                b.peer = Some(PeerRedirect::attach(&b)?);
            }
        }
        Ok(b)
    }
}

impl Bench {
    /// Two pods joined by one veth pair (eth0 on both sides), 10.79.0.1/.2.
    fn direct(&mut self) -> Result<()> {
        let (a, b) = (Netns::new("xp")?, Netns::new("xp")?);
        a.add_veth("eth0", "eth0", Some(&b))?;
        for (ns, ip) in [(&a, "10.79.0.1"), (&b, "10.79.0.2")] {
            ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
            ns.ip(&["link", "set", "eth0", "up"])?;
            ns.ip(&["link", "set", "lo", "up"])?;
            self.ips.push(ip.parse()?);
        }
        self.pods = vec![a, b];
        Ok(())
    }

    /// An attachment record of this node's CNI (both pods share a policy).
    fn record(&self) -> Result<Value> {
        let rec = std::fs::read_dir(self.net.dir.path().join("state"))?
            .flatten()
            .find(|e| e.path().extension().is_some_and(|x| x == "json"))
            .context("no attachment record")?;
        Ok(serde_json::from_slice(&std::fs::read(rec.path())?)?)
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        if self.spec.kind == Kind::Direct {
            return; // the pods' Drop deletes the namespaces and the veth
        }
        for (i, pod) in self.pods.iter().enumerate() {
            let id = format!("bench{i}");
            let _ = self
                .net
                .call(&Call::new("DEL", &id, Some(&pod.path())), &self.conf_patch);
        }
    }
}

/// Packets per second delivered to pod 1's eth0 from pod 0's flood.
fn pps(b: &Bench, payload: usize, dur: Duration) -> Result<f64> {
    check_interrupt()?;
    let to = SocketAddr::new(b.ips[1], port());
    // A bound socket that is never read: datagrams are delivered (and then
    // dropped at the full socket) without ICMP port-unreachable replies.
    let sink = in_netns(&b.pods[1], || Ok(UdpSocket::bind(to)?))?;
    let before = rx_packets(&b.pods[1])?;
    let start = Instant::now();
    let sent = udp_flood(&b.pods[0], to, payload, &every_cpu(), dur)?;
    let elapsed = start.elapsed();
    std::thread::sleep(Duration::from_millis(100));
    let delivered = rx_packets(&b.pods[1])? - before;
    drop(sink);
    ensure!(sent > 0, "nothing sent");
    Ok(delivered as f64 / elapsed.as_secs_f64())
}

/// Where the forwarding workload's frames end, at the same cost on every
/// path so that only the forwarding in between differs.
#[derive(Clone, Copy, Debug)]
enum Sink {
    /// An XDP program on the destination pod's eth0 that drops every frame
    /// (counted by the program, as the veth's `xdp_drops` counts them).
    XdpDrop,
    /// An iptables raw-table DROP in the destination pod (counted from
    /// eth0's rx_packets, which the frame passes first).
    RawTable,
}

/// A 64-byte UDP frame from pod 0 to pod 1 as pod 0's eth0 would put it on
/// the wire: to the host veth's MAC (the pod's gateway), valid IPv4 header.
fn fwd_frame(b: &Bench) -> Result<Vec<u8>> {
    frame_between(&b.net.node, &b.hosts[0], &b.pods[0], b.ips[0], b.ips[1])
}

/// Frames per second that reached `sink` in pod 1 while pod 0's raw sender
/// ran with one thread per entry of `cpus`.
fn fwd(b: &Bench, sink: Sink, cpus: &[Option<usize>], dur: Duration) -> Result<Fwd> {
    check_interrupt()?;
    let frame = fwd_frame(b)?;
    let r = match sink {
        Sink::XdpDrop => {
            let eth0 = b.pods[1].ifindex("eth0")?;
            let sink = in_netns(&b.pods[1], || {
                DropSink::attach(eth0, aya::programs::XdpMode::Driver)
            })?;
            let before = sink.dropped()?;
            let t0 = cpu_times()?;
            let start = Instant::now();
            raw_flood(&b.pods[0], "eth0", &frame, cpus, dur)?;
            let busy = busy_between(&t0, &cpu_times()?);
            std::thread::sleep(Duration::from_millis(100));
            let rate = (sink.dropped()? - before) as f64 / start.elapsed().as_secs_f64();
            drop(sink);
            Fwd { rate, busy }
        }
        Sink::RawTable => raw_sink_rate(&b.pods[0], &b.pods[1], &frame, cpus, dur)?,
    };
    ensure!(
        r.rate > 0.0,
        "{}: nothing reached the {sink:?} sink",
        b.spec.label
    );
    Ok(r)
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One iperf3 TCP stream from pod 0 to pod 1, Gbit/s.
fn tcp(b: &Bench, secs: u32) -> Result<f64> {
    iperf(&b.pods[0], &b.pods[1], b.ips[1], secs)
}

/// One iperf3 TCP stream from `from` to `to` (at `ip`), Gbit/s.
fn iperf(from: &Netns, to: &Netns, ip: IpAddr, secs: u32) -> Result<f64> {
    check_interrupt()?;
    let p = port().to_string();
    let ip = ip.to_string();
    let _server = KillOnDrop(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                to.name(),
                "iperf3",
                "-s",
                "-1",
                "-B",
                &ip,
                "-p",
                &p,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let mut out = String::new();
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(50));
        match from.exec(&["iperf3", "-c", &ip, "-p", &p, "-t", &secs.to_string(), "-J"]) {
            Ok(o) => {
                out = o;
                break;
            }
            Err(e) if e.to_string().contains("Connection refused") => continue,
            Err(e) => return Err(e),
        }
    }
    let v: Value = serde_json::from_str(&out).context("iperf3 JSON")?;
    let bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .with_context(|| {
            format!(
                "iperf3 {} -> {ip}: no result ({})",
                from.name(),
                v["error"].as_str().unwrap_or("no error given")
            )
        })?;
    Ok(bps / 1e9)
}

/// UDP ping-pong from pod 0 to an echo in pod 1: RTTs in microseconds.
fn latency(b: &Bench, rounds: usize) -> Result<Vec<f64>> {
    check_interrupt()?;
    let to = SocketAddr::new(b.ips[1], port());
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = &stop;
        let server = s.spawn(move || {
            in_netns(&b.pods[1], || {
                // Busy-polling on both ends: on a VM, a sleeping receiver's
                // wake-up (vCPU halt and IPI, tens of us) would dominate the
                // round trip and hide the path being measured.
                let sock = UdpSocket::bind(to)?;
                sock.set_nonblocking(true)?;
                tx.send(())?;
                let mut buf = [0u8; 64];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((n, peer)) = sock.recv_from(&mut buf) {
                        sock.send_to(&buf[..n], peer)?;
                    }
                }
                Ok(())
            })
        });
        rx.recv_timeout(Duration::from_secs(5))?;
        let rtts = in_netns(&b.pods[0], || {
            let sock = UdpSocket::bind("0.0.0.0:0")?;
            sock.connect(to)?;
            sock.set_nonblocking(true)?;
            let mut buf = [0u8; 64];
            let msg = [7u8; 22];
            let mut rtts = Vec::with_capacity(rounds);
            for i in 0..rounds + 100 {
                let t = Instant::now();
                sock.send(&msg)?;
                loop {
                    match sock.recv(&mut buf) {
                        Ok(_) => break,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            ensure!(t.elapsed() < Duration::from_secs(1), "echo {i} lost");
                            std::hint::spin_loop();
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                if i >= 100 {
                    rtts.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            Ok(rtts)
        });
        stop.store(true, Ordering::Relaxed);
        server
            .join()
            .map_err(|_| anyhow::anyhow!("echo server panicked"))??;
        rtts
    })
}

/// ADD latency in ms over `n` pods on a fresh node of this path (then
/// DEL), and for xdpcni, with its agent running, how long after each ADD
/// returned the agent had the pod on its fast path (the record wakes it).
fn add_latency(spec: PathSpec, n: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let pins = PinDir::new("xa")?;
    let mut net = Network::new(pins.path(), "1.0.0", json!([[{"subnet": "10.77.0.0/16"}]]))?;
    let patch = cni_conf(spec, &mut net);
    let want = match spec.kind {
        Kind::Xdpcni { mode: "native", .. } => "xdp",
        Kind::Xdpcni {
            mode: "generic", ..
        } => "xdpgeneric",
        Kind::Xdpcni { mode: "tc", .. } => "tc",
        _ => "none",
    };
    let agent = match spec.kind {
        Kind::Xdpcni { .. } => Some(StandaloneAgent::start(&net, pins.path(), agent_conf(spec))?),
        Kind::Direct | Kind::Ptp => None,
    };
    let pods: Vec<Netns> = (0..n).map(|_| Netns::new("xp")).collect::<Result<_>>()?;
    let (mut ms, mut attached) = (Vec::with_capacity(n), Vec::new());
    for (i, pod) in pods.iter().enumerate() {
        check_interrupt()?;
        let id = format!("lat{i}");
        let t = Instant::now();
        let out = net.call(&Call::new("ADD", &id, Some(&pod.path())), &patch)?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        ensure!(out.status == 0, "{} ADD: {}", spec.label, out.json);
        if agent.is_some() && want != "none" {
            let host = out.json["interfaces"][0]["name"]
                .as_str()
                .unwrap_or_default();
            let took = wait_mode(&net.node, host, want, Duration::from_secs(5))?;
            attached.push(took.as_secs_f64() * 1e3);
        }
    }
    for (i, pod) in pods.iter().enumerate() {
        let _ = net.call(
            &Call::new("DEL", &format!("lat{i}"), Some(&pod.path())),
            &patch,
        );
    }
    drop(agent);
    Ok((ms, attached))
}

/// The ceiling: pod 0 floods, and its host veth drops everything in native
/// XDP (a counting drop program instead of the datapath). Packets/s dropped.
fn ceiling(b: &Bench, payload: usize, dur: Duration, mode: aya::programs::XdpMode) -> Result<f64> {
    let host = b.net.node.ifindex(&b.hosts[0])?;
    let pin = b._pins.path().to_path_buf();
    let sink = in_netns(&b.net.node, || {
        let mut dp = Datapath::open_existing(&pin)?;
        dp.raw_detach(host)?;
        DropSink::attach(host, mode)
    })?;
    let before = sink.dropped()?;
    let to = SocketAddr::new(b.ips[1], port());
    let start = Instant::now();
    udp_flood(&b.pods[0], to, payload, &every_cpu(), dur)?;
    Ok((sink.dropped()? - before) as f64 / start.elapsed().as_secs_f64())
}

/// The bench's counting XDP_DROP program (bench.bpf.c) attached to one
/// interface; dropping it detaches and unloads the program.
struct DropSink(aya::Ebpf);

impl DropSink {
    /// Attaches to `ifindex` of the calling thread's namespace.
    fn attach(ifindex: u32, mode: aya::programs::XdpMode) -> Result<Self> {
        let mut ebpf = aya::Ebpf::load(xdpcni_ebpf::BENCH_OBJECT)?;
        let prog: &mut aya::programs::Xdp = ebpf
            .program_mut("xdp_drop_count")
            .context("drop program")?
            .try_into()?;
        prog.load()?;
        prog.attach_to_if_index(ifindex, mode)?;
        Ok(Self(ebpf))
    }

    /// Frames dropped so far, summed over CPUs.
    fn dropped(&self) -> Result<u64> {
        let map = self.0.map("drop_count").context("drop_count")?;
        let arr = aya::maps::PerCpuArray::<_, u64>::try_from(map)?;
        Ok(arr.get(&0, 0)?.iter().sum())
    }
}

/// bench.bpf.c's `tc_redirect_peer` on both host veths of a node (tcx
/// ingress), its map holding both pods; dropping it detaches the program.
struct PeerRedirect {
    /// Held for its Drop, which detaches the program.
    _loaded: aya::Ebpf,
}

impl PeerRedirect {
    fn attach(b: &Bench) -> Result<Self> {
        use aya::programs::{tc::TcAttachType, SchedClassifier};
        use xdpcni_ebpf::abi::{ipv4_key, EndpointInfo};
        let records = xdpcni_host::state::list(&b.net.dir.path().join("state"))?;
        ensure!(records.len() == 2, "{} records, wanted 2", records.len());
        let hosts = b.hosts.clone();
        let loaded = in_netns(&b.net.node, move || {
            let mut ebpf = aya::Ebpf::load(xdpcni_ebpf::BENCH_OBJECT)?;
            let mut map: aya::maps::HashMap<_, u32, EndpointInfo> = ebpf
                .map_mut("peer_endpoints")
                .context("peer_endpoints")?
                .try_into()?;
            for r in &records {
                for ip in &r.ips {
                    if let IpAddr::V4(v4) = ip {
                        let info = EndpointInfo {
                            ifindex: r.host_ifindex,
                            pod_mac: r.pod_mac.0,
                            host_mac: r.host_mac.0,
                            ..Default::default()
                        };
                        map.insert(ipv4_key(*v4), info, 0)?;
                    }
                }
            }
            let prog: &mut SchedClassifier = ebpf
                .program_mut("tc_redirect_peer")
                .context("tc_redirect_peer")?
                .try_into()?;
            prog.load()?;
            for h in &hosts {
                prog.attach(h, TcAttachType::Ingress)
                    .with_context(|| format!("tcx ingress on {h}"))?;
            }
            Ok(Self { _loaded: ebpf })
        })?;
        // The program carries pod-to-pod traffic: pings pass and the node's
        // kernel forwards none of them.
        let forwarded = || -> Result<u64> {
            let snmp = b.net.node.exec(&["cat", "/proc/net/snmp"])?;
            let mut ip = snmp.lines().filter(|l| l.starts_with("Ip:"));
            let (names, values) = (ip.next().context("Ip:")?, ip.next().context("Ip:")?);
            names
                .split_whitespace()
                .zip(values.split_whitespace())
                .find(|(n, _)| *n == "ForwDatagrams")
                .context("no ForwDatagrams")?
                .1
                .parse()
                .map_err(Into::into)
        };
        let before = forwarded()?;
        xdpcni_e2e::traffic::ping(&b.pods[0], b.ips[1], 3)?;
        let after = forwarded()?;
        ensure!(
            after == before,
            "{PEER_PATH}: the kernel forwarded {} packets: the program did not redirect",
            after - before
        );
        Ok(loaded)
    }
}

/// The kernel's record of the program that carries `b`'s pod-to-pod
/// traffic: the datapath's XDP or tc program, or the peer path's.
fn program_info(b: &Bench) -> Result<aya::programs::ProgramInfo> {
    let progs = xdpcni_ebpf::layout_dir(b._pins.path()).join("progs");
    if let Some(peer) = &b.peer {
        return Ok(peer
            ._loaded
            .program("tc_redirect_peer")
            .context("tc_redirect_peer")?
            .info()?);
    }
    Ok(match b.spec.kind {
        Kind::Xdpcni { mode: "tc", .. } => {
            aya::programs::SchedClassifier::from_pin(progs.join(xdpcni_ebpf::TC_FROM_POD_PROGRAM))?
                .info()?
        }
        _ => aya::programs::Xdp::from_pin(
            progs.join(xdpcni_ebpf::FROM_POD_PROGRAM),
            aya_obj::programs::XdpAttachType::Interface,
        )?
        .info()?,
    })
}

/// Where a 64-byte packet's time goes on `b`: the program's own run time
/// per packet (kernel BPF stats) against the CPU time per delivered packet
/// of the whole path (2 CPUs busy / delivered rate).
fn profile(b: &Bench, dur: Duration) -> Result<(String, f64)> {
    let stats = BpfStats::enable()?;
    let before = program_info(b)?;
    let rate = pps(b, 22, dur)?;
    let after = program_info(b)?;
    drop(stats);
    let runs = after.run_count().saturating_sub(before.run_count());
    let ns = after
        .run_time()
        .saturating_sub(before.run_time())
        .as_nanos() as f64;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    ensure!(runs > 0, "the datapath program did not run");
    let per_packet = ns / runs as f64;
    let line = format!(
        "{}: program {per_packet:.0} ns/packet over {runs} runs (bpf_stats); the whole path costs {:.0} ns of CPU per delivered packet ({:.3} Mpps on {cpus} CPUs), so {:.0}% of it is the program",
        b.spec.label,
        cpus * 1e9 / rate,
        rate / 1e6,
        100.0 * per_packet / (cpus * 1e9 / rate),
    );
    Ok((line, per_packet))
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
    /// stream"): for profiling one of them; the report is partial.
    #[arg(long)]
    only: Option<String>,
    /// Only paths whose label contains this (e.g. "generic devmap").
    #[arg(long)]
    path: Option<String>,
}

impl Opts {
    fn workload(&self, w: &str) -> bool {
        self.only.as_deref().is_none_or(|o| w.contains(o))
    }
    fn path_on(&self, b: &Bench) -> bool {
        self.path
            .as_deref()
            .is_none_or(|p| b.spec.label.contains(p))
    }
    fn full(&self) -> bool {
        self.only.is_none() && self.path.is_none()
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

const W_UDP64: &str = "UDP 64-byte frames";
const W_UDP1400: &str = "UDP 1400-byte payload";
const W_TCP: &str = "TCP 1 stream (iperf3)";
const W_UDP_P50: &str = "UDP RTT p50 (busy-poll)";
const W_UDP_P99: &str = "UDP RTT p99 (busy-poll)";
const W_TCP_P50: &str = "TCP RTT p50 (busy-poll)";
const W_TCP_P99: &str = "TCP RTT p99 (busy-poll)";
const W_FWD_XDP: &str = "Forwarding 64-byte, XDP_DROP sink";
const W_FWD_RAW: &str = "Forwarding 64-byte, raw-table sink";
const W_PINNED: &str = "Pinned sender (CPU 0), raw-table sink";
const W_PROG_NS: &str = "Program per packet (bpf_stats)";
const W_ADD_P50: &str = "CNI ADD p50";
const W_ADD_P99: &str = "CNI ADD p99";
const W_ATTACH_P50: &str = "ADD to fast path p50 (agent)";
const W_ATTACH_P99: &str = "ADD to fast path p99 (agent)";
const W_CEILING: &str = "UDP 64-byte XDP-drop ceiling";
const W_NP_APPLY_P50: &str = "NetworkPolicy created -> enforced p50";
const W_NP_APPLY_P99: &str = "NetworkPolicy created -> enforced p99";
const W_NP_REMOVE_P50: &str = "NetworkPolicy deleted -> allowed p50";
const W_NP_REMOVE_P99: &str = "NetworkPolicy deleted -> allowed p99";
const W_NP_FWD: &str = "Forwarding 64-byte, kernel path, raw-table sink";
const W_MIGRATE: &str = "Datapath migration from the previous release";
const W_XNODE_TCP: &str = "TCP 1 stream across nodes (iperf3)";
const W_MIGRATE_READY: &str = "Agent start with a migration, to ready";
/// The headroom rows: native devmap with no headroom asked, and the default
/// native devmap measured again beside it.
const HEADROOM_0: &str = "native devmap, headroom 0";
const HEADROOM_PAIR: &str = "native devmap, beside headroom 0";
/// The NetworkPolicy rows' paths.
const NP_AGENT: &str = "agent (Kubernetes mode), pods on XDP";
const NP_NONE: &str = "kernel path, no policy";
const NP_100: &str = "kernel path, 100 policies";
/// The ceiling rows: the UDP 64-byte sender into an XDP program that only
/// drops, at the host veth, in each mode: no XDP path can deliver more.
const CEILINGS: &[(&str, aya::programs::XdpMode)] = &[
    (
        "sender -> XDP_DROP (native)",
        aya::programs::XdpMode::Driver,
    ),
    ("sender -> XDP_DROP (generic)", aya::programs::XdpMode::Skb),
];

/// (name, unit, higher is better), in table order.
const WORKLOADS: &[(&str, &str, bool)] = &[
    (W_UDP64, "Mpps", true),
    (W_UDP1400, "Mpps", true),
    (W_TCP, "Gbit/s", true),
    (W_UDP_P50, "us", false),
    (W_UDP_P99, "us", false),
    (W_TCP_P50, "us", false),
    (W_TCP_P99, "us", false),
    (W_FWD_XDP, "Mpps", true),
    (W_FWD_RAW, "Mpps", true),
    (W_PINNED, "Mpps", true),
    (W_PROG_NS, "ns", false),
    (W_ADD_P50, "ms", false),
    (W_ADD_P99, "ms", false),
    (W_ATTACH_P50, "ms", false),
    (W_ATTACH_P99, "ms", false),
    (W_CEILING, "Mpps", true),
    (W_NP_APPLY_P50, "ms", false),
    (W_NP_APPLY_P99, "ms", false),
    (W_NP_REMOVE_P50, "ms", false),
    (W_NP_REMOVE_P99, "ms", false),
    (W_NP_FWD, "Mpps", true),
    (W_MIGRATE, "ms", false),
    (W_MIGRATE_READY, "ms", false),
    (W_XNODE_TCP, "Gbit/s", true),
];

const XNODE_HG: &str = "xdpcni hostGateway";
const XNODE_VXLAN: &str = "xdpcni vxlan";
const XNODE_VXLAN_CSUM: &str = "xdpcni vxlan, tx checksum offload off";
const XNODE_SAME: &str = "xdpcni tc, same node";
const XNODE_PTP_CT: &str = "ptp, conntrack on (as on a kube-proxy node)";

/// The fast paths of the main table ("best mode" picks among them).
const XDP_PATHS: &[&str] = &[
    "native devmap",
    "native cpumap",
    "generic devmap",
    "generic cpumap",
    TC_PATH,
];

/// The goals of issue 9, from the medians of this run.
fn targets(m: &BTreeMap<(String, String), f64>) -> Vec<Target> {
    let get = |w: &str, p: &str| m.get(&(w.to_string(), p.to_string())).copied();
    // Ratio to ptp, > 1 is better for both kinds of workload.
    let ratio = |w: &str, p: &str, higher: bool| -> Option<f64> {
        let (v, base) = (get(w, p)?, get(w, PATHS[0].label)?);
        (v > 0.0 && base > 0.0).then(|| if higher { v / base } else { base / v })
    };
    let best = |w: &str, higher: bool| -> (Option<f64>, String) {
        XDP_PATHS
            .iter()
            .filter_map(|p| ratio(w, p, higher).map(|r| (r, *p)))
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map_or((None, "no XDP path measured".into()), |(r, p)| {
                (Some(r), format!("{p} vs ptp"))
            })
    };
    let best_of = |w: &str, paths: &[&str]| -> Option<(f64, String)> {
        paths
            .iter()
            .filter_map(|p| get(w, p).map(|v| (v, p.to_string())))
            .max_by(|a, b| a.0.total_cmp(&b.0))
    };
    let vs = |w: &str, p: &str, q: &str| match (get(w, p), get(w, q)) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let mut out = vec![
        Target {
            name: "tc_vs_peer_udp64",
            value: vs(W_UDP64, TC_PATH, PEER_PATH),
            op: Op::AtLeast,
            goal: 0.97,
            what: format!(
                "{TC_PATH} vs {PEER_PATH}, UDP 64-byte frames: the cost of the shared checks"
            ),
        },
        Target {
            name: "tc_vs_peer_fwd64_raw",
            value: vs(W_FWD_RAW, TC_PATH, PEER_PATH),
            op: Op::AtLeast,
            goal: 0.97,
            what: format!("{TC_PATH} vs {PEER_PATH}, forwarding 64-byte, raw-table sink"),
        },
        Target {
            name: "tc_vs_ptp_tcp",
            value: ratio(W_TCP, TC_PATH, true),
            op: Op::AtLeast,
            goal: 1.0,
            what: format!("{TC_PATH} vs ptp, TCP 1 stream"),
        },
        Target {
            name: "default_vs_best_peer_udp64",
            value: vs(W_UDP64, DEFAULT_PATH, PEER_PATH),
            op: Op::AtLeast,
            goal: 1.0,
            what: format!("{DEFAULT_PATH} (the default) vs {PEER_PATH}, UDP 64-byte frames"),
        },
        Target {
            name: "default_vs_peer_tcp",
            value: vs(W_TCP, DEFAULT_PATH, PEER_PATH),
            op: Op::AtLeast,
            goal: 1.0,
            what: format!("{DEFAULT_PATH} (the default) vs {PEER_PATH}, TCP 1 stream"),
        },
        Target {
            name: "tcp_default",
            value: ratio(W_TCP, DEFAULT_PATH, true),
            op: Op::AtLeast,
            goal: 0.9,
            what: format!("{DEFAULT_PATH} (the default) vs ptp"),
        },
        Target {
            name: "tcp_generic",
            value: ratio(W_TCP, "generic devmap", true),
            op: Op::AtLeast,
            goal: 0.85,
            what: "generic devmap vs ptp".into(),
        },
    ];
    // What bounds a target on this machine, measured in the same run.
    let ceiling = CEILINGS
        .iter()
        .filter_map(|c| get(W_CEILING, c.0).map(|v| (v, c.0)))
        .max_by(|a, b| a.0.total_cmp(&b.0));
    let udp64_bound = ceiling
        .zip(get(W_UDP64, PATHS[0].label))
        .map(|((c, label), base)| {
            format!(
                "; bound: no XDP program at the host veth is fed more than the {label} ceiling, {:.2}x ptp",
                c / base
            )
        })
        .unwrap_or_default();
    let floor = |w: &str, higher: bool| {
        ratio(w, DIRECT.label, higher)
            .map(|r| {
                format!(
                    "; {} (one veth, no hop at all) is {r:.2}x ptp",
                    DIRECT.label
                )
            })
            .unwrap_or_default()
    };
    for (name, w, higher, goal, bound) in [
        ("udp64_best", W_UDP64, true, 1.15, udp64_bound),
        ("fwd64_xdp_sink_best", W_FWD_XDP, true, 1.3, String::new()),
        ("fwd64_raw_sink_best", W_FWD_RAW, true, 1.1, String::new()),
        (
            "rr_p50_best",
            W_UDP_P50,
            false,
            1.1,
            floor(W_UDP_P50, false),
        ),
    ] {
        let (value, what) = best(w, higher);
        out.push(Target {
            name,
            value,
            op: Op::AtLeast,
            goal,
            what: what + &bound,
        });
    }
    out.push(Target {
        name: "prog_ns_redirect",
        value: get(W_PROG_NS, "native devmap"),
        op: Op::AtMost,
        goal: 150.0,
        what: "native devmap, bpf_stats under the UDP 64-byte flood, median of the repetitions"
            .into(),
    });
    let cpumap: Vec<&str> = PINNED_CPUMAP.iter().map(|p| p.label).collect();
    let (c, d) = (
        best_of(W_PINNED, &cpumap),
        best_of(W_PINNED, &["native devmap", "generic devmap"]),
    );
    out.push(Target {
        name: "cpumap_pinned",
        value: c.as_ref().zip(d.as_ref()).map(|(c, d)| c.0 / d.0),
        op: Op::AtLeast,
        goal: 1.1,
        what: match (c, d) {
            (Some(c), Some(d)) => format!("best cpumap ({}) vs best devmap ({})", c.1, d.1),
            _ => "pinned workload missing".into(),
        },
    });
    out
}

/// Samples of each NetworkPolicy latency: 20 per repetition (100 in a
/// full run, where p99 is the 99th of 100; one in `--quick`).
fn latency_rounds(reps: usize) -> usize {
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
fn netpol_bench(
    reps: usize,
    dur: Duration,
    push: &mut dyn FnMut(&str, &str, usize, f64),
    extra: &mut Vec<String>,
) -> Result<()> {
    use std::sync::atomic::AtomicU64;
    use xdpcni_e2e::cluster::KubeNode;
    let node = KubeNode::start(json!({ "xdpMode": "off" }))?;
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
    let base = Instant::now();
    let last = std::sync::Arc::new(AtomicU64::new(0));
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let echo = {
        let (last, stop, to) = (
            std::sync::Arc::clone(&last),
            std::sync::Arc::clone(&stop),
            SocketAddr::new(b.ip(false), 80),
        );
        let netns = a.netns.path();
        std::thread::spawn(move || -> Result<()> {
            let ns = std::fs::File::open(&netns)?;
            // SAFETY: a valid namespace fd; only this thread changes namespace.
            if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) } != 0
            {
                bail!("setns: {}", std::io::Error::last_os_error());
            }
            let s = UdpSocket::bind("0.0.0.0:0")?;
            s.set_read_timeout(Some(Duration::from_millis(1)))?;
            let mut buf = [0u8; 64];
            while !stop.load(Ordering::Relaxed) {
                let _ = s.send_to(b"x", to);
                if s.recv_from(&mut buf).is_ok() {
                    last.store(base.elapsed().as_nanos() as u64, Ordering::Relaxed);
                }
            }
            Ok(())
        })
    };
    let at = |t: Instant| t.duration_since(base).as_nanos() as u64;
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
        // Enforced once no echo comes back for 500 ms.
        while last.load(Ordering::Relaxed) + 500_000_000 > at(Instant::now()) {
            ensure!(
                t0.elapsed() < Duration::from_secs(10),
                "the policy is not enforced: {}\nconntrack:\n{}\n{}",
                node.net
                    .node
                    .exec(&["nft", "list", "table", "inet", "xdpcni"])
                    .unwrap_or_default(),
                node.net
                    .node
                    .exec(&["conntrack", "-L", "-o", "id,extended"])
                    .unwrap_or_default(),
                node.agent_log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let ms = (last.load(Ordering::Relaxed).saturating_sub(at(t0))) as f64 / 1e6;
        applied.push(ms);
        push(W_NP_APPLY_P50, NP_AGENT, rep, ms);
        let t1 = Instant::now();
        node.delete_policies()?;
        while last.load(Ordering::Relaxed) < at(t1) {
            ensure!(t1.elapsed() < Duration::from_secs(10), "not allowed again");
            std::thread::sleep(Duration::from_millis(1));
        }
        let ms = (last.load(Ordering::Relaxed) - at(t1)) as f64 / 1e6;
        removed.push(ms);
        push(W_NP_REMOVE_P50, NP_AGENT, rep, ms);
    }
    stop.store(true, Ordering::Relaxed);
    echo.join()
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
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

/// The migration of a datapath the previous release pinned (layout 1)
/// with `n` pods attached (generic devmap) to this build's layout: this
/// build's agent started over it; how long its migration took
/// (`xdpcni_datapath_migration_seconds`) and its start to ready. Fresh
/// node each repetition.
fn migration_bench(
    reps: usize,
    n: usize,
    push: &mut dyn FnMut(&str, &str, usize, f64),
) -> Result<String> {
    let previous = xdpcni_e2e::previous_release()?;
    let path = format!("{n} pods, this build's agent");
    for rep in 0..reps {
        check_interrupt()?;
        let pins = PinDir::new("xg")?;
        let mut net = Network::new(pins.path(), "1.1.0", json!([[{"subnet": "10.76.0.0/16"}]]))?;
        let this_plugin = std::mem::replace(&mut net.plugin, previous.join("xdpcni"));
        let old = StandaloneAgent::start_binary(
            &previous.join("xdpcni-agent"),
            &net,
            pins.path(),
            json!({}),
        )?;
        let pods: Vec<Netns> = (0..n).map(|_| Netns::new("xp")).collect::<Result<_>>()?;
        let mut hosts = Vec::new();
        for (i, pod) in pods.iter().enumerate() {
            let out = net.call(
                &Call::new("ADD", &format!("mig{i}"), Some(&pod.path())),
                &json!({}),
            )?;
            ensure!(out.status == 0, "previous release ADD: {}", out.json);
            hosts.push(
                out.json["interfaces"][0]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            );
        }
        for h in &hosts {
            wait_mode(&net.node, h, "xdpgeneric", Duration::from_secs(10))?;
        }
        old.stop(libc::SIGTERM)?;
        net.plugin = this_plugin;
        let t = Instant::now();
        let agent = StandaloneAgent::start(&net, pins.path(), json!({}))?;
        let ready = t.elapsed().as_secs_f64() * 1e3;
        let (_, body) =
            xdpcni_e2e::cni::http_get(&net.node, xdpcni_e2e::agent::LISTEN, "/metrics")?;
        let secs: f64 = body
            .lines()
            .find_map(|l| l.strip_prefix("xdpcni_datapath_migration_seconds "))
            .and_then(|v| v.trim().parse().ok())
            .context("no xdpcni_datapath_migration_seconds")?;
        ensure!(secs > 0.0, "the agent did not migrate: {}", agent.log());
        push(W_MIGRATE, &path, rep, secs * 1e3);
        push(W_MIGRATE_READY, &path, rep, ready);
        for (i, pod) in pods.iter().enumerate() {
            let _ = net.call(
                &Call::new("DEL", &format!("mig{i}"), Some(&pod.path())),
                &json!({}),
            );
        }
        drop(agent);
    }
    Ok(path)
}

/// Two nodes on one wire (192.168.78.0/24), each a namespace with its own
/// pods: `ptp` pods with host-gateway routes set by hand (the kernel's
/// routing between nodes, the baseline), and xdpcni nodes with their
/// agents in Kubernetes mode against a real API server, first in
/// `hostGateway`, then in `vxlan` (pods made again with the tunnel's MTU,
/// as install-cni would give them); each phase also measures a same-node
/// pair (the default tc fast path). The vxlan phase measures the device
/// with transmit checksum offload off too (`routing.vxlan.txChecksumOffload:
/// false`, Flannel's workaround of an old kernel bug): what it costs.
fn xnode_bench(
    reps: usize,
    secs: u32,
    push: &mut dyn FnMut(&str, &str, usize, f64),
    extra: &mut Vec<String>,
) -> Result<()> {
    use xdpcni_e2e::{kube::ApiServer, nodes::TestNode, traffic::ping};
    let wire = |n1: &TestNode, n2: &TestNode| -> Result<()> {
        let (w1, w2) = (xdpcni_e2e::unique_name("xw"), xdpcni_e2e::unique_name("xw"));
        n1.net.node.add_veth(&w1, &w2, Some(&n2.net.node))?;
        for (n, w) in [(n1, &w1), (n2, &w2)] {
            let ip = n.ip(false).context("an IPv4 InternalIP")?;
            n.net
                .node
                .ip(&["addr", "add", &format!("{ip}/24"), "dev", w])?;
            n.net.node.ip(&["link", "set", w, "up"])?;
        }
        ping(&n1.net.node, n2.ip(false).context("IPv4")?, 1)
    };
    let node = |i: u8, base: u8| {
        TestNode::new(
            &format!("node-{i}"),
            &format!("10.{base}.{i}.0/24"),
            &format!("fd{base}:{i}::/64"),
            &[&format!("192.168.78.{i}")],
        )
    };
    let pod_ip = |res: &Value| -> Result<IpAddr> {
        xdpcni_e2e::cni::result_ips(res)
            .into_iter()
            .find(IpAddr::is_ipv4)
            .context("an IPv4 pod address")
    };

    // A pod's datapath in place (the agent's default mode on its veth).
    let settled = |n: &TestNode, res: &Value| -> Result<()> {
        let host = res["interfaces"][0]["name"]
            .as_str()
            .context("the result's host interface")?;
        xdpcni_e2e::agent::wait_default_mode(&n.net.node, host).map(drop)
    };

    // The baseline: ptp pods, a route to the other node's pods via its address.
    let mut p1 = node(1, 91)?;
    let mut p2 = node(2, 91)?;
    for n in [&mut p1, &mut p2] {
        cni_conf(PATHS[0], &mut n.net);
        // Debian's ptp speaks CNI up to 1.0.0; its pods route what is not
        // on their subnet through their gateway only if IPAM says so.
        n.net.conf["cniVersion"] = json!("1.0.0");
        n.net.conf["ipam"]["routes"] = json!([{ "dst": "0.0.0.0/0" }, { "dst": "::/0" }]);
    }
    wire(&p1, &p2)?;
    for (n, other) in [(&p1, &p2), (&p2, &p1)] {
        let via = other.ip(false).context("IPv4")?.to_string();
        n.net.node.ip(&["route", "add", &other.pod4, "via", &via])?;
    }
    let (pa, rpa) = p1.add_pod("pa")?;
    let (pb, _) = p2.add_pod("pb")?;
    let ptp_ip = pod_ip(&rpa)?;

    // xdpcni: one API server, two Nodes, an agent each.
    let mut n1 = node(1, 92)?;
    let mut n2 = node(2, 92)?;
    wire(&n1, &n2)?;
    let api = ApiServer::start_on(&n1.net.node, "0.0.0.0")?;
    let kc2 = api.kubeconfig_via("192.168.78.1")?;
    for n in [&n1, &n2] {
        n.create_object(&api, &n1.net.node)?;
    }
    xdpcni_e2e::nodes::create_pods(
        &api,
        &n1.net.node,
        &[
            ("x1", "node-1"),
            ("x2", "node-2"),
            ("y1", "node-1"),
            ("v1", "node-1"),
            ("v2", "node-2"),
            ("w1", "node-1"),
        ],
    )?;
    let start = |n1: &TestNode, n2: &TestNode, mode: &str| -> Result<_> {
        let extra = json!({
            "xdpMode": xdpcni_host::pod::DEFAULT_MODE.as_str(),
            "routing": { "mode": mode },
        });
        Ok((
            n1.agent(&api.kubeconfig, extra.clone())?,
            n2.agent(&kc2, extra)?,
        ))
    };
    let routed = |n: &TestNode, other: &TestNode, tunnel: bool| {
        let r = n.agent_routes();
        r.lines().any(|l| {
            l.starts_with(&other.pod4) && (l.contains(xdpcni_host::overlay::DEVICE) == tunnel)
        })
    };
    let wait_routes = |n1: &TestNode, n2: &TestNode, tunnel: bool| -> Result<()> {
        xdpcni_e2e::nodes::wait_for("the agents' routes", Duration::from_secs(15), || {
            routed(n1, n2, tunnel) && routed(n2, n1, tunnel)
        })
        .map(drop)
    };

    // Phase 1: hostGateway.
    let agents = start(&n1, &n2, "hostGateway")?;
    let (x1, rx1) = n1.add_pod("x1")?;
    let (x2, rx2) = n2.add_pod("x2")?;
    let (y1, ry1) = n1.add_pod("y1")?;
    wait_routes(&n1, &n2, false)?;
    let x1_ip = pod_ip(&rx1)?;
    settled(&n1, &rx1)?;
    settled(&n1, &ry1)?;
    settled(&n2, &rx2)?;
    // The baseline again with conntrack on both nodes' forward path, as
    // kube-proxy's rules (and xdpcni's NetworkPolicy table) have it on a
    // real node: a forward-hook table that asks for connection state.
    let table = xdpcni_e2e::unique_name("xc");
    let conntrack = |on: bool| -> Result<()> {
        for n in [&p1, &p2] {
            let node = &n.net.node;
            if on {
                node.exec(&["nft", "add", "table", "inet", &table])?;
                node.exec(&[
                    "nft",
                    "add",
                    "chain",
                    "inet",
                    &table,
                    "xfwd",
                    "{ type filter hook forward priority 0 ; }",
                ])?;
                node.exec(&[
                    "nft", "add", "rule", "inet", &table, "xfwd", "ct", "state", "invalid", "drop",
                ])?;
            } else {
                node.exec(&["nft", "delete", "table", "inet", &table])?;
            }
        }
        Ok(())
    };
    for rep in 0..reps {
        push(
            W_XNODE_TCP,
            PATHS[0].label,
            rep,
            iperf(&pb, &pa, ptp_ip, secs)?,
        );
        conntrack(true)?;
        let ct = iperf(&pb, &pa, ptp_ip, secs);
        conntrack(false)?;
        push(W_XNODE_TCP, XNODE_PTP_CT, rep, ct?);
        push(W_XNODE_TCP, XNODE_HG, rep, iperf(&x2, &x1, x1_ip, secs)?);
        push(W_XNODE_TCP, XNODE_SAME, rep, iperf(&y1, &x1, x1_ip, secs)?);
    }
    drop(agents);

    // Phase 2: vxlan, new pods with the tunnel's MTU.
    let mtu = 1500 - xdpcni_host::overlay::overhead(false);
    n1.set_pod_mtu(mtu);
    n2.set_pod_mtu(mtu);
    let agents = start(&n1, &n2, "vxlan")?;
    wait_routes(&n1, &n2, true)?;
    let (v1, rv1) = n1.add_pod("v1")?;
    let (v2, rv2) = n2.add_pod("v2")?;
    let (w1, rw1) = n1.add_pod("w1")?;
    let v1_ip = pod_ip(&rv1)?;
    settled(&n1, &rv1)?;
    settled(&n1, &rw1)?;
    settled(&n2, &rv2)?;
    let csum = |on: &str| -> Result<()> {
        for n in [&n1, &n2] {
            n.net
                .node
                .exec(&["ethtool", "-K", xdpcni_host::overlay::DEVICE, "tx", on])?;
        }
        Ok(())
    };
    for rep in 0..reps {
        push(
            W_XNODE_TCP,
            PATHS[0].label,
            rep,
            iperf(&pb, &pa, ptp_ip, secs)?,
        );
        push(W_XNODE_TCP, XNODE_VXLAN, rep, iperf(&v2, &v1, v1_ip, secs)?);
        csum("off")?;
        let off = iperf(&v2, &v1, v1_ip, secs);
        csum("on")?;
        push(W_XNODE_TCP, XNODE_VXLAN_CSUM, rep, off?);
        push(W_XNODE_TCP, XNODE_SAME, rep, iperf(&w1, &v1, v1_ip, secs)?);
    }
    extra.push(format!(
        "across nodes: two node namespaces on one veth wire (MTU 1500); ptp pods with host-gateway routes set by hand; xdpcni pods of MTU 1500 (hostGateway) and {mtu} (vxlan; the device's tx checksum offload on, as the agent sets it by default, and off by ethtool for its own row); the same-node row is measured in both phases"
    ));
    drop(agents);
    for (n, name, ns) in [
        (&n1, "x1", &x1),
        (&n2, "x2", &x2),
        (&n1, "y1", &y1),
        (&n1, "v1", &v1),
        (&n2, "v2", &v2),
        (&n1, "w1", &w1),
    ] {
        n.del_pod(name, ns)?;
    }
    Ok(())
}

/// A NetworkPolicy `name` in namespace `bench`.
fn np_json(name: &str, spec: Value) -> Value {
    json!({ "metadata": { "name": name, "namespace": "bench" }, "spec": spec })
}

fn main() -> Result<()> {
    // What a node runs: the product binaries, not the tests' hooked builds.
    xdpcni_e2e::cni::use_product_binaries();
    let o = parse_args();
    install_signal_handlers()?;
    let run = measure(&o)?;
    let rows = summarise(&run.samples);
    report(&o, &run, &rows)
}

/// What one run measured: every sample and the notes beside the table.
struct Measured {
    machine: String,
    samples: Vec<Sample>,
    notes: Vec<String>,
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
        // Interleaved: every path once per repetition and workload, starting
        // from a different path each repetition so none always goes first.
        let order: Vec<&Bench> = (0..benches.len())
            .map(|i| &benches[(i + rep) % benches.len()])
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
            // the machine does not land on all of them. native devmap, and
            // the two peer paths: what the shared checks cost on tc.
            for b in order
                .iter()
                .filter(|b| [benches[2].spec.label, TC_PATH, PEER_PATH].contains(&b.spec.label))
            {
                let (line, ns) = profile(b, dur)?;
                push(W_PROG_NS, b.spec.label, rep, ns);
                profile_lines.push(line);
            }
        }
        if o.workload(W_PINNED) {
            let pinned: Vec<&Bench> = pinned.iter().copied().filter(|b| o.path_on(b)).collect();
            for i in 0..pinned.len() {
                let b = pinned[(i + rep) % pinned.len()];
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
    if o.full() || o.workload("NetworkPolicy") || o.workload(W_NP_FWD) {
        eprintln!("bench: NetworkPolicy on a Kubernetes node (API server, agent)...");
        netpol_bench(reps, dur, &mut push, &mut extra)?;
    }
    if o.full() || o.workload(W_MIGRATE) {
        eprintln!("bench: datapath migration from the previous release...");
        let path = migration_bench(reps, pods_for_add, &mut push)?;
        extra.push(format!(
            "migration: the previous release ({}) pinned layout 1 with {path}; each repetition a fresh node",
            std::fs::read_to_string("e2e/k8s/PREVIOUS_RELEASE")
                .unwrap_or_default()
                .lines()
                .filter(|l| !l.starts_with('#'))
                .collect::<String>()
                .trim()
        ));
    }
    if o.full() || o.workload(W_XNODE_TCP) {
        eprintln!("bench: TCP across nodes (hostGateway, vxlan) on two nodes with agents...");
        xnode_bench(reps, o.secs, &mut push, &mut extra)?;
    }
    extra.append(&mut profile_lines);
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
    let targets = targets(&medians);
    table.push_str(&report_tail(&run.notes, &targets));
    let targets: Vec<Value> = targets.iter().map(Target::json).collect();
    let doc = json!({ "machine": run.machine, "reps": o.reps, "secs": o.secs, "quick": o.quick, "summary": summary, "samples": run.samples, "notes": run.notes, "targets": targets });
    write_report(&o.out, "bench", &table, &doc, "plot.py")?;
    Ok(())
}
