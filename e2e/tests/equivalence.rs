//! Equivalence: the fast path delivers exactly what kernel routing would.
//!
//! Three pods on a node made by the real CNI (a sends, b receives with a
//! smaller MTU, c only lends its addresses). Every probe is a sequence of
//! frames sent with an AF_PACKET socket from inside a pod (so malformed and
//! unusual frames can be sent); everything that then arrives at a's and b's
//! eth0 is captured. The probes run once with every pod in `off` (kernel
//! routing) and once in each arrangement of modes, and the captures must be
//! equal byte for byte, unless the probe is in INTENDED, each with its
//! reason: every pod in each XDP mode (native/generic x devmap/cpumap), every
//! pod in tc, and the mixed pairs (the sender a in tc and b, c in native,
//! generic or off, and each of those the other way round). Then a seeded
//! random run (seed printed, `XDPCNI_EQ_SEED` / `XDPCNI_EQ_FRAMES` to replay
//! or lengthen) compares a few thousand generated frames the same way.
//!
//! What is not compared, and why: frames the node itself sends to resolve a
//! pod's address (ARP, neighbour solicitations) exist only on the kernel
//! path, which resolves neighbours; the fast path takes the MAC from the
//! endpoint record. The pods' own stacks are silenced (INPUT dropped in the
//! pods, neighbour advertisements excepted) so that every captured frame is
//! the node's doing, not the pods' (whose replies carry IP IDs and sequence
//! numbers that differ between runs).
//!
//! Needs root, bpffs, iptables and containernetworking-plugins.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
    time::{Duration, Instant},
};
use xdpcni_ebpf::testing::RawMaps;

use serde_json::json;
use xdpcni_e2e::{
    capture::{silence_stack, Capture},
    cni::{Call, Network},
    in_netns,
    netns::Netns,
    packet::{self, checksum, eth, fix_l4_v6, ipv4_full, pick, random_bytes, ETH_P_IP, ETH_P_IPV6},
    traffic::ping,
    PinDir,
};
use xdpcni_ebpf::{abi::RedirectPolicy, AttachMode, Datapath, Maps};
use xdpcni_host::{
    pod::{self, XdpMode},
    state::{self, Record},
};

const ETH_P_ARP: u16 = 0x0806;
const ETH_P_8021Q: u16 = 0x8100;
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

/// The XDP modes compared against `off`.
const XDP_MODES: [(&str, AttachMode, RedirectPolicy); 4] = [
    ("native/devmap", AttachMode::Native, RedirectPolicy::Devmap),
    ("native/cpumap", AttachMode::Native, RedirectPolicy::Cpumap),
    (
        "generic/devmap",
        AttachMode::Generic,
        RedirectPolicy::Devmap,
    ),
    (
        "generic/cpumap",
        AttachMode::Generic,
        RedirectPolicy::Cpumap,
    ),
];

/// An arrangement of the pods' modes: a (the sender of almost every probe)
/// in one, b (the receiver) and c in another.
#[derive(Clone, Copy, Debug)]
struct Setup {
    a: (XdpMode, RedirectPolicy),
    others: (XdpMode, RedirectPolicy),
}

impl Setup {
    /// Every pod in `mode`.
    const fn all(mode: XdpMode, redirect: RedirectPolicy) -> Self {
        Self {
            a: (mode, redirect),
            others: (mode, redirect),
        }
    }

    fn name(&self) -> String {
        let one = |(m, r): (XdpMode, RedirectPolicy)| match m {
            XdpMode::Native | XdpMode::Generic => {
                format!("{m}/{}", r.as_str())
            }
            _ => m.to_string(),
        };
        if self.a == self.others {
            one(self.a)
        } else {
            format!("a {} -> b {}", one(self.a), one(self.others))
        }
    }
}

/// Every pod in each XDP mode.
fn xdp_setups() -> Vec<Setup> {
    XDP_MODES
        .iter()
        .map(|(_, m, r)| Setup::all(XdpMode::from(*m), *r))
        .collect()
}

const TC: (XdpMode, RedirectPolicy) = (XdpMode::Tc, RedirectPolicy::Devmap);

/// Every pod in tc.
fn tc_setups() -> Vec<Setup> {
    vec![Setup::all(TC.0, TC.1)]
}

/// tc against each other mode, both ways: the sender in tc and the
/// receiver in native, generic or off, then the other way round (b's
/// replies and b's probes cross in the other direction in each). A tc
/// sender ignores its destination's cpumap policy (two_pods.rs shows it).
fn tc_mixed_setups() -> Vec<Setup> {
    let others = [
        (XdpMode::Native, RedirectPolicy::Devmap),
        (XdpMode::Generic, RedirectPolicy::Devmap),
        (XdpMode::Off, RedirectPolicy::Devmap),
    ];
    let mut v = Vec::new();
    for o in others {
        v.push(Setup { a: TC, others: o });
        v.push(Setup { a: o, others: TC });
    }
    v
}

/// Probes whose captures may differ, and why. Each is a limit of any fast
/// path that bypasses netfilter; the README's "what the fast path does not
/// see" says what a user should do about it.
const INTENDED: &[(&str, &str)] = &[(
    "v4 FORWARD DROP rule by port only",
    "the fast path (XDP, and tc ingress) runs before netfilter, and the agent \
     detects only FORWARD rules that name a pod address (-s/-d); a rule \
     matching ports alone is not seen (README: what the fast path does not see)",
)];

struct Pod {
    ns: Netns,
    rec: Record,
    v4: Ipv4Addr,
    v6: Ipv6Addr,
    /// eth0: sends, and captures what arrives.
    eth0: Capture,
    /// The CNI ADD result (the prevResult of a chained plugin).
    result: serde_json::Value,
}

impl Pod {
    fn host_mac(&self) -> [u8; 6] {
        self.rec.host_mac.0
    }

    fn pod_mac(&self) -> [u8; 6] {
        self.rec.pod_mac.0
    }

    fn send(&self, frame: &[u8]) {
        self.eth0.send(frame).unwrap();
    }

    /// Everything received since the last call.
    fn drain(&self) -> Vec<Vec<u8>> {
        self.eth0.drain()
    }
}

struct Lab {
    pins: PinDir,
    net: Network,
    a: Pod,
    b: Pod,
    c: Pod,
}

fn first_v4(ips: &[IpAddr]) -> Ipv4Addr {
    ips.iter()
        .find_map(|i| match i {
            IpAddr::V4(v) => Some(*v),
            IpAddr::V6(_) => None,
        })
        .unwrap()
}

fn first_v6(ips: &[IpAddr]) -> Ipv6Addr {
    ips.iter()
        .find_map(|i| match i {
            IpAddr::V6(v) => Some(*v),
            IpAddr::V4(_) => None,
        })
        .unwrap()
}

