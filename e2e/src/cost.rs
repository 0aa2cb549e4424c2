//! What the datapath program costs per packet, stage by stage, measured
//! with BPF_PROG_TEST_RUN on fixed frames: the stage-cost builds
//! (`xdpcni_ebpf::STAGE_OBJECTS`, the fast path stopped after each stage)
//! and the product object, each run on the same frame from pod a to pod b
//! of a node wired by hand, on both hooks and both families, beside
//! Cilium's minimal same-node program (`tc_redirect_peer` of the bench
//! object) on the same frame. A stage's cost is the difference between the
//! medians of consecutive builds; its size, the difference between their
//! translated lengths (instructions, which the budget test holds).
//!
//! The kernel runs a program `repeat` times per call on one buffer and
//! reports the mean, which amortises its timer; frames start at TTL 255 so
//! a call's decrements never reach the TTL-expiry path, and b's endpoint
//! carries a's host veth MAC as its pod MAC, so the rewritten destination
//! MAC still addresses the host veth (the destination-MAC check). Redirects
//! are not executed by a test run: this is the program's own cost.

use anyhow::{ensure, Context, Result};
use aya::{
    maps::HashMap,
    programs::{SchedClassifier, Xdp},
};
use xdpcni_ebpf::{
    abi::{ipv4_key, EndpointInfo, RedirectPolicy},
    layout_dir,
    testing::{RawDatapath, RawMaps},
    Datapath, CPUMAP_PROGRAM, FROM_POD_PROGRAM, HOLD_PROGRAM, TC_FROM_NODE_PROGRAM,
    TC_FROM_POD_PROGRAM,
};

use crate::{
    in_netns,
    packet::{eth, ipv4, ipv6, udp, ETH_P_IP, ETH_P_IPV6, IPPROTO_UDP},
    testrun::{tc_run, xdp_run, Run, TC_ACT_REDIRECT, TC_ACT_UNSPEC, XDP_PASS, XDP_REDIRECT},
    topo::WiredNode,
    PinDir,
};

/// The hooks, as the table's columns name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    /// `xdpcni_from_pod`, redirecting through the devmap.
    Xdp,
    /// `xdpcni_tc_from_pod`, bpf_redirect_peer.
    Tc,
}

/// The stages of each hook, in the order the program runs them; stage `n`
/// is what `STAGE_OBJECTS[n]` stops after, the last one the product adds.
pub fn stages(hook: Hook) -> [&'static str; 7] {
    let (four, five) = match hook {
        Hook::Xdp => ("redirect target (bpf_redirect_map)", "rewrite (MACs, TTL)"),
        Hook::Tc => ("rewrite (MACs, TTL)", "redirect (bpf_redirect_peer)"),
    };
    [
        "entry (and a test run's own cost)",
        "parse (Ethernet, IP, L4 head)",
        "source check (endpoint of the source)",
        "decide (destination endpoint, TTL, MTU, NAT'd ports)",
        four,
        five,
        "counters",
    ]
}

/// One column of the table: a hook, a family.
#[derive(Debug)]
pub struct Column {
    /// The hook.
    pub hook: Hook,
    /// IPv6 (else IPv4).
    pub v6: bool,
    /// Median ns per packet after each stage (cumulative), stage 0 first.
    pub ns: Vec<f64>,
}

/// The whole measurement.
#[derive(Debug)]
pub struct StageCosts {
    /// XDP and tc, IPv4 and IPv6.
    pub columns: Vec<Column>,
    /// Translated instructions after each stage, per hook (cumulative).
    pub insns: Vec<(Hook, Vec<u32>)>,
    /// Cilium's minimal program on the IPv4 frame: ns, instructions.
    pub peer_ns: f64,
    /// Its translated instructions.
    pub peer_insns: u32,
    /// The product's programs as the kernel holds them: name, translated
    /// and verified (`insn_processed`) instructions.
    pub programs: Vec<(&'static str, u32, u32)>,
    /// The calls per build and the runs per call.
    pub samples: usize,
    /// Runs per call.
    pub repeat: u32,
}

impl StageCosts {
    /// The cost of stage `i` in `col` (its cumulative minus the previous).
    pub fn stage_ns(&self, col: &Column, i: usize) -> f64 {
        if i == 0 {
            col.ns[0]
        } else {
            col.ns[i] - col.ns[i - 1]
        }
    }

