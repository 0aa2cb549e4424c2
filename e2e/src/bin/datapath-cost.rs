//! Per-packet cost of the datapath program, measured with BPF_PROG_TEST_RUN:
//! first stage by stage (`xdpcni_e2e::cost`, the table the benchmark prints
//! too), then the NAT check's rows below and the NetworkPolicy check's on a
//! recorded flow.
//! The kernel runs the program `REPEAT` times per call on the same buffer and
//! reports the mean, which amortises its timer; frames start at TTL 255 so the
//! decrements of one call (the buffer is rewritten in place) never reach the
//! TTL-expiry path, and b's endpoint is registered with a's host veth MAC as
//! its pod MAC so the rewritten destination MAC stays the host veth's (the
//! destination-MAC check). We report the median over many calls.
//! Redirects are not executed in this mode, so this is the program's own
//! cost: parsing, map lookups, rewrite. Prices the NAT check: the nat_ports test (two hash
//! lookups per TCP/UDP packet of a pod with NAT'd ports; skipped for the others, flagged
//! `EP_NO_NAT_PORTS`), and for a flow on a NAT'd port the conntrack lookup that decides it,
//! against the build without it (the nat_ports rule alone, as before the exact check).
//!
//! `cargo run --release -p xdpcni-e2e --bin datapath-cost` (root, bpffs).

use std::net::{IpAddr, Ipv4Addr};
use xdpcni_ebpf::testing::{RawDatapath, RawMaps};

use anyhow::{Context, Result};
use xdpcni_e2e::{
    in_netns,
    packet::*,
    testrun::{xdp_run, XDP_PASS, XDP_REDIRECT},
    topo::WiredNode,
    PinDir,
};
use xdpcni_ebpf::{
    abi::{self, RedirectPolicy},
    Datapath, L4Proto, PodVerdicts,
};