impl Lab {
    fn new() -> Self {
        let pins = PinDir::new("xq").unwrap();
        let net = Network::new(pins.path(), "1.1.0", Network::dual_stack()).unwrap();
        in_netns(&net.node, || Ok(Datapath::open(pins.path()).map(drop)?)).unwrap();
        // The test node's ICMP rate limits and fragment timers (its own
        // namespace's sysctls) would make what arrives depend on timing.
        net.node.for_differential_tests().unwrap();
        let add = |id: &str, mtu: u32| {
            let ns = Netns::new("xe").unwrap();
            let out = net
                .call(
                    &Call::new("ADD", id, Some(&ns.path())),
                    &json!({ "mtu": mtu }),
                )
                .unwrap();
            assert_eq!(out.status, 0, "ADD {id}: {:?} {}", out.json, net.log());
            // Silence the pod's own stack: only the node's doing is captured.
            silence_stack(&ns).unwrap();
            let rec = state::list(&net.dir.path().join("state"))
                .unwrap()
                .into_iter()
                .find(|r| r.container_id == id)
                .unwrap();
            let eth0 = Capture::open(&ns, "eth0").unwrap();
            Pod {
                v4: first_v4(&rec.ips),
                v6: first_v6(&rec.ips),
                ns,
                rec,
                eth0,
                result: out.json,
            }
        };
        let a = add("a", 1500);
        let b = add("b", 1400);
        let c = add("c", 1500);
        // b publishes udp/80 as hostPort 8000 through Debian's portmap,
        // chained after xdpcni as a runtime would (it speaks up to 1.0.0).
        let portmap = json!({
            "cniVersion": "1.0.0", "name": "xdpcni-test", "type": "portmap",
            "capabilities": { "portMappings": true },
            "runtimeConfig": { "portMappings": [
                { "hostPort": 8000, "containerPort": 80, "protocol": "udp" },
            ] },
            "prevResult": b.result,
        });
        let mut portmap = portmap;
        portmap["prevResult"]["cniVersion"] = json!("1.0.0");
        let out = xdpcni_e2e::cni::exec(
            &Path::new(xdpcni_e2e::cni::REFERENCE_PLUGINS).join("portmap"),
            &net.cni_path,
            &net.node,
            &portmap,
            &Call::new("ADD", "b", Some(&b.ns.path())),
        )
        .unwrap();
        assert_eq!(out.status, 0, "portmap ADD: {:?} {}", out.json, out.stderr);
        Self { pins, net, a, b, c }
    }

    fn pods(&self) -> [&Pod; 3] {
        [&self.a, &self.b, &self.c]
    }

    /// Every pod in `mode` with `redirect`, as the agent would make it.
    fn set_mode(&self, mode: XdpMode, redirect: RedirectPolicy) {
        self.set_setup(&Setup::all(mode, redirect));
    }

    /// The pods as `setup` arranges them, as the agent would make them.
    fn set_setup(&self, setup: &Setup) {
        self.set_mode_of(&["a"], setup.a.0, setup.a.1);
        self.set_mode_of(&["b", "c"], setup.others.0, setup.others.1);
        // Warm the node's neighbour entries both ways, as traffic would.
        for (from, to) in [(&self.a, &self.b), (&self.b, &self.a)] {
            ping(&from.ns, IpAddr::V4(to.v4), 1).unwrap_or_default();
            ping(&from.ns, IpAddr::V6(to.v6), 1).unwrap_or_default();
        }
        std::thread::sleep(Duration::from_millis(50));
        self.a.drain();
        self.b.drain();
    }

    /// The pods with these container IDs in `mode` with `redirect`, through
    /// the agent's own attach path (`apply::apply`: devmap entry, cpumap
    /// CPUs, endpoint records, link, offloads).
    fn set_mode_of(&self, ids: &[&str], mode: XdpMode, redirect: RedirectPolicy) {
        let recs: Vec<Record> = self
            .pods()
            .iter()
            .filter(|p| ids.contains(&p.rec.container_id.as_str()))
            .map(|p| p.rec.clone())
            .collect();
        let pins = self.pins.path().to_path_buf();
        in_netns(&self.net.node, move || {
            let mut dp = Datapath::open_existing(&pins)?;
            let policy = xdpcni_agent::wish::Wish {
                mode,
                redirect,
                cpu_mask: pod::online_cpus(),
            };
            for r in &recs {
                let done = xdpcni_agent::apply::apply(&mut dp, r, &policy, false, false)?;
                anyhow::ensure!(done.mode == mode, "{} refused: {:?}", mode, done.problems);
            }
            Ok(())
        })
        .unwrap();
    }

    /// What the agent does about the node's FORWARD rules (the same
    /// functions): the pods a DROP/REJECT rule names become kernel-only.
    fn apply_forward_rules(&self) -> Vec<String> {
        let save = in_netns(&self.net.node, || Ok(xdpcni_agent::forward::scan()?)).unwrap();
        let pods: Vec<((String, String), Vec<IpAddr>)> = self
            .pods()
            .iter()
            .map(|p| {
                (
                    (String::new(), p.rec.container_id.clone()),
                    p.rec.ips.clone(),
                )
            })
            .collect();
        let named: Vec<String> =
            xdpcni_agent::forward::blocked(&save, pods.iter().map(|(k, v)| (k, v.as_slice())))
                .into_keys()
                .map(|k| k.1)
                .collect();
        let ids: Vec<&str> = named.iter().map(String::as_str).collect();
        self.set_mode_of(&ids, XdpMode::Off, RedirectPolicy::Devmap);
        named
    }
}

/// Who sends a step of a probe.
#[derive(Clone, Copy, Debug)]
enum From {
    A,
    B,
}

/// A named frame sequence, and what the node must hold while it runs.
struct Probe {
    name: String,
    steps: Vec<(From, Vec<u8>)>,
    /// Node commands run before (and undone after) the probe.
    node_setup: Vec<Vec<String>>,
    node_teardown: Vec<Vec<String>>,
    /// The node's FORWARD rules change: apply the agent's reaction.
    forward_rules: bool,
}

impl Probe {
    fn new(name: &str, steps: Vec<(From, Vec<u8>)>) -> Self {
        Self {
            name: name.into(),
            steps,
            node_setup: Vec::new(),
            node_teardown: Vec::new(),
            forward_rules: false,
        }
    }
}

/// What arrived at a's and b's eth0, noise removed, sorted (frames of
/// different flows may interleave differently on the two paths).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    at_a: Vec<Vec<u8>>,
    at_b: Vec<Vec<u8>>,
}

/// Frames the node sends to resolve a pod's address: only the kernel path
/// resolves neighbours.
fn is_node_resolution(frame: &[u8], node_mac: [u8; 6]) -> bool {
    if frame.len() < 14 || frame[6..12] != node_mac {
        return false;
    }
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    if ethertype == ETH_P_ARP {
        return true;
    }
    // ICMPv6 router and neighbour discovery (133-137), no extension headers.
    ethertype == ETH_P_IPV6
        && frame.len() > 54
        && frame[20] == 58
        && (133..=137).contains(&frame[54])
}

/// The node's own IPv4 address (on its loopback), the source of the ICMP
/// errors it sends.
const NODE4: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);

/// The one normalisation: an IPv4 packet the node itself originates (an
/// ICMP error) carries an IP ID from the kernel's per-destination counter,
/// which moves between runs whatever the path. Its ID is zeroed and its
/// header checksum recomputed; everything else is compared as captured.
fn normalise(frame: &mut [u8]) {
    if frame.len() < 34 || u16::from_be_bytes([frame[12], frame[13]]) != ETH_P_IP {
        return;
    }
    if frame[26..30] != NODE4.octets() {
        return;
    }
    let hlen = usize::from(frame[14] & 0x0f) * 4;
    if frame.len() < 14 + hlen {
        return;
    }
    frame[18..20].copy_from_slice(&[0, 0]);
    frame[24..26].copy_from_slice(&[0, 0]);
    let c = checksum(&frame[14..14 + hlen]);
    frame[24..26].copy_from_slice(&c.to_be_bytes());
}