    /// The whole program's ns per packet, less a test run's own (stage 0).
    pub fn program_ns(col: &Column) -> f64 {
        col.ns[col.ns.len() - 1] - col.ns[0]
    }

    /// The table, Markdown.
    pub fn table(&self) -> String {
        let mut out = format!(
            "| stage (BPF_PROG_TEST_RUN, UDP 64-byte frame, median of {} x {} runs) | {} | insns XDP | insns tc |\n| --- |{} ---: | ---: |\n",
            self.samples,
            self.repeat,
            self.columns
                .iter()
                .map(|c| format!(
                    "{} {} ns",
                    if c.hook == Hook::Xdp { "XDP" } else { "tc" },
                    if c.v6 { "IPv6" } else { "IPv4" }
                ))
                .collect::<Vec<_>>()
                .join(" | "),
            " ---: |".repeat(self.columns.len()),
        );
        let insns = |hook: Hook, i: usize| -> String {
            self.insns
                .iter()
                .find(|(h, _)| *h == hook)
                .map(|(_, v)| {
                    let prev = if i == 0 { 0 } else { v[i - 1] };
                    format!("{}", i64::from(v[i]) - i64::from(prev))
                })
                .unwrap_or_default()
        };
        for i in 0..7 {
            let names = (stages(Hook::Xdp)[i], stages(Hook::Tc)[i]);
            let name = if names.0 == names.1 {
                names.0.to_string()
            } else {
                format!("XDP: {}; tc: {}", names.0, names.1)
            };
            let cells: Vec<String> = self
                .columns
                .iter()
                .map(|c| format!("{:.1}", self.stage_ns(c, i)))
                .collect();
            out += &format!(
                "| {i} {name} | {} | {} | {} |\n",
                cells.join(" | "),
                insns(Hook::Xdp, i),
                insns(Hook::Tc, i)
            );
        }
        let totals: Vec<String> = self
            .columns
            .iter()
            .map(|c| format!("**{:.1}**", Self::program_ns(c)))
            .collect();
        let total_insns = |hook: Hook| {
            self.insns
                .iter()
                .find(|(h, _)| *h == hook)
                .map(|(_, v)| v[v.len() - 1].to_string())
                .unwrap_or_default()
        };
        out += &format!(
            "| the program (stages 1-6) | {} | {} | {} |\n",
            totals.join(" | "),
            total_insns(Hook::Xdp),
            total_insns(Hook::Tc)
        );
        out += &format!(
            "\nCilium's minimal same-node program (tc, IPv4, one lookup, no checks, no counters): {:.1} ns less a test run's own {:.1} = **{:.1} ns**, {} instructions.\n",
            self.peer_ns,
            self.columns.iter().find(|c| c.hook == Hook::Tc && !c.v6).map_or(0.0, |c| c.ns[0]),
            self.peer_ns_net(),
            self.peer_insns
        );
        out
    }