const SAMPLES: usize = 200; // each call costs ~50 ms of kernel setup with repeat > 1
const REPEAT: u32 = 200;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    // Stage by stage, both hooks and families (the table docs/benchmark.md keeps).
    println!("{}", xdpcni_e2e::cost::measure(101, REPEAT)?.table());
    let node = WiredNode::new(2)?;
    let pins = PinDir::new("xc")?;
    let (a, b) = (&node.pods[0], &node.pods[1]);
    let frame = |src: Ipv4Addr, dst: Ipv4Addr, proto: u8, l4: Vec<u8>| {
        eth(
            a.host_mac,
            a.pod_mac,
            ETH_P_IP,
            &ipv4(src, dst, 255, proto, &l4),
        )
    };
    let icmp_f = frame(a.ipv4, b.ipv4, IPPROTO_ICMP, icmp(8, 1, 1));
    let udp_f = frame(a.ipv4, b.ipv4, IPPROTO_UDP, udp(4000, 53, &[0; 18]));
    let nat_f = frame(a.ipv4, b.ipv4, IPPROTO_UDP, udp(8053, 53, &[0; 18]));
    let away_f = frame(
        a.ipv4,
        Ipv4Addr::new(8, 8, 8, 8),
        IPPROTO_UDP,
        udp(4000, 53, &[0; 18]),
    );

    let rows = in_netns(&node.ns, || {
        let mut dp = Datapath::open(pins.path())?;
        node.register_all(dp.raw_maps(), RedirectPolicy::Devmap, 0)?;
        // The repeats run on the buffer the previous one rewrote, whose
        // destination MAC becomes b's pod MAC; the datapath passes frames not
        // addressed to the host veth (pass_otherhost). Registering b with a's
        // host veth MAC as its pod MAC keeps every repeat on the redirect path.
        let mut info = dp
            .maps()
            .endpoint(IpAddr::V4(b.ipv4))?
            .context("b's endpoint")?;
        info.pod_mac = a.host_mac;
        dp.raw_maps()
            .raw_upsert_endpoint(IpAddr::V4(b.ipv4), &info)?;
        let measure = |dp: &Datapath, f: &[u8], want: u32| -> Result<f64> {
            let mut v = Vec::with_capacity(SAMPLES);
            for _ in 0..SAMPLES {
                let r = xdp_run(dp.from_pod_program(), a.host_ifindex, f, REPEAT)?;
                anyhow::ensure!(r.action == want, "unexpected action {}", r.action);
                v.push(r.ns_per_run);
            }
            Ok(median(v))
        };
        let mut rows = vec![
            (
                "ICMP echo, redirect (no NAT lookup)",
                measure(&dp, &icmp_f, XDP_REDIRECT)?,
            ),
            (
                "UDP, redirect, nat_ports empty",
                measure(&dp, &udp_f, XDP_REDIRECT)?,
            ),
            ("UDP to a non-pod, pass", measure(&dp, &away_f, XDP_PASS)?),
        ];
        // The NetworkPolicy check on a recorded flow: b isolated for
        // ingress, one group allowing every peer and port. The first run
        // records the flow (pol_flows), every later one finds it.
        let mut info = b.endpoint(RedirectPolicy::Devmap, 0);
        info.pod_mac = a.host_mac; // as above
        info.flags |= abi::EP_POLICY;
        for addr in b.addrs() {
            dp.raw_maps().raw_upsert_endpoint(addr, &info)?;
        }
        let allow_all = PodVerdicts {
            flags: abi::POL_ISOLATED_IN,
            any_peer: [1, 0],
            any_port: [1, 0],
            ..Default::default()
        };
        dp.sync_policy(&[(b.addrs().to_vec(), allow_all, 0)])?;
        let policy_rows = [(
            "UDP, redirect, b isolated (allowed), its flow recorded: the policy check's hit",
            measure(&dp, &udp_f, XDP_REDIRECT)?,
        )];
        dp.sync_policy(&[])?;
        info.flags &= !abi::EP_POLICY;
        for addr in b.addrs() {
            dp.raw_maps().raw_upsert_endpoint(addr, &info)?;
        }
        // The cpumap path's first program: the same frame, b on the cpumap
        // over both CPUs (a flow hash picks one), then back on the devmap.
        for cpu in 0..2 {
            dp.raw_enable_cpu(cpu, 256)?;
        }
        let register_b = |dp: &mut Datapath, policy, mask| -> Result<()> {
            let mut info = b.endpoint(policy, mask);
            info.pod_mac = a.host_mac; // as above
            for addr in b.addrs() {
                dp.raw_maps().raw_upsert_endpoint(addr, &info)?;
            }
            Ok(())
        };
        register_b(&mut dp, RedirectPolicy::Cpumap, 0b11)?;
        rows.push((
            "UDP, redirect via the cpumap (2 CPUs allowed)",
            measure(&dp, &udp_f, XDP_REDIRECT)?,
        ));
        register_b(&mut dp, RedirectPolicy::Devmap, 0)?;
        for i in 0..50_000u32 {
            let ip = IpAddr::V4(Ipv4Addr::from(0x0a63_0000 + i));
            dp.raw_maps().raw_add_nat_port(ip, L4Proto::Tcp, 80)?;
        }
        rows.push((
            "UDP, redirect, nat_ports 50k entries",
            measure(&dp, &udp_f, XDP_REDIRECT)?,
        ));
        // The same pods without the no-NAT flag: both nat_ports lookups run.
        for pod in &node.pods {
            let mut info = pod.endpoint(RedirectPolicy::Devmap, 0);
            info.flags = 0;
            if pod.host_ifindex == b.host_ifindex {
                info.pod_mac = a.host_mac; // as above
            }
            for addr in pod.addrs() {
                dp.raw_maps().raw_add_nat_port(addr, L4Proto::Tcp, 1)?;
                dp.raw_maps().raw_upsert_endpoint(addr, &info)?;
            }
        }
        rows.push((
            "UDP, redirect, nat_ports 50k entries, pods with NAT'd ports (lookups run)",
            measure(&dp, &udp_f, XDP_REDIRECT)?,
        ));
        dp.raw_maps()
            .raw_add_nat_port(IpAddr::V4(a.ipv4), L4Proto::Udp, 8053)?;
        rows.push((
            "UDP from a NAT'd port, conntrack has no entry (asked), redirect",
            measure(&dp, &nat_f, XDP_REDIRECT)?,
        ));
        // A flow to a NAT'd port (a Service backend's, dialed directly or
        // translated at the socket): UDP may be starting at every packet,
        // so conntrack is asked for it and for its replies' tuple.
        dp.raw_maps()
            .raw_add_nat_port(IpAddr::V4(b.ipv4), L4Proto::Udp, 5353)?;
        let to_f = frame(a.ipv4, b.ipv4, IPPROTO_UDP, udp(8054, 5353, &[0; 18]));
        rows.push((
            "UDP to a NAT'd port, conntrack has no entry (asked, and for the replies' tuple), redirect",
            measure(&dp, &to_f, XDP_REDIRECT)?,
        ));
        // The same flow as conntrack records one it SNAT'd.
        let out = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                node.ns.name(),
                "conntrack",
                "-I",
                "-p",
                "udp",
            ])
            .args(["-s", &a.ipv4.to_string(), "-d", &b.ipv4.to_string()])
            .args(["--sport", "8053", "--dport", "53", "--src-nat", "10.99.0.1"])
            .args(["-t", "600"])
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "conntrack -I: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        rows.push((
            "UDP from a NAT'd port, conntrack NAT'd the flow (asked), pass",
            measure(&dp, &nat_f, XDP_PASS)?,
        ));
        // Before the exact check: the nat_ports rule alone passes the flow.
        let before = xdpcni_ebpf::testing::datapath_without_ct_kfuncs()?;
        let dp = Datapath::open_object(pins.path(), before.as_ref())?;
        rows.push((
            "UDP from a NAT'd port, the nat_ports rule alone (no conntrack lookup), pass",
            measure(&dp, &nat_f, XDP_PASS)?,
        ));
        rows.extend(policy_rows);
        Ok(rows)
    })?;

    println!(
        "| program path (BPF_PROG_TEST_RUN, median of {SAMPLES} x {REPEAT} runs) | ns/packet |"
    );
    println!("| --- | ---: |");
    for (what, ns) in &rows {
        println!("| {what} | {ns:.1} |");
    }
    println!(
        "\nNAT check cost (pods with NAT'd ports - pods without, 50k entries): {:.1} ns/packet",
        rows[5].1 - rows[4].1
    );
    println!(
        "Exact NAT check, a flow on a NAT'd port, against the nat_ports rule alone: \
         {:+.1} ns/packet when conntrack has no entry (then redirected), \
         {:+.1} ns/packet when it NAT'd the flow (then passed), \
         {:+.1} ns/packet for a UDP packet or TCP SYN to the port (two lookups, then redirected)",
        rows[6].1 - rows[9].1,
        rows[8].1 - rows[9].1,
        rows[7].1 - rows[9].1
    );
    println!(
        "NetworkPolicy check on a recorded flow (b isolated - b not): {:+.1} ns/packet",
        rows[10].1 - rows[1].1
    );
    Ok(())
}
