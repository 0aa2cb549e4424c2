//! Across nodes: two node namespaces on one wire, one API server,
//! host-gateway and VXLAN against ptp with a route and conntrack on, and
//! the fast path between nodes on and off under the same pods.

#[allow(clippy::wildcard_imports)]
use super::*;
use xdpcni_e2e::traffic::tcp_rr_via;

/// Two nodes on one wire (192.168.78.0/24), each a namespace with its own
/// pods: `ptp` pods with host-gateway routes set by hand (the kernel's
/// routing between nodes, the baseline), and xdpcni nodes with their
/// agents in Kubernetes mode against a real API server, first in
/// `hostGateway`, then in `vxlan` (pods made again with the tunnel's MTU,
/// as install-cni would give them); each phase also measures a same-node
/// pair (the default tc fast path). The hostGateway phase measures the fast
/// path between nodes against the kernel path (the Node annotation turns it
/// off on both nodes) with TCP, UDP 64-byte and TCP_RR, and the nodes' own
/// TCP stream with the uplink program attached and without. The vxlan phase
/// measures the fast path through the tunnel against the kernel path the
/// same way, and the device with transmit checksum offload off on the
/// kernel path (`routing.vxlan.txChecksumOffload: false`, Flannel's
/// workaround of an old kernel bug): what it costs.
pub fn xnode_bench(
    reps: usize,
    secs: u32,
    rounds: usize,
    push: &mut dyn FnMut(&str, &str, usize, f64),
    extra: &mut Vec<String>,
) -> Result<()> {
    use xdpcni_e2e::{kube::ApiServer, nodes::ClusterNode, traffic::ping};
    let wire = |n1: &ClusterNode, n2: &ClusterNode| -> Result<[String; 2]> {
        let (w1, w2) = (xdpcni_e2e::unique_name("xw"), xdpcni_e2e::unique_name("xw"));
        n1.net.node.add_veth(&w1, &w2, Some(&n2.net.node))?;
        for (n, w) in [(n1, &w1), (n2, &w2)] {
            let ip = n.ip(false).context("an IPv4 InternalIP")?;
            n.net
                .node
                .ip(&["addr", "add", &format!("{ip}/24"), "dev", w])?;
            n.net.node.ip(&["link", "set", w, "up"])?;
        }
        ping(&n1.net.node, n2.ip(false).context("IPv4")?, 1)?;
        Ok([w1, w2])
    };
    let node = |i: u8, base: u8| {
        ClusterNode::new(
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
    let settled = |n: &ClusterNode, res: &Value| -> Result<()> {
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
        n.node.net.conf.cni_version = Some("1.0.0".into());
        if let Some(ipam) = n.node.net.conf.ipam.as_mut() {
            ipam["routes"] = json!([{ "dst": "0.0.0.0/0" }, { "dst": "::/0" }]);
        }
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
    let wires = wire(&n1, &n2)?;
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
    let start = |n1: &mut ClusterNode, n2: &mut ClusterNode, mode: &str| -> Result<_> {
        let config = |c: &mut AgentConfig| {
            c.xdp_mode = xdpcni_host::pod::DEFAULT_MODE.as_str().into();
            c.routing.mode = mode.into();
        };
        Ok((n1.agent(&api.kubeconfig, config)?, n2.agent(&kc2, config)?))
    };
    let routed = |n: &ClusterNode, other: &ClusterNode, tunnel: bool| {
        let r = n.agent_routes();
        r.lines().any(|l| {
            l.starts_with(&other.pod4) && (l.contains(xdpcni_host::overlay::DEVICE) == tunnel)
        })
    };
    let wait_routes = |n1: &ClusterNode, n2: &ClusterNode, tunnel: bool| -> Result<()> {
        xdpcni_e2e::nodes::wait_for("the agents' routes", Duration::from_secs(15), || {
            routed(n1, n2, tunnel) && routed(n2, n1, tunnel)
        })
        .map(drop)
    };

    // Phase 1: hostGateway.
    let agents = start(&mut n1, &mut n2, "hostGateway")?;
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
        push(W_XNODE_TCP, XNODE_SAME, rep, iperf(&y1, &x1, x1_ip, secs)?);
    }
    // The fast path between nodes on and off, the same pods and agents.
    let host1 = n1.ip(false).context("IPv4")?;
    let opts = Compare {
        api: &api,
        nodes: [&n1, &n2],
        wires: &wires,
        reps,
        secs,
        rounds,
    };
    let paths = [(XNODE_HG, true), (XNODE_HG_KERNEL, false)];
    opts.fast_vs_kernel(&paths, (&x2, &rx2), (&x1, x1_ip), Some(host1), push, extra)?;
    cross_node(&api, &n1.net.node, &n1, true)?;
    cross_node(&api, &n1.net.node, &n2, true)?;
    extra.push(uplink_cost(&n1, &n2, host1, secs)?);
    drop(agents);

    // Phase 2: vxlan, new pods with the tunnel's MTU.
    let mtu = 1500 - xdpcni_host::overlay::overhead(false);
    n1.set_pod_mtu(mtu);
    n2.set_pod_mtu(mtu);
    let agents = start(&mut n1, &mut n2, "vxlan")?;
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
    let opts = Compare {
        api: &api,
        nodes: [&n1, &n2],
        wires: &wires,
        reps,
        secs,
        rounds,
    };
    let paths = [(XNODE_VXLAN, true), (XNODE_VXLAN_KERNEL, false)];
    opts.fast_vs_kernel(&paths, (&v2, &rv2), (&v1, v1_ip), None, push, extra)?;
    // The device's checksum offload off costs the kernel path's tunnel.
    for n in [&n1, &n2] {
        cross_node(&api, &n1.net.node, n, false)?;
    }
    for rep in 0..reps {
        push(
            W_XNODE_TCP,
            PATHS[0].label,
            rep,
            iperf(&pb, &pa, ptp_ip, secs)?,
        );
        csum("off")?;
        let off = iperf(&v2, &v1, v1_ip, secs);
        csum("on")?;
        push(W_XNODE_TCP, XNODE_VXLAN_CSUM, rep, off?);
        push(W_XNODE_TCP, XNODE_SAME, rep, iperf(&w1, &v1, v1_ip, secs)?);
    }
    for n in [&n1, &n2] {
        cross_node(&api, &n1.net.node, n, true)?;
    }
    extra.push(format!(
        "across nodes: two node namespaces on one veth wire (MTU 1500); ptp pods with host-gateway routes set by hand; xdpcni pods of MTU 1500 (hostGateway) and {mtu} (vxlan; the device's tx checksum offload on, as the agent sets it by default, and off by ethtool for its own row, on the kernel path); the same-node row is measured in both phases"
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

/// What the fast path between nodes is measured under: the API server,
/// the two nodes, and the run's repetitions, seconds and TCP_RR rounds.
struct Compare<'a> {
    api: &'a xdpcni_e2e::kube::ApiServer,
    nodes: [&'a xdpcni_e2e::nodes::ClusterNode; 2],
    /// Each node's end of the wire.
    wires: &'a [String; 2],
    reps: usize,
    secs: u32,
    rounds: usize,
}

impl Compare<'_> {
    /// bench.bpf.c's `tc_pass` on both wires' tcx ingress (as the uplink
    /// program is attached), until the returned objects are dropped.
    fn noop_on_wires(&self) -> Result<Vec<aya::Ebpf>> {
        use aya::programs::{tc::TcAttachType, SchedClassifier};
        let mut held = Vec::new();
        for (n, w) in self.nodes.iter().zip(self.wires) {
            let w = w.clone();
            held.push(in_netns(&n.net.node, move || {
                let mut ebpf = aya::Ebpf::load(xdpcni_ebpf::BENCH_OBJECT)?;
                let prog: &mut SchedClassifier =
                    ebpf.program_mut("tc_pass").context("tc_pass")?.try_into()?;
                prog.load()?;
                prog.attach(&w, TcAttachType::Ingress)
                    .with_context(|| format!("tcx ingress on {w}"))?;
                Ok(ebpf)
            })?);
        }
        Ok(held)
    }

    /// Each of `paths` (a row label, the fast path on or off on both
    /// nodes) under the same pods, repetitions interleaved: TCP, UDP
    /// 64-byte and TCP_RR from `from` (node 2's pod and its CNI result) to
    /// `to` (node 1's pod and address); with `host` (node 1's address), the
    /// nodes' own TCP stream too, with and without the uplink program. The
    /// sending pod's counters say which path each row's TCP took.
    fn fast_vs_kernel(
        &self,
        paths: &[(&'static str, bool)],
        from: (&Netns, &Value),
        to: (&Netns, IpAddr),
        host: Option<IpAddr>,
        push: &mut dyn FnMut(&str, &str, usize, f64),
        extra: &mut Vec<String>,
    ) -> Result<()> {
        let [n1, n2] = self.nodes;
        let idx = n2.net.node.ifindex(&xdpcni_e2e::node::host_veth(from.1)?)?;
        let (src, (dst, dst_ip)) = (from.0, to);
        let mut share: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        let dur = Duration::from_secs(u64::from(self.secs));
        for rep in 0..self.reps {
            for &(label, on) in rep_order(paths, rep) {
                for n in [n1, n2] {
                    cross_node(self.api, &n1.net.node, n, on)?;
                }
                let maps = Maps::open_pinned(n2.pins.path())?;
                let before = maps.counters(idx)?;
                push(W_XNODE_TCP, label, rep, iperf(src, dst, dst_ip, self.secs)?);
                let after = maps.counters(idx)?;
                let s = share.entry(label).or_default();
                s.0 += after.forwarded() - before.forwarded();
                s.1 += after.passed() - before.passed();
                let at = SocketAddr::new(dst_ip, port());
                push(
                    W_XNODE_UDP64,
                    label,
                    rep,
                    pps_via(src, dst, at, at, 22, dur)? / 1e6,
                );
                check_interrupt()?;
                let at = SocketAddr::new(dst_ip, port());
                let mut rtts = tcp_rr_via(src, dst, at, at, self.rounds, 100)?;
                push(W_XNODE_RR, label, rep, percentile(&mut rtts, 0.5));
                if let Some(host) = host {
                    let row = if on { XNODE_UPLINK } else { XNODE_NO_UPLINK };
                    push(
                        W_XNODE_HOST,
                        row,
                        rep,
                        iperf(&n2.net.node, &n1.net.node, host, self.secs)?,
                    );
                    if !on {
                        // The control: the hook with a program that does
                        // nothing, where the uplink program would be.
                        let noop = self.noop_on_wires()?;
                        let gbps = iperf(&n2.net.node, &n1.net.node, host, self.secs);
                        drop(noop);
                        push(W_XNODE_HOST, XNODE_NOOP_UPLINK, rep, gbps?);
                    }
                }
            }
        }
        for (label, (fast, kernel)) in &share {
            extra.push(format!(
                "across nodes, {label}: of the sending pod's packets of the TCP streams {fast} left by the fast path (redirect_neigh), {kernel} by the kernel"
            ));
        }
        Ok(())
    }
}

/// Turns the fast path between nodes on or off on node `n` (its Node
/// annotation, through `api` from `from`) and waits until its agent's status
/// says so: on with its uplink program, or off with none.
fn cross_node(
    api: &xdpcni_e2e::kube::ApiServer,
    from: &Netns,
    n: &xdpcni_e2e::nodes::ClusterNode,
    on: bool,
) -> Result<()> {
    let key = xdpcni_agent::routes::NODE_FAST_PATH_ANNOTATION;
    n.annotate(api, from, key, (!on).then_some("false"))?;
    xdpcni_e2e::nodes::wait_for(
        "the fast path between nodes turned",
        Duration::from_secs(10),
        || {
            n.status().is_ok_and(|s| {
                let x = &s.cross_node;
                x.on == on && x.uplinks.is_empty() != on && (!on || x.destinations > 0)
            })
        },
    )
    .map(drop)
}

/// What the uplink program costs the nodes' own TCP stream (node-2 to
/// node-1), from kernel BPF stats over one more stream, not a row's (the
/// stats cost time of their own): its runs on both nodes, ns per run, and
/// the share of the machine's CPU time they took.
fn uplink_cost(
    n1: &xdpcni_e2e::nodes::ClusterNode,
    n2: &xdpcni_e2e::nodes::ClusterNode,
    to: IpAddr,
    secs: u32,
) -> Result<String> {
    let ids: Vec<u32> = [n1, n2]
        .iter()
        .map(|n| n.program_id(xdpcni_ebpf::TC_FROM_NODE_PROGRAM))
        .collect::<Result<_>>()?;
    let totals = || -> Result<(u64, u128)> {
        let mut out = (0, 0);
        for info in aya::programs::loaded_programs() {
            let info = info?;
            if ids.contains(&info.id()) {
                out.0 += info.run_count();
                out.1 += info.run_time().as_nanos();
            }
        }
        Ok(out)
    };
    let stats = BpfStats::enable()?;
    let before = totals()?;
    let gbps = iperf(&n2.net.node, &n1.net.node, to, secs)?;
    let after = totals()?;
    drop(stats);
    let runs = after.0.saturating_sub(before.0);
    let ns = after.1.saturating_sub(before.1) as f64;
    ensure!(runs > 0, "the uplink program did not run");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    Ok(format!(
        "across nodes, the nodes' own TCP stream with the uplink program ({gbps:.1} Gbit/s, bpf_stats on): the program ran {runs} times on both nodes ({:.0} runs/s), {:.0} ns per run: {:.2}% of the {cpus} CPUs' time",
        runs as f64 / f64::from(secs),
        ns / runs as f64,
        100.0 * ns / (f64::from(secs) * cpus * 1e9)
    ))
}