/// Runs a probe with the pods as `setup` arranges them (restored after a
/// probe whose FORWARD rules made some of them kernel-only).
fn run_probe(lab: &Lab, probe: &Probe, setup: &Setup) -> Seen {
    for cmd in &probe.node_setup {
        let args: Vec<&str> = cmd.iter().map(String::as_str).collect();
        lab.net.node.exec(&args).unwrap();
    }
    let named = if probe.forward_rules {
        lab.apply_forward_rules()
    } else {
        Vec::new()
    };
    let seen = send_and_capture(lab, &probe.steps);
    for cmd in &probe.node_teardown {
        let args: Vec<&str> = cmd.iter().map(String::as_str).collect();
        lab.net.node.exec(&args).unwrap();
    }
    if !named.is_empty() {
        lab.set_setup(setup);
    }
    seen
}

/// Sends `steps` 3 ms apart, then captures until both pods have been quiet
/// for 60 ms.
fn send_and_capture(lab: &Lab, steps: &[(From, Vec<u8>)]) -> Seen {
    lab.a.drain();
    lab.b.drain();
    for (from, frame) in steps {
        match from {
            From::A => lab.a.send(frame),
            From::B => lab.b.send(frame),
        }
        std::thread::sleep(Duration::from_millis(3));
    }
    let (mut at_a, mut at_b) = (Vec::new(), Vec::new());
    let start = Instant::now();
    let mut last = Instant::now();
    while last.elapsed() < Duration::from_millis(60) && start.elapsed() < Duration::from_secs(2) {
        let (x, y) = (lab.a.drain(), lab.b.drain());
        if !x.is_empty() || !y.is_empty() {
            last = Instant::now();
        }
        at_a.extend(x);
        at_b.extend(y);
        std::thread::sleep(Duration::from_millis(5));
    }
    at_a.retain(|f| !is_node_resolution(f, lab.a.host_mac()));
    at_b.retain(|f| !is_node_resolution(f, lab.b.host_mac()));
    // An ICMP error about another probe's packet (a neighbour that failed
    // seconds after its probe, say) is that probe's, not this one's.
    let sent: Vec<&[u8]> = steps.iter().map(|(_, f)| f.as_slice()).collect();
    at_a.retain(|f| !is_error_about_another(f, &sent));
    at_b.retain(|f| !is_error_about_another(f, &sent));
    at_a.iter_mut()
        .chain(at_b.iter_mut())
        .for_each(|f| normalise(f));
    at_a.sort();
    at_b.sort();
    Seen { at_a, at_b }
}

/// The addresses and the first 8 bytes past the fixed header of the IP
/// packet at `ip` (IPv4 options skipped), as far as the bytes go.
fn ip_flow(ip: &[u8]) -> Option<(&[u8], &[u8])> {
    match ip.first()? >> 4 {
        4 => {
            let ihl = usize::from(ip[0] & 0x0f) * 4;
            Some((
                ip.get(12..20)?,
                ip.get(ihl..)?.get(..8.min(ip.len() - ihl))?,
            ))
        }
        6 => Some((ip.get(8..40)?, ip.get(40..)?.get(..8.min(ip.len() - 40))?)),
        _ => None,
    }
}

/// The packet an ICMP or ICMPv6 error (the IP packet at `ip`) quotes.
fn error_quote(ip: &[u8]) -> Option<&[u8]> {
    match ip.first()? >> 4 {
        4 if ip.get(9) == Some(&1) => {
            let ihl = usize::from(ip[0] & 0x0f) * 4;
            match ip.get(ihl)? {
                3 | 11 | 12 => ip.get(ihl + 8..),
                _ => None,
            }
        }
        6 if ip.get(6) == Some(&58) => match ip.get(40)? {
            1..=4 => ip.get(48..),
            _ => None,
        },
        _ => None,
    }
}

/// Whether `frame` is an ICMP or ICMPv6 error whose quoted packet none of
/// the frames `sent` carried or quoted (its addresses and first 8 bytes past
/// the IP header, every probe's own ports, differ from each one's). A frame
/// it cannot read is kept.
fn is_error_about_another(frame: &[u8], sent: &[&[u8]]) -> bool {
    let Some((q_addrs, q_head)) = frame.get(14..).and_then(error_quote).and_then(ip_flow) else {
        return false;
    };
    let same = |flow: Option<(&[u8], &[u8])>| match flow {
        Some((addrs, head)) => {
            let n = head.len().min(q_head.len());
            addrs == q_addrs && head[..n] == q_head[..n]
        }
        None => false,
    };
    !sent.iter().any(|f| {
        let ip = f.get(14..).unwrap_or_default();
        ip_flow(ip).is_none() || same(ip_flow(ip)) || same(error_quote(ip).and_then(ip_flow))
    })
}

/// What kernel routing delivered (`want`) against the fast path (`got`),
/// frame by frame in hex.
fn describe(want: &Seen, got: &Seen) -> String {
    format!(
        "  kernel: at a [{}] at b [{}]\n    {}\n    {}\n  xdp:    at a [{}] at b [{}]\n    {}\n    {}",
        want.at_a.len(),
        want.at_b.len(),
        hex(&want.at_a),
        hex(&want.at_b),
        got.at_a.len(),
        got.at_b.len(),
        hex(&got.at_a),
        hex(&got.at_b),
    )
}

fn hex(frames: &[Vec<u8>]) -> String {
    frames
        .iter()
        .map(|f| {
            f.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join("")
        })
        .collect::<Vec<_>>()
        .join("\n      ")
}

// ---- frame builders ----------------------------------------------------

fn tcp_syn(sport: u16, dport: u16) -> Vec<u8> {
    let mut t = packet::tcp(sport, dport);
    t[13] = 0x02;
    t
}

fn udp(sport: u16, dport: u16, len: usize) -> Vec<u8> {
    packet::udp(sport, dport, &vec![0x5a; len])
}

fn v4(from: &Pod, src: Ipv4Addr, dst: Ipv4Addr, ttl: u8, proto: u8, l4: &[u8]) -> Vec<u8> {
    eth(
        from.host_mac(),
        from.pod_mac(),
        ETH_P_IP,
        &ipv4_full(src, dst, ttl, proto, 0x4000, &[], l4),
    )
}

fn v6(from: &Pod, src: Ipv6Addr, dst: Ipv6Addr, hop: u8, nh: u8, l4: &[u8]) -> Vec<u8> {
    eth(
        from.host_mac(),
        from.pod_mac(),
        ETH_P_IPV6,
        &packet::ipv6(src, dst, hop, nh, l4),
    )
}

