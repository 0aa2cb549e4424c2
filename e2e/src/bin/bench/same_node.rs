//! The same-node workloads: packet rate, TCP stream, request/response,
//! raw forwarding into a sink, CNI ADD latency, the XDP ceiling, the
//! per-packet cost of the program and the profile.

#[allow(clippy::wildcard_imports)]
use super::*;

/// Packets per second delivered to pod 1's eth0 from pod 0's flood.
pub fn pps(b: &Bench, payload: usize, dur: Duration) -> Result<f64> {
    let to = SocketAddr::new(b.ips[1], port());
    pps_via(&b.pods[0], &b.pods[1], to, to, payload, dur)
}

/// Packets per second delivered to `to_ns`'s eth0 from `from`'s flood to
/// `dial`, received by a socket bound at `bind` (a Service address
/// translated or DNAT'd to it, or `dial` itself).
pub fn pps_via(
    from: &Netns,
    to_ns: &Netns,
    bind: SocketAddr,
    dial: SocketAddr,
    payload: usize,
    dur: Duration,
) -> Result<f64> {
    check_interrupt()?;
    xdpcni_e2e::measure::udp_rate(from, to_ns, bind, dial, payload, &every_cpu(), dur)
}

/// Where the forwarding workload's frames end, at the same cost on every
/// path so that only the forwarding in between differs.
#[derive(Clone, Copy, Debug)]
pub enum Sink {
    /// An XDP program on the destination pod's eth0 that drops every frame
    /// (counted by the program, as the veth's `xdp_drops` counts them).
    XdpDrop,
    /// An iptables raw-table DROP in the destination pod (counted from
    /// eth0's rx_packets, which the frame passes first).
    RawTable,
}

/// A 64-byte UDP frame from pod 0 to pod 1 as pod 0's eth0 would put it on
/// the wire: to the host veth's MAC (the pod's gateway), valid IPv4 header.
pub fn fwd_frame(b: &Bench) -> Result<Vec<u8>> {
    frame_between(&b.net.node, &b.hosts[0], &b.pods[0], b.ips[0], b.ips[1])
}

/// Frames per second that reached `sink` in pod 1 while pod 0's raw sender
/// ran with one thread per entry of `cpus`.
pub fn fwd(b: &Bench, sink: Sink, cpus: &[Option<usize>], dur: Duration) -> Result<Fwd> {
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

pub struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One iperf3 TCP stream from pod 0 to pod 1, Gbit/s.
pub fn tcp(b: &Bench, secs: u32) -> Result<f64> {
    iperf(&b.pods[0], &b.pods[1], b.ips[1], secs)
}

/// One iperf3 TCP stream from `from` to `to` (at `ip`), Gbit/s.
pub fn iperf(from: &Netns, to: &Netns, ip: IpAddr, secs: u32) -> Result<f64> {
    iperf_via(from, to, SocketAddr::new(ip, port()), ip, secs)
}

/// One iperf3 TCP stream from `from`, dialing `dial` at `bind`'s port, to
/// a server in `to` bound at `bind` (a Service address translated or
/// DNAT'd to it, or `bind`'s own address), Gbit/s.
pub fn iperf_via(
    from: &Netns,
    to: &Netns,
    bind: SocketAddr,
    dial: IpAddr,
    secs: u32,
) -> Result<f64> {
    check_interrupt()?;
    let p = bind.port().to_string();
    let (ip, dial) = (bind.ip().to_string(), dial.to_string());
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
        match from.exec(&[
            "iperf3",
            "-c",
            &dial,
            "-p",
            &p,
            "-t",
            &secs.to_string(),
            "-J",
        ]) {
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
                "iperf3 {} -> {dial}: no result ({})",
                from.name(),
                v["error"].as_str().unwrap_or("no error given")
            )
        })?;
    Ok(bps / 1e9)
}

/// UDP ping-pong from pod 0 to an echo in pod 1: RTTs in microseconds.
pub fn latency(b: &Bench, rounds: usize) -> Result<Vec<f64>> {
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
pub fn add_latency(spec: PathSpec, n: usize) -> Result<(Vec<f64>, Vec<f64>)> {
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
pub fn ceiling(
    b: &Bench,
    payload: usize,
    dur: Duration,
    mode: aya::programs::XdpMode,
) -> Result<f64> {
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
pub struct DropSink(aya::Ebpf);

impl DropSink {
    /// Attaches to `ifindex` of the calling thread's namespace.
    pub fn attach(ifindex: u32, mode: aya::programs::XdpMode) -> Result<Self> {
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
    pub fn dropped(&self) -> Result<u64> {
        let map = self.0.map("drop_count").context("drop_count")?;
        let arr = aya::maps::PerCpuArray::<_, u64>::try_from(map)?;
        Ok(arr.get(&0, 0)?.iter().sum())
    }
}

/// bench.bpf.c's `tc_redirect_peer` on both host veths of a node (tcx
/// ingress), its map holding both pods; dropping it detaches the program.
pub struct PeerRedirect {
    /// Held for its Drop, which detaches the program.
    pub _loaded: aya::Ebpf,
}

impl PeerRedirect {
    pub fn attach(b: &Bench) -> Result<Self> {
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
pub fn program_info(b: &Bench) -> Result<aya::programs::ProgramInfo> {
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
pub fn profile(b: &Bench, dur: Duration) -> Result<(String, f64)> {
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