    /// Cilium's minimal program less a tc test run's own cost.
    pub fn peer_ns_net(&self) -> f64 {
        let base = self
            .columns
            .iter()
            .find(|c| c.hook == Hook::Tc && !c.v6)
            .map_or(0.0, |c| c.ns[0]);
        self.peer_ns - base
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A program's translated length in instructions.
fn xlated_insns(info: aya::programs::ProgramInfo) -> Result<u32> {
    Ok(info
        .size_translated()
        .context("the kernel gives no translated length")?
        / 8)
}

/// The frames of a measurement, from a to b, at TTL 255.
fn frames(node: &WiredNode) -> [Vec<u8>; 2] {
    let (a, b) = (&node.pods[0], &node.pods[1]);
    let l4 = udp(4000, 53, &[0; 18]);
    [
        eth(
            a.host_mac,
            a.pod_mac,
            ETH_P_IP,
            &ipv4(a.ipv4, b.ipv4, 255, IPPROTO_UDP, &l4),
        ),
        eth(
            a.host_mac,
            a.pod_mac,
            ETH_P_IPV6,
            &ipv6(a.ipv6, b.ipv6, 255, IPPROTO_UDP, &l4),
        ),
    ]
}

/// A stage build, its two programs loaded over the datapath's pinned maps.
fn load_build(pins: &PinDir, object: &[u8]) -> Result<aya::Ebpf> {
    let mut ebpf = xdpcni_ebpf::datapath_loader(pins.path())
        .load(object)
        .context("loading a stage build")?;
    let xdp: &mut Xdp = ebpf
        .program_mut(FROM_POD_PROGRAM)
        .context(FROM_POD_PROGRAM)?
        .try_into()?;
    xdp.load()?;
    let tc: &mut SchedClassifier = ebpf
        .program_mut(TC_FROM_POD_PROGRAM)
        .context(TC_FROM_POD_PROGRAM)?
        .try_into()?;
    tc.load()?;
    Ok(ebpf)
}

/// A loaded build's two programs.
fn programs(ebpf: &aya::Ebpf) -> Result<(&Xdp, &SchedClassifier)> {
    let xdp: &Xdp = ebpf
        .program(FROM_POD_PROGRAM)
        .context(FROM_POD_PROGRAM)?
        .try_into()?;
    let tc: &SchedClassifier = ebpf
        .program(TC_FROM_POD_PROGRAM)
        .context(TC_FROM_POD_PROGRAM)?
        .try_into()?;
    Ok((xdp, tc))
}

/// Runs `samples` calls of `repeat` runs of `run`, which must give `want`;
/// the median ns per run.
fn median_of(samples: usize, want: u32, mut run: impl FnMut() -> Result<Run>) -> Result<f64> {
    let mut v = Vec::with_capacity(samples);
    for _ in 0..samples {
        let r = run()?;
        ensure!(
            r.action == want,
            "action {} where {want} was expected",
            r.action
        );
        v.push(r.ns_per_run);
    }
    Ok(median(v))
}

/// Measures every stage on both hooks and families, and Cilium's minimal
/// program. Root and bpffs; makes its own namespaces and pins.
pub fn measure(samples: usize, repeat: u32) -> Result<StageCosts> {
    let node = WiredNode::new(2)?;
    let pins = PinDir::new("xcost")?;
    let frames = frames(&node);
    in_netns(&node.ns, || {
        let mut dp = Datapath::open(pins.path())?;
        node.register_all(dp.raw_maps(), RedirectPolicy::Devmap, 0)?;
        let (a, b) = (&node.pods[0], &node.pods[1]);
        // b's pod MAC as a's host veth's (see the module doc); neither has
        // NAT'd ports (the write sets the flag that skips their lookup).
        for (pod, pod_mac) in [(a, a.pod_mac), (b, a.host_mac)] {
            let mut info: EndpointInfo = pod.endpoint(RedirectPolicy::Devmap, 0);
            info.pod_mac = pod_mac;
            for addr in pod.addrs() {
                dp.raw_maps().raw_upsert_endpoint(addr, &info)?;
            }
        }
        let ingress = a.host_ifindex;
        let mut columns: Vec<Column> = [
            (Hook::Xdp, false),
            (Hook::Xdp, true),
            (Hook::Tc, false),
            (Hook::Tc, true),
        ]
        .into_iter()
        .map(|(hook, v6)| Column {
            hook,
            v6,
            ns: Vec::new(),
        })
        .collect();
        let mut insns = vec![(Hook::Xdp, Vec::new()), (Hook::Tc, Vec::new())];
        let builds = xdpcni_ebpf::STAGE_OBJECTS
            .iter()
            .map(|object| load_build(&pins, object))
            .collect::<Result<Vec<_>>>()?;
        // The stage builds, then the product: one pass over all of them.
        let mut all = builds.iter().map(programs).collect::<Result<Vec<_>>>()?;
        all.push((dp.from_pod_program(), dp.tc_from_pod_program()));
        let last = all.len() - 1;
        for (n, (xdp, tc)) in all.into_iter().enumerate() {
            measure_build(
                &mut columns,
                &frames,
                ingress,
                samples,
                repeat,
                n,
                last,
                xdp,
                tc,
            )?;
            insns[0].1.push(xlated_insns(xdp.info()?)?);
            insns[1].1.push(xlated_insns(tc.info()?)?);
        }
        let (peer_ns, peer_insns) =
            measure_peer(&frames[0], b, a.host_mac, ingress, samples, repeat)?;
        let programs = [
            FROM_POD_PROGRAM,
            TC_FROM_POD_PROGRAM,
            CPUMAP_PROGRAM,
            HOLD_PROGRAM,
            TC_FROM_NODE_PROGRAM,
        ]
        .into_iter()
        .map(|name| {
            let pin = layout_dir(pins.path()).join("progs").join(name);
            let info = aya::programs::ProgramInfo::from_pin(&pin)
                .with_context(|| format!("{}", pin.display()))?;
            let verified = info
                .verified_instruction_count()
                .context("the kernel gives no verified instruction count")?;
            Ok((name, xlated_insns(info)?, verified))
        })
        .collect::<Result<Vec<_>>>()?;
        Ok(StageCosts {
            columns,
            insns,
            programs,
            peer_ns,
            peer_insns,
            samples,
            repeat,
        })
    })
}

/// What the uplink program costs per packet (BPF_PROG_TEST_RUN, IPv4 UDP
/// 64-byte frames): the node's own traffic (a frame to a node address and a
/// port no north-south frontend has: one endpoint lookup, the header words
/// read in place, one Service lookup) and a north-south flow's packet (a
/// frontend's, its NAT entry made by the first run: DNAT, SNAT, checksums,
/// bpf_redirect_peer), with the program's translated instructions.
#[derive(Debug)]
pub struct NorthSouthCost {
    /// ns per packet of the node's own traffic, less a test run's own.
    pub node_ns: f64,
    /// ns per packet of a north-south flow, less a test run's own.
    pub flow_ns: f64,
    /// A test run's own cost (the stage-0 build's on the same hook), at
    /// `repeat` runs per call (one per call for the flow's packets).
    pub base_ns: f64,
    /// The program's translated instructions.
    pub insns: u32,
}

/// The Service maps under `pin_dir` with one outside frontend, UDP
/// `fe`:30080 -> `backend`:80 (`externalTrafficPolicy: Cluster`), and a
/// lease of a minute: what the uplink's program serves in a test run.
pub fn outside_udp_frontend(
    pin_dir: &std::path::Path,
    fe: std::net::Ipv4Addr,
    backend: std::net::Ipv4Addr,
) -> Result<xdpcni_ebpf::Services> {
    use std::net::{IpAddr, SocketAddr};
    use xdpcni_ebpf::{abi::SvcAddr, ServiceEntry, Services};
    let mut svc = Services::open(pin_dir)?;
    svc.set_service(
        &ServiceEntry {
            frontend: SvcAddr::outside(SocketAddr::new(IpAddr::V4(fe), 30080), IPPROTO_UDP),
            id: 1,
            flags: 0,
            affinity_timeout: 0,
            backends: vec![(
                1,
                SvcAddr::new(SocketAddr::new(IpAddr::V4(backend), 80), IPPROTO_UDP),
            )],
        },
        None,
    )?;
    svc.renew_lease(60)?;
    Ok(svc)
}

/// Measures [`NorthSouthCost`]: the datapath with two pods, the Service
/// maps holding one outside frontend (UDP 192.0.2.1:30080 -> pod b:80,
/// masqueraded to 192.0.2.1) and a lease.
pub fn north_south(samples: usize, repeat: u32) -> Result<NorthSouthCost> {
    use std::net::Ipv4Addr;
    let node = WiredNode::new(2)?;
    // The flow is masqueraded to the source of the kernel's forwarding
    // route toward its backend: this node forwards, and has an address.
    node.ns.sysctl("net.ipv4.ip_forward", "1")?;
    node.ns.ip(&["addr", "add", "192.0.2.1/32", "dev", "lo"])?;
    let pins = PinDir::new("xnscost")?;
    in_netns(&node.ns, || {
        let mut dp = Datapath::open(pins.path())?;
        node.register_all(dp.raw_maps(), RedirectPolicy::Devmap, 0)?;
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let fe_ip = Ipv4Addr::new(192, 0, 2, 1);
        let client = Ipv4Addr::new(192, 0, 2, 10);
        let _svc = outside_udp_frontend(pins.path(), fe_ip, b.ipv4)?;
        let payload = [0u8; 64 - 14 - 20 - 8];
        let frame = |dport: u16| {
            eth(
                a.host_mac,
                [2, 0, 0, 0, 0, 1],
                ETH_P_IP,
                &ipv4(client, fe_ip, 64, IPPROTO_UDP, &udp(40000, dport, &payload)),
            )
        };
        let prog = dp
            .tc_from_node_program()
            .context("the uplink program is loaded")?;
        let ingress = a.host_ifindex;
        let base_build = load_build(&pins, xdpcni_ebpf::STAGE_OBJECTS[0])?;
        let (_, base_tc) = programs(&base_build)?;
        let base_ns = median_of(samples, TC_ACT_UNSPEC, || {
            tc_run(base_tc, ingress, &frame(22), repeat)
        })?;
        let node_ns = median_of(samples, TC_ACT_UNSPEC, || {
            tc_run(prog, ingress, &frame(22), repeat)
        })?;
        // A test run's repeats share one skb, which the first translates:
        // one run per call (the first makes the flow's entries), ten times
        // the calls, and a test run's own cost measured alike.
        let once = samples * 10;
        let base_once = median_of(once, TC_ACT_UNSPEC, || {
            tc_run(base_tc, ingress, &frame(30080), 1)
        })?;
        let flow_ns = median_of(once, TC_ACT_REDIRECT, || {
            tc_run(prog, ingress, &frame(30080), 1)
        })?;
        Ok(NorthSouthCost {
            node_ns: node_ns - base_ns,
            flow_ns: flow_ns - base_once,
            base_ns,
            insns: xlated_insns(prog.info()?)?,
        })
    })
}

/// One build (stopped after stage `n`; `n == last`: the product) on
/// every column.
#[allow(clippy::too_many_arguments)]
fn measure_build(
    columns: &mut [Column],
    frames: &[Vec<u8>; 2],
    ingress: u32,
    samples: usize,
    repeat: u32,
    n: usize,
    last: usize,
    xdp: &Xdp,
    tc: &SchedClassifier,
) -> Result<()> {
    for col in columns.iter_mut() {
        let frame = &frames[usize::from(col.v6)];
        let ns = match col.hook {
            Hook::Xdp => {
                let want = if n == last { XDP_REDIRECT } else { XDP_PASS };
                median_of(samples, want, || xdp_run(xdp, ingress, frame, repeat))
            }
            Hook::Tc => {
                let want = if n == last {
                    TC_ACT_REDIRECT
                } else {
                    TC_ACT_UNSPEC
                };
                median_of(samples, want, || tc_run(tc, ingress, frame, repeat))
            }
        }
        .with_context(|| {
            format!(
                "stage build {n}, {:?} {}",
                col.hook,
                if col.v6 { "IPv6" } else { "IPv4" }
            )
        })?;
        col.ns.push(ns);
    }
    Ok(())
}

/// Cilium's minimal program (the bench object's `tc_redirect_peer`) on the
/// IPv4 frame, b in its map as in the datapath's.
fn measure_peer(
    frame: &[u8],
    b: &crate::topo::Pod,
    pod_mac: [u8; 6],
    ingress: u32,
    samples: usize,
    repeat: u32,
) -> Result<(f64, u32)> {
    let mut ebpf = aya::Ebpf::load(xdpcni_ebpf::BENCH_OBJECT)?;
    let mut info = b.endpoint(RedirectPolicy::Devmap, 0);
    info.pod_mac = pod_mac;
    let mut map: HashMap<_, u32, EndpointInfo> = ebpf
        .map_mut("peer_endpoints")
        .context("peer_endpoints")?
        .try_into()?;
    map.insert(ipv4_key(b.ipv4), info, 0)?;
    let prog: &mut SchedClassifier = ebpf
        .program_mut("tc_redirect_peer")
        .context("tc_redirect_peer")?
        .try_into()?;
    prog.load()?;
    let ns = median_of(samples, TC_ACT_REDIRECT, || {
        tc_run(prog, ingress, frame, repeat)
    })?;
    Ok((ns, xlated_insns(prog.info()?)?))
}