fn probes(lab: &Lab) -> Vec<Probe> {
    let (a, b, c) = (&lab.a, &lab.b, &lab.c);
    let node4 = NODE4;
    let node6: Ipv6Addr = "fd99::1".parse().unwrap();
    let nothing4 = Ipv4Addr::new(10, 78, 0, 250);
    let nothing6: Ipv6Addr = "fd78::fa".parse().unwrap();
    let mut p = Vec::new();
    let one = |name: &str, f: Vec<u8>| Probe::new(name, vec![(From::A, f)]);

    // IPv4: the common protocols, TTLs.
    p.push(one(
        "v4 udp",
        v4(a, a.v4, b.v4, 64, 17, &udp(4000, 5000, 32)),
    ));
    p.push(one(
        "v4 tcp syn",
        v4(a, a.v4, b.v4, 64, 6, &tcp_syn(4001, 80)),
    ));
    p.push(one(
        "v4 icmp echo",
        v4(a, a.v4, b.v4, 64, 1, &packet::icmp(8, 7, 1)),
    ));
    for ttl in [1u8, 2, 255] {
        p.push(one(
            &format!("v4 ttl {ttl}"),
            v4(a, a.v4, b.v4, ttl, 17, &udp(4002, 5000, 16)),
        ));
    }
    // Options: record route (type 7, length 7, pointer 4, one slot) + EOL.
    let rr = [7u8, 7, 4, 0, 0, 0, 0, 0];
    p.push(one(
        "v4 record route option",
        eth(
            a.host_mac(),
            a.pod_mac(),
            ETH_P_IP,
            &ipv4_full(a.v4, b.v4, 64, 17, 0x4000, &rr, &udp(4003, 5000, 16)),
        ),
    ));
    let mut bad = v4(a, a.v4, b.v4, 64, 17, &udp(4004, 5000, 16));
    bad[24] ^= 0x5a;
    p.push(one("v4 bad header checksum", bad));
    let good = v4(a, a.v4, b.v4, 64, 17, &udp(4005, 5000, 40));
    let mut long = good.clone();
    let tot = u16::from_be_bytes([long[16], long[17]]) + 8;
    long[16..18].copy_from_slice(&tot.to_be_bytes());
    long[24..26].copy_from_slice(&[0, 0]);
    let c4 = checksum(&long[14..34]);
    long[24..26].copy_from_slice(&c4.to_be_bytes());
    p.push(one("v4 tot_len larger than the frame", long));
    let mut padded = good.clone();
    padded.extend_from_slice(&[0xee; 8]);
    p.push(one("v4 trailing padding", padded));
    // Fragments of one datagram: first, middle, last; each probe its own IP
    // ID, so the kernel's reassembly never mixes two probes.
    let frag = |id: u16, off8: u16, mf: bool, len: usize| {
        let mut ip = ipv4_full(
            a.v4,
            b.v4,
            64,
            17,
            off8 | if mf { 0x2000 } else { 0 },
            &[],
            &vec![0x33; len],
        );
        ip[4..6].copy_from_slice(&id.to_be_bytes());
        ip[10..12].copy_from_slice(&[0, 0]);
        let c = checksum(&ip[..20]);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        eth(a.host_mac(), a.pod_mac(), ETH_P_IP, &ip)
    };
    p.push(Probe::new(
        "v4 fragments first middle last",
        vec![
            (From::A, frag(0x4001, 0, true, 64)),
            (From::A, frag(0x4001, 8, true, 64)),
            (From::A, frag(0x4001, 16, false, 24)),
        ],
    ));
    p.push(one("v4 first fragment alone", frag(0x4002, 0, true, 64)));
    p.push(one("v4 middle fragment alone", frag(0x4003, 40, true, 64)));
    // Larger than b's MTU (1400): DF -> fragmentation needed; no DF ->
    // fragmented by the kernel.
    p.push(one(
        "v4 DF larger than the destination MTU",
        v4(a, a.v4, b.v4, 64, 17, &udp(4006, 5000, 1420)),
    ));
    p.push(one(
        "v4 no DF larger than the destination MTU",
        eth(
            a.host_mac(),
            a.pod_mac(),
            ETH_P_IP,
            &ipv4_full(a.v4, b.v4, 64, 17, 0, &[], &udp(4007, 5000, 1420)),
        ),
    ));
    // An ICMP error quoting a flow b -> a (port unreachable).
    let quoted = ipv4_full(b.v4, a.v4, 64, 17, 0x4000, &[], &udp(5000, 4000, 8));
    let mut err = vec![3u8, 3, 0, 0, 0, 0, 0, 0];
    err.extend_from_slice(&quoted[..28]);
    let ce = checksum(&err);
    err[2..4].copy_from_slice(&ce.to_be_bytes());
    p.push(one(
        "v4 icmp error quoting a flow",
        v4(a, a.v4, b.v4, 64, 1, &err),
    ));
    // L2: other unicast MACs, broadcast, multicast, VLAN, ARP.
    for (what, mac) in [
        ("all-zero", [0u8; 6]),
        ("another pod's", b.pod_mac()),
        ("unknown", [0x02, 0x11, 0x22, 0x33, 0x44, 0x55]),
    ] {
        let mut f = v4(a, a.v4, b.v4, 64, 17, &udp(4008, 5000, 16));
        f[..6].copy_from_slice(&mac);
        p.push(one(&format!("v4 destination MAC {what}"), f.clone()));
        let mut f6 = v6(a, a.v6, b.v6, 64, 17, &udp(4008, 5000, 16));
        fix_l4_v6(&mut f6);
        f6[..6].copy_from_slice(&mac);
        p.push(one(&format!("v6 destination MAC {what}"), f6));
    }
    let mut bcast = v4(a, a.v4, b.v4, 64, 17, &udp(4009, 5000, 16));
    bcast[..6].copy_from_slice(&[0xff; 6]);
    p.push(one("v4 broadcast MAC, unicast IP", bcast));
    p.push(one(
        "v4 multicast 224.0.0.1",
        eth(
            [0x01, 0, 0x5e, 0, 0, 1],
            a.pod_mac(),
            ETH_P_IP,
            &ipv4_full(
                a.v4,
                Ipv4Addr::new(224, 0, 0, 1),
                1,
                17,
                0,
                &[],
                &udp(4010, 5000, 8),
            ),
        ),
    ));
    let inner = ipv4_full(a.v4, b.v4, 64, 17, 0x4000, &[], &udp(4011, 5000, 16));
    let mut tagged = vec![0, 5];
    tagged.extend_from_slice(&ETH_P_IP.to_be_bytes());
    tagged.extend_from_slice(&inner);
    p.push(one(
        "vlan-tagged frame",
        eth(a.host_mac(), a.pod_mac(), ETH_P_8021Q, &tagged),
    ));
    let mut arp = vec![0, 1, 8, 0, 6, 4, 0, 1];
    arp.extend_from_slice(&a.pod_mac());
    arp.extend_from_slice(&a.v4.octets());
    arp.extend_from_slice(&[0; 6]);
    arp.extend_from_slice(&[169, 254, 1, 1]);
    p.push(one(
        "arp request for the gateway",
        eth([0xff; 6], a.pod_mac(), ETH_P_ARP, &arp),
    ));
    // Sources that are not a's.
    for (what, src) in [
        ("another pod's", c.v4),
        ("the node's", node4),
        ("nobody's", nothing4),
    ] {
        p.push(one(
            &format!("v4 source {what} address"),
            v4(a, src, b.v4, 64, 17, &udp(4012, 5000, 16)),
        ));
    }
    // A Service: the node DNATs 10.96.0.10:53 to b:5353; b's reply must be
    // un-DNATed, so the datapath knows b:5353 as a NAT'd port (the agent
    // does that from the Endpoints).
    let vip_rule = |op: &str| {
        vec![
            "iptables",
            "-t",
            "nat",
            op,
            "PREROUTING",
            "-d",
            "10.96.0.10",
            "-p",
            "udp",
            "--dport",
            "53",
            "-j",
            "DNAT",
            "--to-destination",
        ]
        .into_iter()
        .map(String::from)
        .chain([format!("{}:5353", b.v4)])
        .collect::<Vec<String>>()
    };
    let mut svc = Probe::new(
        "v4 Service DNAT and the un-DNAT of its reply",
        vec![
            (From::A, v4(a, a.v4, VIP, 64, 17, &udp(40000, 53, 12))),
            (
                From::B,
                eth(
                    b.host_mac(),
                    b.pod_mac(),
                    ETH_P_IP,
                    &ipv4_full(b.v4, a.v4, 64, 17, 0x4000, &[], &udp(5353, 40000, 20)),
                ),
            ),
        ],
    );
    svc.node_setup.push(vip_rule("-A"));
    svc.node_teardown.push(vip_rule("-D"));
    p.push(svc);
    // A hostPort: portmap DNATs the node's 8000/udp to b:80; b's reply must
    // be un-DNATed (the agent registers hostPort targets as NAT'd ports).
    p.push(Probe::new(
        "v4 hostPort through portmap and the un-DNAT of its reply",
        vec![
            (From::A, v4(a, a.v4, NODE4, 64, 17, &udp(41000, 8000, 12))),
            (
                From::B,
                eth(
                    b.host_mac(),
                    b.pod_mac(),
                    ETH_P_IP,
                    &ipv4_full(b.v4, a.v4, 64, 17, 0x4000, &[], &udp(80, 41000, 20)),
                ),
            ),
        ],
    ));
    // An administrator's FORWARD DROP rule, inserted for the probe (the
    // agent's reaction applied) and deleted after it.
    let forward_probe = |name: &str, matches: &[String], frame: Vec<u8>| {
        let rule = |op: &str| {
            let mut r: Vec<String> = vec!["iptables".into(), op.into(), "FORWARD".into()];
            r.extend(matches.iter().cloned());
            r.extend(["-j".into(), "DROP".into()]);
            r
        };
        let mut probe = one(name, frame);
        probe.node_setup.push(rule("-I"));
        probe.node_teardown.push(rule("-D"));
        probe.forward_rules = true;
        probe
    };
    // Between the two pods.
    p.push(forward_probe(
        "v4 FORWARD DROP rule between the pods",
        &["-s".into(), a.v4.to_string(), "-d".into(), b.v4.to_string()],
        v4(a, a.v4, b.v4, 64, 17, &udp(4013, 5000, 16)),
    ));
    // One the agent cannot attribute to pods: ports only.
    p.push(forward_probe(
        "v4 FORWARD DROP rule by port only",
        &["-p", "udp", "--dport", "5001"].map(String::from),
        v4(a, a.v4, b.v4, 64, 17, &udp(4014, 5001, 16)),
    ));

    // IPv6.
    let six = |name: &str, src: Ipv6Addr, dst: Ipv6Addr, hop: u8, nh: u8, l4: Vec<u8>| {
        let mut f = v6(a, src, dst, hop, nh, &l4);
        fix_l4_v6(&mut f);
        Probe::new(name, vec![(From::A, f)])
    };
    p.push(six("v6 udp", a.v6, b.v6, 64, 17, udp(4100, 5000, 32)));
    p.push(six("v6 tcp syn", a.v6, b.v6, 64, 6, tcp_syn(4101, 80)));
    p.push(six(
        "v6 icmp echo",
        a.v6,
        b.v6,
        64,
        58,
        packet::icmp(128, 7, 1),
    ));
    for hop in [1u8, 2, 255] {
        p.push(six(
            &format!("v6 hop limit {hop}"),
            a.v6,
            b.v6,
            hop,
            17,
            udp(4102, 5000, 16),
        ));
    }
    // Extension headers: hop-by-hop (PadN), routing (type 4, segments left
    // 0), fragment (first of two).
    let ext = |nh: u8, hdr: Vec<u8>| {
        let mut l4 = hdr;
        l4.extend_from_slice(&udp(4103, 5000, 16));
        let _ = nh;
        l4
    };
    p.push(six(
        "v6 hop-by-hop header",
        a.v6,
        b.v6,
        64,
        0,
        ext(0, vec![17, 0, 1, 4, 0, 0, 0, 0]),
    ));
    let mut srh = vec![17, 2, 4, 0, 0, 0, 0, 0];
    srh.extend_from_slice(&b.v6.octets());
    p.push(six("v6 routing header", a.v6, b.v6, 64, 43, ext(43, srh)));
    p.push(six(
        "v6 fragment header",
        a.v6,
        b.v6,
        64,
        44,
        ext(44, vec![17, 0, 0, 1, 0, 0, 0x12, 0x34]),
    ));
    let good6 = {
        let mut f = v6(a, a.v6, b.v6, 64, 17, &udp(4104, 5000, 40));
        fix_l4_v6(&mut f);
        f
    };
    let mut long6 = good6.clone();
    let pl = u16::from_be_bytes([long6[18], long6[19]]) + 8;
    long6[18..20].copy_from_slice(&pl.to_be_bytes());
    p.push(one("v6 payload length larger than the frame", long6));
    let mut padded6 = good6;
    padded6.extend_from_slice(&[0xee; 8]);
    p.push(one("v6 trailing padding", padded6));
    p.push(six(
        "v6 larger than the destination MTU",
        a.v6,
        b.v6,
        64,
        17,
        udp(4105, 5000, 1400),
    ));
    let mut err6 = vec![1u8, 4, 0, 0, 0, 0, 0, 0];
    let q6 = packet::ipv6(b.v6, a.v6, 64, 17, &udp(5000, 4100, 8));
    err6.extend_from_slice(&q6[..48]);
    p.push(six(
        "v6 icmp error quoting a flow",
        a.v6,
        b.v6,
        64,
        58,
        err6,
    ));
    p.push(Probe::new("v6 multicast ff02::1", {
        let mut f = eth(
            [0x33, 0x33, 0, 0, 0, 1],
            a.pod_mac(),
            ETH_P_IPV6,
            &packet::ipv6(a.v6, "ff02::1".parse().unwrap(), 1, 17, &udp(4106, 5000, 8)),
        );
        fix_l4_v6(&mut f);
        vec![(From::A, f)]
    }));
    // A neighbour solicitation for the gateway fe80::1.
    let ll: Ipv6Addr = "fe80::2".parse().unwrap();
    let mut ns = vec![135u8, 0, 0, 0, 0, 0, 0, 0];
    ns.extend_from_slice(&"fe80::1".parse::<Ipv6Addr>().unwrap().octets());
    ns.extend_from_slice(&[1, 1]);
    ns.extend_from_slice(&a.pod_mac());
    let mut nsf = eth(
        [0x33, 0x33, 0xff, 0, 0, 1],
        a.pod_mac(),
        ETH_P_IPV6,
        &packet::ipv6(ll, "ff02::1:ff00:1".parse().unwrap(), 255, 58, &ns),
    );
    fix_l4_v6(&mut nsf);
    p.push(one("v6 neighbour solicitation for the gateway", nsf));
    for (what, src) in [
        ("another pod's", c.v6),
        ("the node's", node6),
        ("nobody's", nothing6),
    ] {
        p.push(six(
            &format!("v6 source {what} address"),
            src,
            b.v6,
            64,
            17,
            udp(4107, 5000, 16),
        ));
    }
    p
}

/// Runs every probe in `off`, then in each XDP mode, and compares.
#[test]
fn every_probe_arrives_as_kernel_routing_delivers_it_in_every_xdp_mode() {
    compare_probes(&xdp_setups());
}

/// The same probes with every pod in tc: the same decisions on the skb.
#[test]
fn tc_every_probe_arrives_as_kernel_routing_delivers_it() {
    compare_probes(&tc_setups());
}

/// The same probes across tc and every other mode, both ways.
#[test]
fn tc_mixed_pairs_every_probe_arrives_as_kernel_routing_delivers_it() {
    compare_probes(&tc_mixed_setups());
}

/// Runs every probe in `off`, then in each of `setups`, and compares.
fn compare_probes(setups: &[Setup]) {
    let lab = Lab::new();
    // What the agent does for a Service backend: b:5353/udp is NAT'd.
    in_netns(&lab.net.node, || {
        let mut maps = Maps::open_pinned(lab.pins.path())?;
        maps.raw_add_nat_port(IpAddr::V4(lab.b.v4), xdpcni_ebpf::L4Proto::Udp, 5353)?;
        maps.raw_add_nat_port(IpAddr::V4(lab.b.v4), xdpcni_ebpf::L4Proto::Udp, 80)?;
        Ok(())
    })
    .unwrap();
    let probes = probes(&lab);
    lab.set_mode(XdpMode::Off, RedirectPolicy::Devmap);
    let kernel: Vec<Seen> = probes
        .iter()
        .map(|p| run_probe(&lab, p, &Setup::all(XdpMode::Off, RedirectPolicy::Devmap)))
        .collect();
    // The harness must see something: most probes reach b or come back.
    let delivered = kernel.iter().filter(|s| !s.at_b.is_empty()).count();
    assert!(
        delivered >= probes.len() / 3,
        "only {delivered} of {} probes reached b through the kernel",
        probes.len()
    );
    let mut failures = Vec::new();
    let mut intended_seen = BTreeMap::new();
    for setup in setups {
        let mode_name = setup.name();
        lab.set_setup(setup);
        for (probe, want) in probes.iter().zip(&kernel) {
            let got = run_probe(&lab, probe, setup);
            if &got == want {
                continue;
            }
            if let Some((_, why)) = INTENDED.iter().find(|(n, _)| *n == probe.name) {
                intended_seen.insert(probe.name.clone(), *why);
                continue;
            }
            failures.push(format!(
                "{mode_name}: {}\n{}",
                probe.name,
                describe(want, &got)
            ));
        }
    }
    lab.set_mode(XdpMode::Off, RedirectPolicy::Devmap);
    for (name, why) in &intended_seen {
        eprintln!("intended difference: {name}: {why}");
    }
    // An intended difference that no longer differs is a stale entry: the
    // README's list of what the fast path does not see would be wrong.
    for (name, _) in INTENDED {
        if !intended_seen.contains_key(*name) {
            failures.push(format!(
                "{name}: listed in INTENDED but delivered as the kernel does in every setup"
            ));
        }
    }
    eprintln!(
        "{} probes x {} setups compared with kernel routing; {} reached b via the kernel",
        probes.len(),
        setups.len(),
        delivered
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    drop(lab);
}

// ---- seeded random frames ---------------------------------------------------

/// One frame from a: mostly well-formed traffic to b, with every field the
/// datapath reads sometimes wrong, odd or hostile.
fn random_frame(rng: &mut fastrand::Rng, lab: &Lab) -> Vec<u8> {
    let (a, b, c) = (&lab.a, &lab.b, &lab.c);
    let is_v6 = rng.u8(..10) < 3;
    let len = if rng.u8(..20) == 0 {
        rng.usize(1300..1480)
    } else {
        rng.usize(0..200)
    };
    let proto = pick(
        rng,
        &[
            (40, 17u8),
            (30, 6),
            (20, if is_v6 { 58 } else { 1 }),
            (5, 47),
            (5, 0),
        ],
    );
    let mut l4 = match proto {
        17 => udp(rng.u16(1024..), rng.u16(1..), len),
        6 => {
            let mut t = packet::tcp(rng.u16(1024..), rng.u16(1..));
            t[4..12].copy_from_slice(&random_bytes(rng, 8));
            t[13] = rng.u8(..0x40);
            t.extend_from_slice(&random_bytes(rng, len));
            t
        }
        1 | 58 => {
            // Not ICMP timestamp (13): the node's reply carries its clock.
            let ty = if is_v6 {
                pick(
                    rng,
                    &[
                        (4, 128u8),
                        (2, 129),
                        (1, 1),
                        (1, 2),
                        (1, 3),
                        (1, 4),
                        (1, 135),
                    ],
                )
            } else {
                pick(rng, &[(4, 8u8), (2, 0), (1, 3), (1, 11), (1, 5), (1, 12)])
            };
            let mut m = vec![ty, rng.u8(..4), 0, 0];
            m.extend_from_slice(&random_bytes(rng, 4 + len));
            if !is_v6 {
                let ck = checksum(&m);
                m[2..4].copy_from_slice(&ck.to_be_bytes());
            }
            m
        }
        _ => random_bytes(rng, len),
    };
    let ttl = pick(rng, &[(1, 0u8), (3, 1), (3, 2), (1, 3), (10, 64), (2, 255)]);
    let mut frame = if is_v6 {
        let node6: Ipv6Addr = "fd99::1".parse().unwrap();
        let src = pick(
            rng,
            &[
                (90, a.v6),
                (4, c.v6),
                (3, node6),
                (3, "fd78::99".parse().unwrap()),
            ],
        );
        let dst = pick(
            rng,
            &[
                (85, b.v6),
                (5, c.v6),
                (4, node6),
                (3, "2001:db8::1".parse().unwrap()),
                (3, "fd78::77".parse().unwrap()),
            ],
        );
        let nh = if rng.u8(..20) == 0 {
            // An extension header in front.
            // No fragment header to the node itself: an incomplete local
            // reassembly ends in an ICMP error a second later, in whichever
            // batch is running then.
            let ext = if dst == node6 {
                pick(rng, &[(1, 0u8), (1, 43), (1, 60)])
            } else {
                pick(rng, &[(1, 0u8), (1, 43), (1, 44), (1, 60)])
            };
            let mut h = vec![proto, 0, 0, 0, 0, 0, 0, 0];
            if ext == 44 {
                h[2..4].copy_from_slice(&rng.u16(..).to_be_bytes());
            }
            h.extend_from_slice(&l4);
            l4 = h;
            ext
        } else {
            proto
        };
        let mut f = v6(a, src, dst, ttl, nh, &l4);
        if nh == proto {
            fix_l4_v6(&mut f);
        }
        if rng.u8(..20) == 0 {
            let pl = u16::from_be_bytes([f[18], f[19]]).wrapping_add(rng.u16(1..64));
            f[18..20].copy_from_slice(&pl.to_be_bytes());
        }
        f
    } else {
        let src = pick(
            rng,
            &[
                (90, a.v4),
                (4, c.v4),
                (3, NODE4),
                (3, Ipv4Addr::new(10, 78, 0, 199)),
            ],
        );
        let dst = pick(
            rng,
            &[
                (85, b.v4),
                (5, c.v4),
                (4, NODE4),
                (3, Ipv4Addr::new(192, 0, 2, 1)),
                (3, Ipv4Addr::new(10, 78, 0, 177)),
            ],
        );
        let frag = pick(
            rng,
            &[
                (60, 0x4000u16),
                (25, 0),
                (5, 0x2000),
                (5, 0x0010),
                (5, 0x2010),
            ],
        );
        // Nor fragments to the node (as for IPv6 above).
        let frag = if dst == NODE4 { frag & 0x4000 } else { frag };
        let opts: Vec<u8> = match rng.u8(..20) {
            0 => vec![1, 1, 1, 1],
            1 => vec![7, 7, 4, 0, 0, 0, 0, 0],
            _ => vec![],
        };
        let mut ip = ipv4_full(src, dst, ttl, proto, frag, &opts, &l4);
        // Its own IP ID: fragments of two frames never meet in reassembly.
        ip[4..6].copy_from_slice(&rng.u16(..).to_be_bytes());
        ip[10..12].copy_from_slice(&[0, 0]);
        let hl = usize::from(ip[0] & 0x0f) * 4;
        let ck = checksum(&ip[..hl]);
        ip[10..12].copy_from_slice(&ck.to_be_bytes());
        if rng.u8(..20) == 0 {
            ip[10] ^= rng.u8(1..);
        }
        if rng.u8(..20) == 0 {
            let tot = u16::from_be_bytes([ip[2], ip[3]]);
            let off = rng.u16(1..64);
            let tot = if rng.bool() {
                tot.wrapping_add(off)
            } else {
                tot.saturating_sub(off)
            };
            ip[2..4].copy_from_slice(&tot.to_be_bytes());
            ip[10..12].copy_from_slice(&[0, 0]);
            let hl = usize::from(ip[0] & 0x0f) * 4;
            let ck = checksum(&ip[..hl]);
            ip[10..12].copy_from_slice(&ck.to_be_bytes());
        }
        eth(a.host_mac(), a.pod_mac(), ETH_P_IP, &ip)
    };
    if rng.u8(..20) == 0 {
        let extra = rng.usize(1..32);
        frame.extend_from_slice(&random_bytes(rng, extra));
    }
    let l2 = pick(rng, &[(92, 0u8), (2, 1), (2, 2), (2, 3), (2, 4)]);
    match l2 {
        1 => frame[..6].copy_from_slice(&[0; 6]),
        2 => frame[..6].copy_from_slice(&[0xff; 6]),
        3 => frame[..6].copy_from_slice(&[0x01, 0, 0x5e, 0, 0, 9]),
        4 => frame[12..14].copy_from_slice(
            &pick(rng, &[(1, ETH_P_8021Q), (1, ETH_P_ARP), (1, 0x88b5)]).to_be_bytes(),
        ),
        _ => {}
    }
    frame.truncate(1514);
    frame
}

fn seed_and_frames() -> (u64, usize) {
    (
        xdpcni_e2e::env_or("XDPCNI_EQ_SEED", 0x0dd_c0ffee),
        xdpcni_e2e::env_or("XDPCNI_EQ_FRAMES", 2000),
    )
}

/// A few thousand seeded random frames through kernel routing and each XDP
/// mode, compared batch by batch (20 frames, sorted within the batch).
#[test]
fn seeded_random_frames_arrive_as_kernel_routing_delivers_them_in_every_xdp_mode() {
    compare_random(&xdp_setups());
}

/// The same seeded frames with every pod in tc, then a in tc and b in each
/// XDP mode and off, and the other way round.
#[test]
fn tc_seeded_random_frames_arrive_as_kernel_routing_delivers_them() {
    let mut setups = tc_setups();
    setups.extend(tc_mixed_setups());
    compare_random(&setups);
}

fn compare_random(setups: &[Setup]) {
    const BATCH: usize = 20;
    let (seed, n) = seed_and_frames();
    eprintln!("random equivalence: seed {seed} ({n} frames); replay with XDPCNI_EQ_SEED={seed} XDPCNI_EQ_FRAMES={n}");
    let lab = Lab::new();
    let frames: Vec<Vec<u8>> = {
        let mut rng = fastrand::Rng::with_seed(seed);
        (0..n).map(|_| random_frame(&mut rng, &lab)).collect()
    };
    let batches: Vec<Vec<(From, Vec<u8>)>> = frames
        .chunks(BATCH)
        .map(|c| c.iter().map(|f| (From::A, f.clone())).collect())
        .collect();
    lab.set_mode(XdpMode::Off, RedirectPolicy::Devmap);
    let kernel: Vec<Seen> = batches.iter().map(|b| send_and_capture(&lab, b)).collect();
    let reached: usize = kernel.iter().map(|s| s.at_b.len()).sum();
    let back: usize = kernel.iter().map(|s| s.at_a.len()).sum();
    assert!(
        reached > n / 4,
        "only {reached} of {n} frames reached b via the kernel"
    );
    let mut failures = Vec::new();
    for setup in setups {
        let mode_name = setup.name();
        lab.set_setup(setup);
        for (i, (batch, want)) in batches.iter().zip(&kernel).enumerate() {
            let got = send_and_capture(&lab, batch);
            if &got != want {
                failures.push(format!(
                    "{mode_name}: batch {i} (frames {}..{})\n  sent:\n    {}\n{}",
                    i * BATCH,
                    i * BATCH + batch.len(),
                    hex(&batch.iter().map(|(_, f)| f.clone()).collect::<Vec<_>>()),
                    describe(want, &got),
                ));
            }
        }
    }
    lab.set_mode(XdpMode::Off, RedirectPolicy::Devmap);
    eprintln!(
        "random equivalence: {n} frames x {} setups; via the kernel {reached} reached b, {back} came back to a",
        setups.len()
    );
    assert!(
        failures.is_empty(),
        "seed {seed}: {} batches differ\n{}",
        failures.len(),
        failures.join("\n")
    );
}

// ---- hostile pods ------------------------------------------------------

/// Every path a pod can be on: kernel routing, then each XDP mode, then tc.
fn every_path() -> Vec<(String, XdpMode, RedirectPolicy)> {
    let mut v = vec![("off".to_string(), XdpMode::Off, RedirectPolicy::Devmap)];
    v.extend(
        XDP_MODES
            .iter()
            .map(|(n, m, r)| (n.to_string(), XdpMode::from(*m), *r)),
    );
    v.push(("tc".to_string(), TC.0, TC.1));
    v
}

/// Whether `frame` carries `marker` (the payload byte of a hostile probe).
fn carries(frame: &[u8], marker: &[u8]) -> bool {
    frame.windows(marker.len()).any(|w| w == marker)
}

#[test]
fn hostile_pods_get_nothing_delivered_in_another_identity_on_any_path() {
    let lab = Lab::new();
    let (a, b, c) = (&lab.a, &lab.b, &lab.c);
    let udp_m = |marker: &[u8]| packet::udp(4000, 9, marker);
    // Each hostile frame carries its own marker in its UDP payload.
    let mut hostile: Vec<(&str, Vec<u8>)> = Vec::new();
    let v4_from = |name: &'static str, src: Ipv4Addr| {
        let marker = format!("HOSTILE:{name}");
        (name, v4(a, src, b.v4, 64, 17, &udp_m(marker.as_bytes())))
    };
    hostile.push(v4_from("another pod's IPv4", c.v4));
    hostile.push(v4_from("the node's IPv4", NODE4));
    hostile.push(v4_from(
        "the link-local gateway",
        Ipv4Addr::new(169, 254, 1, 1),
    ));
    hostile.push(v4_from(
        "an unassigned pod IPv4",
        Ipv4Addr::new(10, 78, 0, 250),
    ));
    let mut full = v4_from("another pod's MAC and IPv4", c.v4).1;
    full[6..12].copy_from_slice(&c.pod_mac());
    hostile.push(("another pod's MAC and IPv4", full));
    let v6_from = |name: &'static str, src: Ipv6Addr| {
        let marker = format!("HOSTILE:{name}");
        let mut f = v6(a, src, b.v6, 64, 17, &udp_m(marker.as_bytes()));
        fix_l4_v6(&mut f);
        (name, f)
    };
    hostile.push(v6_from("another pod's IPv6", c.v6));
    hostile.push(v6_from("the node's IPv6", "fd99::1".parse().unwrap()));
    hostile.push(v6_from(
        "the link-local gateway v6",
        "fe80::1".parse().unwrap(),
    ));
    // Controls: a's own addresses arrive (so an empty capture proves
    // something); with c's MAC but a's address the frame arrives as a's,
    // from the node's MAC: c's identity does not survive the hop.
    let control4 = v4(a, a.v4, b.v4, 64, 17, &udp_m(b"CONTROL:v4"));
    let mut control6 = v6(a, a.v6, b.v6, 64, 17, &udp_m(b"CONTROL:v6"));
    fix_l4_v6(&mut control6);
    let mut cmac = v4(a, a.v4, b.v4, 64, 17, &udp_m(b"CONTROL:c-mac"));
    cmac[6..12].copy_from_slice(&c.pod_mac());

    for (path, mode, redirect) in every_path() {
        lab.set_mode(mode, redirect);
        for (name, frame) in &hostile {
            let seen = send_and_capture(&lab, &[(From::A, frame.clone())]);
            let marker = format!("HOSTILE:{name}");
            let delivered: Vec<_> = seen
                .at_b
                .iter()
                .filter(|f| carries(f, marker.as_bytes()))
                .cloned()
                .collect();
            assert!(
                delivered.is_empty(),
                "{path}: a frame from a with {name} as its source reached b:\n      {}",
                hex(&delivered)
            );
        }
        let seen = send_and_capture(
            &lab,
            &[
                (From::A, control4.clone()),
                (From::A, control6.clone()),
                (From::A, cmac.clone()),
            ],
        );
        for marker in [&b"CONTROL:v4"[..], b"CONTROL:v6", b"CONTROL:c-mac"] {
            let got: Vec<_> = seen.at_b.iter().filter(|f| carries(f, marker)).collect();
            assert_eq!(
                got.len(),
                1,
                "{path}: control {} must arrive once",
                String::from_utf8_lossy(marker)
            );
            assert_eq!(
                got[0][6..12],
                b.host_mac(),
                "{path}: frames reach b from the node's MAC"
            );
        }
        let cmac_at_b = seen
            .at_b
            .iter()
            .find(|f| carries(f, b"CONTROL:c-mac"))
            .unwrap();
        assert_eq!(cmac_at_b[26..30], a.v4.octets(), "{path}: a's address");
    }
}

#[test]
fn hostile_pod_cannot_reach_a_kernel_only_pod_through_the_fast_path() {
    let lab = Lab::new();
    let (a, b) = (&lab.a, &lab.b);
    // b is selected by a policy (the agent makes it kernel-only); the
    // policy's kernel rule: nothing is forwarded to b.
    let rules = [
        vec!["iptables", "-I", "FORWARD", "-d"],
        vec!["ip6tables", "-I", "FORWARD", "-d"],
    ];
    let targets = [b.v4.to_string(), b.v6.to_string()];
    for (rule, addr) in rules.iter().zip(&targets) {
        let mut r = rule.clone();
        r.extend([addr.as_str(), "-j", "DROP"]);
        lab.net.node.exec(&r).unwrap();
    }
    let mut f6 = v6(a, a.v6, b.v6, 64, 17, &packet::udp(4000, 9, b"KONLY:v6"));
    fix_l4_v6(&mut f6);
    let frames = [
        v4(a, a.v4, b.v4, 64, 17, &packet::udp(4000, 9, b"KONLY:v4")),
        f6,
        v4(a, a.v4, b.v4, 64, 6, &tcp_syn(4000, 80)),
    ];
    for (path, mode, redirect) in every_path().into_iter().skip(1) {
        // a (the sender) on the fast path, b kernel-only.
        lab.set_mode_of(&["a", "c"], mode, redirect);
        lab.set_mode_of(&["b"], XdpMode::Off, redirect);
        let before = counters_of(&lab, a);
        let steps: Vec<_> = frames.iter().map(|f| (From::A, f.clone())).collect();
        let seen = send_and_capture(&lab, &steps);
        let ours: Vec<_> = seen
            .at_b
            .iter()
            .filter(|f| is_v4_from(f, a.v4) || carries(f, b"KONLY"))
            .cloned()
            .collect();
        assert!(
            ours.is_empty(),
            "{path}: a reached kernel-only b past its FORWARD rule:\n      {}",
            hex(&ours)
        );
        let after = counters_of(&lab, a);
        assert_eq!(
            after.forwarded(),
            before.forwarded(),
            "{path}: a redirected a frame to b"
        );
        assert!(
            after.passed() >= before.passed() + 3,
            "{path}: a's frames to b go to the kernel"
        );
    }
    // Without the rule, b answers to kernel routing again (control).
    for (rule, addr) in rules.iter().zip(&targets) {
        let mut r = rule.clone();
        r[1] = "-D";
        r.extend([addr.as_str(), "-j", "DROP"]);
        lab.net.node.exec(&r).unwrap();
    }
    let seen = send_and_capture(&lab, &[(From::A, frames[0].clone())]);
    assert_eq!(
        seen.at_b.iter().filter(|f| carries(f, b"KONLY:v4")).count(),
        1,
        "control: the frame reaches b once the rule is gone"
    );
}

/// Whether `frame` is IPv4 from `src`.
fn is_v4_from(frame: &[u8], src: Ipv4Addr) -> bool {
    frame.len() >= 34 && frame[12..14] == ETH_P_IP.to_be_bytes() && frame[26..30] == src.octets()
}

/// The datapath counters of pod `p`'s host veth.
fn counters_of(lab: &Lab, p: &Pod) -> xdpcni_ebpf::Counters {
    let maps = Maps::open_pinned(lab.pins.path()).unwrap();
    maps.counters(p.rec.host_ifindex).unwrap()
}

/// The frame a CI run saw at a during "v6 source another pod's address":
/// the node's address unreachable, seconds late, about the "v6 fragment
/// header" probe's packet (a to b, 4103 -> 5000). It belongs to that probe,
/// not to one that sent nothing from a; an error quoting the probe's own
/// packet, or the error a probe forwards itself, stays.
#[test]
fn an_icmp_error_about_another_probes_packet_is_not_this_probes() {
    let seen = hex_bytes(
        "0687042298161e3d73de016a86dd600ed32f00503a40fd990000000000000000000000000001\
         fd78000000000000000000000000000203016058000000006000000000202c40fd78000000000000\
         0000000000000002fd780000000000000000000000000003110000010000123410071388001800005a\
         5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a",
    );
    let (a, b, c): (Ipv6Addr, Ipv6Addr, Ipv6Addr) = (
        "fd78::2".parse().unwrap(),
        "fd78::3".parse().unwrap(),
        "fd78::4".parse().unwrap(),
    );
    let frame = |ip: Vec<u8>| eth([2; 6], [4; 6], ETH_P_IPV6, &ip);
    let other = frame(packet::ipv6(c, b, 64, 17, &udp(4107, 5000, 16)));
    assert!(is_error_about_another(&seen, &[&other]));
    let mut frag = vec![17, 0, 0, 1, 0, 0, 0x12, 0x34];
    frag.extend_from_slice(&udp(4103, 5000, 16));
    let own = frame(packet::ipv6(a, b, 64, 44, &frag));
    assert!(!is_error_about_another(&seen, &[&other, &own]));
    // A probe that sends an error forwards it: about its own quote.
    let mut err6 = vec![1u8, 4, 0, 0, 0, 0, 0, 0];
    err6.extend_from_slice(&packet::ipv6(b, a, 64, 17, &udp(5000, 4100, 8))[..48]);
    let sent = frame(packet::ipv6(a, b, 64, 58, &err6));
    let forwarded = frame(packet::ipv6(a, b, 63, 58, &err6));
    assert!(!is_error_about_another(&forwarded, &[&sent]));
    assert!(is_error_about_another(&forwarded, &[&other]));
}

fn hex_bytes(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}
