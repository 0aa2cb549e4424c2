//! The datapath program, one verdict at a time, through BPF_PROG_TEST_RUN with
//! hand-built frames. Each test builds its own node (namespaces, two pods) and
//! pin directory, runs inside the node namespace (where the ifindexes live),
//! and checks the action, the bytes of the frame out, and the counters.
//! Needs root and bpffs at /sys/fs/bpf.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use xdpcni_ebpf::testing::{RawDatapath, RawMaps};

use anyhow::Result;
use xdpcni_e2e::{
    in_netns,
    packet::{self, *},
    testrun::{
        tc_run, xdp_run, Run, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC, XDP_DROP, XDP_PASS,
        XDP_REDIRECT,
    },
    topo::{Pod, WiredNode},
    PinDir,
};
use xdpcni_ebpf::{
    abi::{
        EndpointInfo, RedirectPolicy, Verdict, EPCACHE_SLOTS, EP_KERNEL_ONLY, EP_NO_NAT_PORTS,
        EP_POLICY, MAX_SLOTS, POL_ISOLATED_IN,
    },
    Datapath, L4Proto, Maps, PodVerdicts, PolicyStats,
};

/// A node of two pods with the datapath loaded and both registered (devmap).
fn with_datapath(f: impl FnOnce(&WiredNode, &mut Datapath) -> Result<()> + Send) {
    let node = WiredNode::new(2).expect("building the node");
    let pins = PinDir::new("xt").expect("pin dir");
    in_netns(&node.ns, || {
        let mut dp = Datapath::open(pins.path())?;
        node.register_all(dp.raw_maps(), RedirectPolicy::Devmap, 0)?;
        f(&node, &mut dp)
    })
    .expect("test body");
}

fn v4_frame(from: &Pod, src: Ipv4Addr, dst: Ipv4Addr, ttl: u8, l4: (u8, Vec<u8>)) -> Vec<u8> {
    eth(
        from.host_mac,
        from.pod_mac,
        ETH_P_IP,
        &ipv4(src, dst, ttl, l4.0, &l4.1),
    )
}

fn v6_frame(from: &Pod, src: Ipv6Addr, dst: Ipv6Addr, hop: u8, l4: (u8, Vec<u8>)) -> Vec<u8> {
    eth(
        from.host_mac,
        from.pod_mac,
        ETH_P_IPV6,
        &ipv6(src, dst, hop, l4.0, &l4.1),
    )
}

fn run(dp: &Datapath, ingress: &Pod, frame: &[u8]) -> Run {
    xdp_run(dp.from_pod_program(), ingress.host_ifindex, frame, 1).expect("test run")
}

fn count(dp: &Datapath, pod: &Pod, v: Verdict) -> u64 {
    dp.maps()
        .counters(pod.host_ifindex)
        .expect("counters")
        .packets(v)
}

/// Asserts a pass/drop verdict: action, untouched frame, one count of `v`.
fn expect_unchanged(dp: &Datapath, ingress: &Pod, frame: &[u8], action: u32, v: Verdict) {
    let before = count(dp, ingress, v);
    let r = run(dp, ingress, frame);
    assert_eq!(r.action, action, "action for {v:?}");
    assert_eq!(r.frame, frame, "a {v:?} frame must leave untouched");
    assert_eq!(count(dp, ingress, v), before + 1, "counter {v:?}");
}

fn assert_rewritten(out: &[u8], to: &Pod) {
    assert_eq!(&out[0..6], &to.pod_mac, "destination MAC is the pod's eth0");
    assert_eq!(
        &out[6..12],
        &to.host_mac,
        "source MAC is the target host veth"
    );
}

#[test]
fn ipv4_redirect_via_devmap_rewrites_macs_and_ttl() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let frame = v4_frame(
            a,
            a.ipv4,
            b.ipv4,
            64,
            (IPPROTO_UDP, udp(4000, 53, b"hello")),
        );
        let r = run(dp, a, &frame);
        assert_eq!(r.action, XDP_REDIRECT);
        assert_rewritten(&r.frame, b);
        let ip = &r.frame[14..34];
        assert_eq!(ip[8], 63, "TTL decremented");
        assert_eq!(
            checksum(ip),
            0,
            "incrementally updated IPv4 checksum is valid"
        );
        assert_eq!(&r.frame[34..], &frame[34..], "payload untouched");
        assert_eq!(count(dp, a, Verdict::RedirectDevmap), 1);
        assert_eq!(count(dp, b, Verdict::RxFastpath), 1);

        // The checksum stays valid across the 0xffff wrap: sweep TTLs.
        for ttl in 2..=255u8 {
            let f = v4_frame(a, a.ipv4, b.ipv4, ttl, (IPPROTO_TCP, tcp(1000, 80)));
            let r = run(dp, a, &f);
            assert_eq!(r.action, XDP_REDIRECT);
            assert_eq!(r.frame[14 + 8], ttl - 1);
            assert_eq!(checksum(&r.frame[14..34]), 0, "checksum at ttl {ttl}");
        }

        // The target is B's host veth: without its devmap entry the program
        // falls back to the kernel and leaves the frame as it was.
        assert!(dp.raw_maps().raw_remove_tx_port(b.host_ifindex)?);
        expect_unchanged(dp, a, &frame, XDP_PASS, Verdict::PassNoTarget);
        Ok(())
    });
}

/// The endpoint cache (xdpcni.h): the programs read an address's record
/// from its slot, and from the hash behind it when the slot holds another
/// address; the verbs keep the two in step, and a refresh repairs a slot
/// that a writer of the previous layout (hash only) left stale.
#[test]
fn epcache_the_programs_read_the_slot_then_the_hash_and_the_verbs_keep_them_in_step() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let udp64 = (IPPROTO_UDP, udp(4000, 53, b"x"));
        for ip in [IpAddr::V4(b.ipv4), IpAddr::V6(b.ipv6)] {
            let record = dp.maps().endpoint(ip)?.expect("b's record");
            assert_eq!(dp.maps().cached(ip)?, Some((ip, record)), "{ip} cached");
        }
        let b4 = IpAddr::V4(b.ipv4);
        let frame = v4_frame(a, a.ipv4, b.ipv4, 64, udp64.clone());
        // A hash-only change (what the previous layout's writers make): the
        // programs still read the slot...
        let record = dp.maps().endpoint(b4)?.expect("b's record");
        let moved = EndpointInfo {
            pod_mac: [2, 0, 0, 0, 0, 0x99],
            ..record
        };
        dp.raw_maps().raw_write_hash_only(b4, &moved)?;
        let r = run(dp, a, &frame);
        assert_eq!(r.action, XDP_REDIRECT);
        assert_eq!(&r.frame[0..6], &b.pod_mac, "the slot's record was read");
        let r = tc_run(dp.tc_from_pod_program(), a.host_ifindex, &frame, 1).expect("tc run");
        assert_eq!(&r.frame[0..6], &b.pod_mac, "tc: the slot's record was read");
        // ... until the refresh every agent start makes.
        assert_eq!(dp.raw_maps().raw_refresh_cache()?, 1, "one slot repaired");
        assert_eq!(dp.maps().cached(b4)?, Some((b4, moved)));
        assert_eq!(&run(dp, a, &frame).frame[0..6], &moved.pod_mac);

        // An address of b's slot (the same low bits): b keeps the slot, c's
        // record is read from the hash.
        let c = Ipv4Addr::from(u32::from(b.ipv4) ^ EPCACHE_SLOTS);
        let c4 = IpAddr::V4(c);
        let c_rec = EndpointInfo {
            pod_mac: [2, 0, 0, 0, 0, 0x77],
            ..record
        };
        dp.raw_maps().raw_upsert_endpoint(c4, &c_rec)?;
        assert_eq!(dp.maps().cached(c4)?.map(|h| h.0), Some(b4), "b keeps it");
        let to_c = v4_frame(a, a.ipv4, c, 64, udp64.clone());
        let r = run(dp, a, &to_c);
        assert_eq!(r.action, XDP_REDIRECT);
        assert_eq!(&r.frame[0..6], &c_rec.pod_mac, "c read from the hash");
        // A verb's change reaches the slot at once: kernel-only.
        dp.flag_kernel_only(&[b4])?;
        assert!(dp
            .maps()
            .cached(b4)?
            .is_some_and(|h| h.1.flags & EP_KERNEL_ONLY != 0));
        let r = run(dp, a, &frame);
        assert_eq!(r.action, XDP_PASS, "b is kernel-only");
        // b goes: c takes the slot; b is no endpoint any more.
        assert!(dp.raw_maps().raw_remove_endpoint(b4)?);
        assert_eq!(dp.maps().cached(c4)?.map(|h| h.0), Some(c4), "c takes it");
        assert_eq!(&run(dp, a, &to_c).frame[0..6], &c_rec.pod_mac);
        let before = count(dp, a, Verdict::PassNoEndpoint);
        assert_eq!(run(dp, a, &frame).action, XDP_PASS);
        assert_eq!(count(dp, a, Verdict::PassNoEndpoint), before + 1);
        // c goes: the slot is empty.
        assert!(dp.raw_maps().raw_remove_endpoint(c4)?);
        assert_eq!(dp.maps().cached(c4)?, None);
        assert_eq!(dp.raw_maps().raw_refresh_cache()?, 0, "nothing to repair");
        Ok(())
    });
}

#[test]
fn ipv6_redirect_via_devmap_decrements_hop_limit() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        for l4 in [
            (IPPROTO_TCP, tcp(40000, 443)),
            (IPPROTO_UDP, udp(5000, 53, b"q")),
            (IPPROTO_ICMPV6, icmp(128, 7, 1)),
        ] {
            let frame = v6_frame(a, a.ipv6, b.ipv6, 64, l4);
            let r = run(dp, a, &frame);
            assert_eq!(r.action, XDP_REDIRECT);
            assert_rewritten(&r.frame, b);
            assert_eq!(r.frame[14 + 7], 63, "hop limit decremented");
            assert_eq!(
                &r.frame[14 + 8..],
                &frame[14 + 8..],
                "addresses and L4 untouched"
            );
        }
        assert_eq!(count(dp, a, Verdict::RedirectDevmap), 3);
        assert_eq!(count(dp, b, Verdict::RxFastpath), 3);
        Ok(())
    });
}

#[test]
fn icmp_echo_redirects_but_errors_go_to_kernel() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let echo = v4_frame(a, a.ipv4, b.ipv4, 64, (IPPROTO_ICMP, icmp(8, 1, 1)));
        assert_eq!(run(dp, a, &echo).action, XDP_REDIRECT);
        // Destination unreachable quotes headers the kernel may have to un-NAT.
        let unreach = v4_frame(a, a.ipv4, b.ipv4, 64, (IPPROTO_ICMP, icmp(3, 0, 0)));
        expect_unchanged(dp, a, &unreach, XDP_PASS, Verdict::PassL4);
        let v6err = v6_frame(a, a.ipv6, b.ipv6, 64, (IPPROTO_ICMPV6, icmp(1, 0, 0)));
        expect_unchanged(dp, a, &v6err, XDP_PASS, Verdict::PassL4);
        // Protocols without ports the datapath understands (SCTP here).
        let sctp = v4_frame(a, a.ipv4, b.ipv4, 64, (132, vec![0; 12]));
        expect_unchanged(dp, a, &sctp, XDP_PASS, Verdict::PassL4);
        Ok(())
    });
}

fn cpumap_endpoints(node: &WiredNode, dp: &mut Datapath, mask: u64) -> Result<()> {
    node.register_all(dp.raw_maps(), RedirectPolicy::Cpumap, mask)
}

#[test]
fn cpumap_redirect_targets_an_allowed_cpu() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        // Only CPU 1 is allowed for B, and only CPU 1 has a cpumap entry.
        cpumap_endpoints(node, dp, 1 << 1)?;
        dp.raw_enable_cpu(1, 256)?;
        assert_eq!(dp.maps().cpu_queue_size(1)?, Some(256));
        for frame in [
            v4_frame(a, a.ipv4, b.ipv4, 64, (IPPROTO_UDP, udp(1, 2, b"x"))),
            v6_frame(a, a.ipv6, b.ipv6, 9, (IPPROTO_TCP, tcp(3, 4))),
        ] {
            let r = run(dp, a, &frame);
            assert_eq!(r.action, XDP_REDIRECT);
            assert_rewritten(&r.frame, b);
        }
        assert_eq!(count(dp, a, Verdict::RedirectCpumap), 2);
        assert_eq!(count(dp, a, Verdict::RedirectDevmap), 0);

        // Without CPU 1's entry the redirect has no target: the frame goes to
        // the kernel untouched, which shows CPU 1 was the one picked.
        dp.raw_disable_cpu(1)?;
        assert_eq!(dp.maps().cpu_queue_size(1)?, None);
        let frame = v4_frame(a, a.ipv4, b.ipv4, 64, (IPPROTO_UDP, udp(1, 2, b"x")));
        expect_unchanged(dp, a, &frame, XDP_PASS, Verdict::PassNoTarget);

        // Two allowed CPUs, only CPU 0 enabled: flows hash over both, so some
        // redirect and the others find no target.
        cpumap_endpoints(node, dp, 0b11)?;
        dp.raw_enable_cpu(0, 256)?;
        let (mut redirected, mut passed) = (0, 0);
        for sport in 1000..1064u16 {
            let f = v4_frame(a, a.ipv4, b.ipv4, 64, (IPPROTO_UDP, udp(sport, 53, b"x")));
            match run(dp, a, &f).action {
                XDP_REDIRECT => redirected += 1,
                XDP_PASS => passed += 1,
                other => panic!("unexpected action {other}"),
            }
        }
        assert!(
            redirected > 8 && passed > 8,
            "flows spread: {redirected} vs {passed}"
        );
        Ok(())
    });
}

#[test]
fn ttl_or_hop_limit_one_goes_to_kernel() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let f4 = v4_frame(a, a.ipv4, b.ipv4, 1, (IPPROTO_UDP, udp(1, 2, b"x")));
        expect_unchanged(dp, a, &f4, XDP_PASS, Verdict::PassTtl);
        let f6 = v6_frame(a, a.ipv6, b.ipv6, 1, (IPPROTO_UDP, udp(1, 2, b"x")));
        expect_unchanged(dp, a, &f6, XDP_PASS, Verdict::PassTtl);
        let f0 = v4_frame(a, a.ipv4, b.ipv4, 0, (IPPROTO_UDP, udp(1, 2, b"x")));
        expect_unchanged(dp, a, &f0, XDP_PASS, Verdict::PassTtl);
        Ok(())
    });
}

#[test]
fn control_and_unknown_traffic_goes_to_kernel() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        // ARP request (broadcast) and an ARP reply (unicast to the gateway).
        let arp = eth([0xff; 6], a.pod_mac, ETH_P_ARP, &[0u8; 28]);
        expect_unchanged(dp, a, &arp, XDP_PASS, Verdict::PassMulticast);
        let arp_reply = eth(a.host_mac, a.pod_mac, ETH_P_ARP, &[0u8; 28]);
        expect_unchanged(dp, a, &arp_reply, XDP_PASS, Verdict::PassNotIp);
        // Unknown ethertype.
        let other = eth(a.host_mac, a.pod_mac, 0x88b5, &[0u8; 46]);
        expect_unchanged(dp, a, &other, XDP_PASS, Verdict::PassNotIp);
        // IPv4 multicast address behind a unicast MAC, and the limited broadcast.
        let mc = v4_frame(
            a,
            a.ipv4,
            Ipv4Addr::new(224, 0, 0, 251),
            64,
            (IPPROTO_UDP, udp(5353, 5353, b"")),
        );
        expect_unchanged(dp, a, &mc, XDP_PASS, Verdict::PassMulticast);
        let bc = v4_frame(
            a,
            a.ipv4,
            Ipv4Addr::BROADCAST,
            64,
            (IPPROTO_UDP, udp(68, 67, b"")),
        );
        expect_unchanged(dp, a, &bc, XDP_PASS, Verdict::PassMulticast);
        // IPv6 multicast MAC, multicast address, link-local destination.
        let mc6 = eth(
            [0x33, 0x33, 0, 0, 0, 1],
            a.pod_mac,
            ETH_P_IPV6,
            &ipv6(
                a.ipv6,
                "ff02::1".parse()?,
                255,
                IPPROTO_ICMPV6,
                &icmp(128, 1, 1),
            ),
        );
        expect_unchanged(dp, a, &mc6, XDP_PASS, Verdict::PassMulticast);
        let ll = v6_frame(
            a,
            "fe80::2".parse()?,
            "fe80::1".parse()?,
            64,
            (IPPROTO_UDP, udp(1, 2, b"")),
        );
        expect_unchanged(dp, a, &ll, XDP_PASS, Verdict::PassMulticast);
        // Neighbour solicitation to a unicast address (NUD probe): ND, even
        // from a link-local source that source validation would refuse.
        for (src, ty) in [(a.ipv6, 135u8), ("fe80::2".parse()?, 136), (a.ipv6, 133)] {
            let ns = v6_frame(a, src, b.ipv6, 255, (IPPROTO_ICMPV6, icmp(ty, 0, 0)));
            expect_unchanged(dp, a, &ns, XDP_PASS, Verdict::PassNd);
        }
        // A destination that is no pod of this node.
        let away = v4_frame(
            a,
            a.ipv4,
            Ipv4Addr::new(8, 8, 8, 8),
            64,
            (IPPROTO_UDP, udp(1, 53, b"")),
        );
        expect_unchanged(dp, a, &away, XDP_PASS, Verdict::PassNoEndpoint);
        let away6 = v6_frame(
            a,
            a.ipv6,
            "2001:db8::1".parse()?,
            64,
            (IPPROTO_TCP, tcp(1, 443)),
        );
        expect_unchanged(dp, a, &away6, XDP_PASS, Verdict::PassNoEndpoint);
        Ok(())
    });
}

#[test]
fn spoofed_sources_are_dropped() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        // B's address sent from A's veth, and an address nobody owns.
        for src in [b.ipv4, Ipv4Addr::new(10, 9, 9, 9)] {
            let f = v4_frame(a, src, b.ipv4, 64, (IPPROTO_UDP, udp(1, 2, b"x")));
            expect_unchanged(dp, a, &f, XDP_DROP, Verdict::DropSpoofed);
        }
        let f6 = v6_frame(a, b.ipv6, b.ipv6, 64, (IPPROTO_UDP, udp(1, 2, b"x")));
        expect_unchanged(dp, a, &f6, XDP_DROP, Verdict::DropSpoofed);
        // Spoofing toward the outside world is dropped too.
        let out = v4_frame(
            a,
            b.ipv4,
            Ipv4Addr::new(1, 1, 1, 1),
            64,
            (IPPROTO_TCP, tcp(1, 80)),
        );
        expect_unchanged(dp, a, &out, XDP_DROP, Verdict::DropSpoofed);
        assert_eq!(count(dp, a, Verdict::DropSpoofed), 4);
        Ok(())
    });
}

#[test]
fn oversize_frames_and_gso_super_packets_go_to_kernel_apart() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let mut info = b.endpoint(RedirectPolicy::Devmap, 0);
        info.mtu = 1000;
        for addr in b.addrs() {
            dp.raw_maps().raw_upsert_endpoint(addr, &info)?;
        }
        let big = v4_frame(
            a,
            a.ipv4,
            b.ipv4,
            64,
            (IPPROTO_UDP, udp(1, 2, &[7u8; 1200])),
        );
        expect_unchanged(dp, a, &big, XDP_PASS, Verdict::PassMtu);
        let big6 = v6_frame(
            a,
            a.ipv6,
            b.ipv6,
            64,
            (IPPROTO_UDP, udp(1, 2, &[7u8; 1000])),
        );
        expect_unchanged(dp, a, &big6, XDP_PASS, Verdict::PassMtu);
        // Exactly the MTU still fits.
        let fits = v4_frame(
            a,
            a.ipv4,
            b.ipv4,
            64,
            (IPPROTO_UDP, udp(1, 2, &[7u8; 1000 - 28])),
        );
        assert_eq!(run(dp, a, &fits).action, XDP_REDIRECT);
        // Longer than the sender's own MTU (1500): no wire frame but a GSO
        // super-packet (generic mode keeps the pod's TSO). The kernel path
        // segments it; counted apart from a genuinely oversize frame.
        let gso = v4_frame(
            a,
            a.ipv4,
            b.ipv4,
            64,
            (IPPROTO_UDP, udp(1, 2, &[7u8; 3000])),
        );
        expect_unchanged(dp, a, &gso, XDP_PASS, Verdict::PassGso);
        let gso6 = v6_frame(
            a,
            a.ipv6,
            b.ipv6,
            64,
            (IPPROTO_UDP, udp(1, 2, &[7u8; 1500])),
        );
        expect_unchanged(dp, a, &gso6, XDP_PASS, Verdict::PassGso);
        // To a destination with the sender's MTU, exactly 1500 is a frame.
        for addr in b.addrs() {
            dp.raw_maps()
                .raw_upsert_endpoint(addr, &b.endpoint(RedirectPolicy::Devmap, 0))?;
        }
        let full = v4_frame(
            a,
            a.ipv4,
            b.ipv4,
            64,
            (IPPROTO_UDP, udp(1, 2, &[7u8; 1500 - 28])),
        );
        assert_eq!(run(dp, a, &full).action, XDP_REDIRECT);
        Ok(())
    });
}

#[test]
fn kernel_only_endpoints_go_to_kernel_both_ways() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let mut info = b.endpoint(RedirectPolicy::Devmap, 0);
        info.flags = EP_KERNEL_ONLY;
        for addr in b.addrs() {
            dp.raw_maps().raw_upsert_endpoint(addr, &info)?;
        }
        // To B, and from B.
        let to_b = v4_frame(a, a.ipv4, b.ipv4, 64, (IPPROTO_TCP, tcp(1, 2)));
        expect_unchanged(dp, a, &to_b, XDP_PASS, Verdict::PassKernelOnly);
        let from_b = v6_frame(b, b.ipv6, a.ipv6, 64, (IPPROTO_TCP, tcp(2, 1)));
        expect_unchanged(dp, b, &from_b, XDP_PASS, Verdict::PassKernelOnly);
        // Cleared again: fast path.
        for addr in b.addrs() {
            dp.raw_maps()
                .raw_upsert_endpoint(addr, &b.endpoint(RedirectPolicy::Devmap, 0))?;
        }
        assert_eq!(run(dp, a, &to_b).action, XDP_REDIRECT);
        Ok(())
    });
}

/// A conntrack entry in namespace `ns`, as the kernel path would have made
/// it: `proto` from `src`:`sport` to `dst`:`dport`, its destination NAT'd
/// to `dnat` when given (`conntrack -I`).
fn ct_entry(
    ns: &str,
    proto: &str,
    (src, sport): (&str, u16),
    (dst, dport): (&str, u16),
    dnat: Option<&str>,
) -> Result<()> {
    let (sport, dport) = (sport.to_string(), dport.to_string());
    let mut args = vec!["-I", "-p", proto, "-s", src, "-d", dst, "--sport", &sport];
    args.extend(["--dport", &dport, "-t", "300"]);
    if let Some(to) = dnat {
        args.extend(["--dst-nat", to]);
    }
    if proto == "tcp" {
        args.extend(["--state", "ESTABLISHED"]);
    }
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns, "conntrack"])
        .args(&args)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "conntrack {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[test]
fn flows_conntrack_nated_go_to_kernel_and_others_on_nated_ports_stay_fast() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let ns = node.ns.name();
        let no_nat = |dp: &Datapath, ip: IpAddr| -> bool {
            dp.maps().endpoint(ip).unwrap().unwrap().flags & EP_NO_NAT_PORTS != 0
        };
        // Without NAT'd ports, every endpoint skips the nat_ports lookups.
        for ip in a.addrs().into_iter().chain(b.addrs()) {
            assert!(no_nat(dp, ip), "{ip} registered without NAT'd ports");
        }
        // B:8080/tcp and B:53/udp are Service backends: conntrack is asked
        // about their flows.
        dp.raw_maps()
            .raw_add_nat_port(IpAddr::V4(b.ipv4), L4Proto::Tcp, 8080)?;
        dp.raw_maps()
            .raw_add_nat_port(IpAddr::V6(b.ipv6), L4Proto::Udp, 53)?;
        assert!(!no_nat(dp, IpAddr::V4(b.ipv4)) && !no_nat(dp, IpAddr::V6(b.ipv6)));
        assert!(no_nat(dp, IpAddr::V4(a.ipv4)), "A has no NAT'd port");
        // Re-registered while it has NAT'd ports: the flag stays off, whatever
        // the caller passed.
        let mut info = b.endpoint(RedirectPolicy::Devmap, 0);
        info.flags = EP_NO_NAT_PORTS;
        dp.raw_maps()
            .raw_upsert_endpoint(IpAddr::V4(b.ipv4), &info)?;
        assert!(!no_nat(dp, IpAddr::V4(b.ipv4)));

        // kube-proxy's DNAT as conntrack records it: A:40000 -> a cluster IP
        // translated to B:8080 (and over IPv6/UDP to B:53). B's replies, and
        // anything else of those flows, go to the kernel on both hooks.
        let (a4, b4) = (a.ipv4.to_string(), b.ipv4.to_string());
        let (a6, b6) = (a.ipv6.to_string(), b.ipv6.to_string());
        let dnat4 = format!("{b4}:8080");
        ct_entry(ns, "tcp", (&a4, 40000), ("10.96.0.10", 80), Some(&dnat4))?;
        let dnat6 = format!("[{b6}]:53");
        ct_entry(ns, "udp", (&a6, 40000), ("fd96::10", 53), Some(&dnat6))?;
        let reply = v4_frame(b, b.ipv4, a.ipv4, 64, (IPPROTO_TCP, tcp(8080, 40000)));
        expect_unchanged(dp, b, &reply, XDP_PASS, Verdict::PassNat);
        let reply6 = v6_frame(b, b.ipv6, a.ipv6, 64, (IPPROTO_UDP, udp(53, 40000, b"a")));
        expect_unchanged(dp, b, &reply6, XDP_PASS, Verdict::PassNat);
        let before = count(dp, b, Verdict::PassNat);
        for f in [&reply, &reply6] {
            let r = tc_run(dp.tc_from_pod_program(), b.host_ifindex, f, 1)?;
            assert_eq!(r.action, TC_ACT_UNSPEC, "tc: a NAT'd flow to the kernel");
            assert_eq!(&r.frame, f);
        }
        assert_eq!(count(dp, b, Verdict::PassNat), before + 2);

        // A new flow from the same client port straight to the backend (a
        // translated connect that drew port 40000 again): kube-proxy's flow
        // holds its replies' tuple, so its start goes to the kernel, which
        // NATs it to a port of its own. Past its start (an ACK) it is not
        // asked again.
        let syn = |sport: u16, dport: u16| {
            let mut t = tcp(sport, dport);
            t[13] = 0x02;
            t
        };
        let start = v4_frame(a, a.ipv4, b.ipv4, 64, (IPPROTO_TCP, syn(40000, 8080)));
        let start6 = v6_frame(a, a.ipv6, b.ipv6, 64, (IPPROTO_UDP, udp(40000, 53, b"q")));
        for f in [&start, &start6] {
            expect_unchanged(dp, a, f, XDP_PASS, Verdict::PassNat);
            let r = tc_run(dp.tc_from_pod_program(), a.host_ifindex, f, 1)?;
            assert_eq!(r.action, TC_ACT_UNSPEC, "tc: a start whose replies clash");
        }
        let mid = v4_frame(a, a.ipv4, b.ipv4, 64, (IPPROTO_TCP, tcp(40000, 8080)));
        assert_eq!(run(dp, a, &mid).action, XDP_REDIRECT);

        // The same ports, flows conntrack has not NAT'd: a client that
        // dialed B's address (or whose connect the Service programs
        // translated), with no entry or with one the kernel made without
        // NAT: the fast path, both ways, both hooks.
        ct_entry(ns, "tcp", (&a4, 40002), (&b4, 8080), None)?;
        for (from, frame) in [
            (
                b,
                v4_frame(b, b.ipv4, a.ipv4, 64, (IPPROTO_TCP, tcp(8080, 40001))),
            ),
            (
                a,
                v4_frame(a, a.ipv4, b.ipv4, 64, (IPPROTO_TCP, tcp(40001, 8080))),
            ),
            (
                b,
                v4_frame(b, b.ipv4, a.ipv4, 64, (IPPROTO_TCP, tcp(8080, 40002))),
            ),
            (
                a,
                v4_frame(a, a.ipv4, b.ipv4, 64, (IPPROTO_TCP, tcp(40002, 8080))),
            ),
            (
                a,
                v6_frame(a, a.ipv6, b.ipv6, 64, (IPPROTO_UDP, udp(40001, 53, b"q"))),
            ),
            (
                a,
                v4_frame(a, a.ipv4, b.ipv4, 64, (IPPROTO_TCP, syn(40001, 8080))),
            ),
        ] {
            assert_eq!(run(dp, from, &frame).action, XDP_REDIRECT);
            let r = tc_run(dp.tc_from_pod_program(), from.host_ifindex, &frame, 1)?;
            assert_eq!(r.action, TC_ACT_REDIRECT, "tc: not NAT'd");
        }
        // Same address, other port or protocol: no lookup, fast path.
        let direct = v4_frame(b, b.ipv4, a.ipv4, 64, (IPPROTO_TCP, tcp(8081, 40000)));
        assert_eq!(run(dp, b, &direct).action, XDP_REDIRECT);
        let udp8080 = v4_frame(b, b.ipv4, a.ipv4, 64, (IPPROTO_UDP, udp(8080, 40000, b"")));
        assert_eq!(run(dp, b, &udp8080).action, XDP_REDIRECT);

        // Removed from nat_ports: not asked, fast path even for the NAT'd
        // flow (the agent keeps every backend port in the map).
        assert!(dp
            .raw_maps()
            .raw_remove_nat_port(IpAddr::V4(b.ipv4), L4Proto::Tcp, 8080)?);
        assert!(!dp
            .raw_maps()
            .raw_remove_nat_port(IpAddr::V4(b.ipv4), L4Proto::Tcp, 8080)?);
        assert_eq!(run(dp, b, &reply).action, XDP_REDIRECT);
        // The flag comes back with the refresh the agent runs after a batch
        // of removals: on B's IPv4 (no port left), not its IPv6 (53/udp).
        assert_eq!(dp.raw_maps().raw_refresh_nat_flags()?, 1);
        assert!(no_nat(dp, IpAddr::V4(b.ipv4)));
        assert!(!no_nat(dp, IpAddr::V6(b.ipv6)));
        expect_unchanged(dp, b, &reply6, XDP_PASS, Verdict::PassNat);
        assert_eq!(
            dp.raw_maps().raw_refresh_nat_flags()?,
            0,
            "nothing left to repair"
        );
        Ok(())
    });
}

#[test]
fn counter_slots_are_unique_under_concurrent_claims_reused_zeroed_and_shared_when_full() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let (sa, sb) = (
            dp.maps().slot(a.host_ifindex)?.unwrap(),
            dp.maps().slot(b.host_ifindex)?.unwrap(),
        );
        assert!(sa != 0 && sb != 0 && sa != sb, "own slots: {sa} {sb}");
        // Two writers (separate handles on the same pins, as parallel CNI
        // ADDs are) claim 400 slots each at once: no slot is handed out twice.
        let pin = dp.pin_dir().to_path_buf();
        let claimed: Vec<u32> = std::thread::scope(|s| {
            let hs: Vec<_> = (1..=2u32)
                .map(|t| {
                    let pin = pin.clone();
                    s.spawn(move || -> Result<Vec<u32>> {
                        let mut m = Maps::open_pinned(&pin)?;
                        (0..400)
                            .map(|i| Ok(m.raw_claim_slot(t * 1_000_000 + i)?))
                            .collect()
                    })
                })
                .collect();
            hs.into_iter()
                .flat_map(|h| h.join().unwrap().unwrap())
                .collect()
        });
        let mut all: Vec<u32> = claimed.iter().copied().chain([sa, sb]).collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 802, "every claim got a slot of its own");
        assert!(!all.contains(&0));
        // Claiming again is idempotent.
        assert_eq!(dp.raw_maps().raw_claim_slot(1_000_000)?, claimed[0]);
        // A's counts, then A's veth goes: its slot is freed and zeroed, and
        // the next veth that takes it starts from nothing.
        let f = v4_frame(a, a.ipv4, b.ipv4, 64, (IPPROTO_UDP, udp(1, 2, b"x")));
        assert_eq!(run(dp, a, &f).action, XDP_REDIRECT);
        assert_eq!(count(dp, a, Verdict::RedirectDevmap), 1);
        dp.raw_maps().raw_remove_counters(a.host_ifindex)?;
        assert_eq!(dp.maps().slot(a.host_ifindex)?, None);
        assert_eq!(
            dp.raw_maps().raw_claim_slot(3_000_000)?,
            sa,
            "lowest free slot"
        );
        assert_eq!(dp.maps().counters(3_000_000)?.iter().count(), 0);
        // Fill every slot: the next veth shares slot 0, and its packets are
        // still counted there (and still forwarded).
        let mut n = 0;
        while dp.raw_maps().raw_claim_slot(4_000_000 + n)? != 0 {
            n += 1;
            assert!(n < MAX_SLOTS, "slots never ran out");
        }
        assert_eq!(
            n as usize,
            MAX_SLOTS as usize - 1 - 802,
            "slots 1..MAX all taken"
        );
        dp.raw_maps().raw_remove_counters(a.host_ifindex)?;
        let mut info = a.endpoint(RedirectPolicy::Devmap, 0);
        info.ifindex = a.host_ifindex;
        dp.raw_maps()
            .raw_upsert_endpoint(IpAddr::V4(a.ipv4), &info)?;
        // No slot recorded: a later upsert claims one once a slot frees.
        assert_eq!(dp.maps().slot(a.host_ifindex)?, None);
        let ep = dp.maps().endpoint(IpAddr::V4(a.ipv4))?.unwrap();
        assert_eq!(ep.stats_slot, 0);
        let before = dp
            .maps()
            .shared_counters()?
            .packets(Verdict::RedirectDevmap);
        assert_eq!(run(dp, a, &f).action, XDP_REDIRECT);
        assert_eq!(
            dp.maps()
                .shared_counters()?
                .packets(Verdict::RedirectDevmap),
            before + 1
        );
        Ok(())
    });
}

#[test]
fn truncated_and_malformed_headers_pass_without_fault() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let good = ipv4(a.ipv4, b.ipv4, 64, IPPROTO_TCP, &tcp(1, 2));
        let good6 = ipv6(a.ipv6, b.ipv6, 64, IPPROTO_TCP, &tcp(1, 2));
        let mut cases: Vec<(&str, Vec<u8>)> = vec![
            ("ethernet only", eth(a.host_mac, a.pod_mac, ETH_P_IP, &[])),
            (
                "ipv4 cut at 10 bytes",
                eth(a.host_mac, a.pod_mac, ETH_P_IP, &good[..10]),
            ),
            (
                "ipv4 cut in tcp ports",
                eth(a.host_mac, a.pod_mac, ETH_P_IP, &good[..22]),
            ),
            (
                "ipv6 cut at 30 bytes",
                eth(a.host_mac, a.pod_mac, ETH_P_IPV6, &good6[..30]),
            ),
            (
                "ipv6 cut in tcp ports",
                eth(a.host_mac, a.pod_mac, ETH_P_IPV6, &good6[..42]),
            ),
        ];
        let mut bad_version = good.clone();
        bad_version[0] = 0x55;
        cases.push((
            "ipv4 version 5",
            eth(a.host_mac, a.pod_mac, ETH_P_IP, &bad_version),
        ));
        let mut long_ihl = good.clone();
        long_ihl[0] = 0x4f; // 60-byte header in a 40-byte packet
        cases.push((
            "ipv4 ihl past the end",
            eth(a.host_mac, a.pod_mac, ETH_P_IP, &long_ihl),
        ));
        let mut short_ihl = good.clone();
        short_ihl[0] = 0x44;
        cases.push((
            "ipv4 ihl < 5",
            eth(a.host_mac, a.pod_mac, ETH_P_IP, &short_ihl),
        ));
        let mut short_total = good.clone();
        short_total[2..4].copy_from_slice(&10u16.to_be_bytes());
        cases.push((
            "ipv4 total length < header",
            eth(a.host_mac, a.pod_mac, ETH_P_IP, &short_total),
        ));
        let mut bad6 = good6.clone();
        bad6[0] = 0x40;
        cases.push((
            "ipv6 version 4",
            eth(a.host_mac, a.pod_mac, ETH_P_IPV6, &bad6),
        ));
        for (what, frame) in &cases {
            // Cut inside L4: the headers parse, the length field does not
            // match the frame (what ip_rcv drops as truncated).
            let v = if what.contains("tcp ports") {
                Verdict::PassBadLength
            } else {
                Verdict::PassMalformed
            };
            let before = count(dp, a, v);
            let r = run(dp, a, frame);
            assert_eq!(r.action, XDP_PASS, "{what}");
            assert_eq!(&r.frame, frame, "{what} untouched");
            assert_eq!(count(dp, a, v), before + 1, "{what} counted as {v:?}");
        }
        // Fragments carry no ports for the NAT check: kernel.
        let mut frag = good.clone();
        frag[6..8].copy_from_slice(&0x2000u16.to_be_bytes()); // MF
        frag[10..12].copy_from_slice(&[0, 0]);
        let c = packet::checksum(&frag[..20]);
        frag[10..12].copy_from_slice(&c.to_be_bytes());
        let frag = eth(a.host_mac, a.pod_mac, ETH_P_IP, &frag);
        expect_unchanged(dp, a, &frag, XDP_PASS, Verdict::PassL4);
        // IPv6 extension header (hop-by-hop).
        let ext = v6_frame(a, a.ipv6, b.ipv6, 64, (0, vec![6, 0, 1, 4, 0, 0, 0, 0]));
        expect_unchanged(dp, a, &ext, XDP_PASS, Verdict::PassL4);
        Ok(())
    });
}

/// What the kernel checks before it would forward a packet, the fast path
/// must check too (or leave the packet to the kernel): the destination MAC,
/// IPv4 options, the header checksum, and the length field against the frame.
#[test]
fn frames_the_kernel_would_not_forward_as_is_go_to_kernel() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let l4 = || (IPPROTO_UDP, udp(1, 2, b"payload"));
        let good = v4_frame(a, a.ipv4, b.ipv4, 64, l4());
        assert_eq!(run(dp, a, &good).action, XDP_REDIRECT, "the control");
        // Unicast destination MACs other than the host veth's: all-zero, and
        // another host veth's.
        for other in [[0u8; 6], b.host_mac] {
            let mut f = good.clone();
            f[..6].copy_from_slice(&other);
            expect_unchanged(dp, a, &f, XDP_PASS, Verdict::PassOtherhost);
        }
        let mut f6 = v6_frame(a, a.ipv6, b.ipv6, 64, l4());
        f6[..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 9]);
        expect_unchanged(dp, a, &f6, XDP_PASS, Verdict::PassOtherhost);
        // IPv4 options (four NOPs): the kernel's forwarding owns them.
        let ip = ipv4(a.ipv4, b.ipv4, 64, IPPROTO_UDP, &udp(1, 2, b"payload"));
        let mut opt = vec![0x46, 0];
        opt.extend_from_slice(&u16::try_from(ip.len() + 4).unwrap().to_be_bytes());
        opt.extend_from_slice(&ip[4..10]);
        opt.extend_from_slice(&[0, 0]);
        opt.extend_from_slice(&ip[12..20]);
        opt.extend_from_slice(&[1, 1, 1, 1]);
        let c = packet::checksum(&opt);
        opt[10..12].copy_from_slice(&c.to_be_bytes());
        opt.extend_from_slice(&ip[20..]);
        let opt = eth(a.host_mac, a.pod_mac, ETH_P_IP, &opt);
        expect_unchanged(dp, a, &opt, XDP_PASS, Verdict::PassIpOptions);
        // A wrong header checksum.
        let mut bad = good.clone();
        bad[14 + 10] ^= 0x5a;
        expect_unchanged(dp, a, &bad, XDP_PASS, Verdict::PassBadChecksum);
        // Trailing bytes after the IP packet, and a length past the frame.
        let mut padded = good.clone();
        padded.extend_from_slice(&[0; 6]);
        expect_unchanged(dp, a, &padded, XDP_PASS, Verdict::PassBadLength);
        let mut padded6 = v6_frame(a, a.ipv6, b.ipv6, 64, l4());
        padded6.extend_from_slice(&[0; 6]);
        expect_unchanged(dp, a, &padded6, XDP_PASS, Verdict::PassBadLength);
        let cut = good[..good.len() - 3].to_vec();
        expect_unchanged(dp, a, &cut, XDP_PASS, Verdict::PassBadLength);
        Ok(())
    });
}

#[test]
fn counters_account_every_verdict_per_ifindex() {
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let f = v4_frame(a, a.ipv4, b.ipv4, 64, (IPPROTO_UDP, udp(1, 2, &[0; 100])));
        for _ in 0..5 {
            assert_eq!(run(dp, a, &f).action, XDP_REDIRECT);
        }
        let spoof = v4_frame(a, b.ipv4, a.ipv4, 64, (IPPROTO_UDP, udp(1, 2, b"")));
        for _ in 0..3 {
            assert_eq!(run(dp, a, &spoof).action, XDP_DROP);
        }
        let ca = dp.maps().counters(a.host_ifindex)?;
        assert_eq!(ca.packets(Verdict::RedirectDevmap), 5);
        assert_eq!(ca.get(Verdict::RedirectDevmap).bytes, 5 * f.len() as u64);
        assert_eq!(ca.packets(Verdict::DropSpoofed), 3);
        assert_eq!(ca.passed(), 0);
        let cb = dp.maps().counters(b.host_ifindex)?;
        assert_eq!(cb.packets(Verdict::RxFastpath), 5);
        assert_eq!(cb.packets(Verdict::RedirectDevmap), 0, "B sent nothing");
        dp.raw_maps().raw_remove_counters(a.host_ifindex)?;
        assert_eq!(dp.maps().counters(a.host_ifindex)?.iter().count(), 0);
        Ok(())
    });
}

/// `XDPCNI_FUZZ_SEED` / `XDPCNI_FUZZ_FRAMES`, or the fixed CI defaults.
fn fuzz_seed_and_frames() -> (u64, usize) {
    (
        xdpcni_e2e::env_or("XDPCNI_FUZZ_SEED", 0x5eed_f00d),
        xdpcni_e2e::env_or("XDPCNI_FUZZ_FRAMES", 20_000),
    )
}

/// A frame from `a` that the parser has to take seriously: a plausible
/// Ethernet/IP/L4 header stack (random family, protocol, addresses of a, b
/// and strangers, options, extension headers), then random corruption:
/// bytes flipped, the frame cut short, or bytes appended.
fn fuzz_frame(rng: &mut fastrand::Rng, a: &Pod, b: &Pod) -> Vec<u8> {
    let random =
        |rng: &mut fastrand::Rng, n: usize| -> Vec<u8> { (0..n).map(|_| rng.u8(..)).collect() };
    let upto = |rng: &mut fastrand::Rng, max: usize| -> Vec<u8> {
        let n = rng.usize(..max);
        random(rng, n)
    };
    match rng.u8(..10) {
        // Noise after a plausible Ethernet header (or none at all).
        0 => {
            let len = rng.usize(14..1600);
            let mut f = random(rng, len);
            if rng.bool() {
                f[12..14].copy_from_slice(
                    &[ETH_P_IP, ETH_P_IPV6, 0x8100, 0x0806][rng.usize(..4)].to_be_bytes(),
                );
            }
            f
        }
        _ => {
            let l4 = match rng.u8(..5) {
                0 => (IPPROTO_TCP, tcp(rng.u16(..), rng.u16(..))),
                1 => (IPPROTO_UDP, udp(rng.u16(..), rng.u16(..), &upto(rng, 64))),
                2 => (IPPROTO_ICMP, icmp(rng.u8(..), rng.u16(..), rng.u16(..))),
                3 => (58, icmp(rng.u8(..), rng.u16(..), rng.u16(..))),
                _ => (rng.u8(..), upto(rng, 64)),
            };
            let mut f = if rng.bool() {
                let src = [a.ipv4, b.ipv4, Ipv4Addr::new(10, 1, 2, 3)][rng.usize(..3)];
                let dst = [b.ipv4, a.ipv4, Ipv4Addr::new(192, 0, 2, 1)][rng.usize(..3)];
                v4_frame(a, src, dst, rng.u8(..), l4)
            } else {
                let src = [a.ipv6, b.ipv6, "2001:db8::1".parse().unwrap()][rng.usize(..3)];
                let dst = [b.ipv6, a.ipv6, "2001:db8::2".parse().unwrap()][rng.usize(..3)];
                let mut f = v6_frame(a, src, dst, rng.u8(..), l4);
                if rng.u8(..4) == 0 {
                    // A random next header (extension headers and worse).
                    f[20] = [0, 43, 44, 60, 51, 50, 135, rng.u8(..)][rng.usize(..8)];
                }
                f
            };
            for _ in 0..rng.usize(..4) {
                let i = rng.usize(..f.len());
                f[i] = rng.u8(..);
            }
            match rng.u8(..4) {
                0 => f.truncate(rng.usize(14..=f.len())),
                1 => f.extend(upto(rng, 100)),
                _ => {}
            }
            f
        }
    }
}

#[test]
fn fuzz_seeded_random_and_truncated_frames_get_a_verdict_in_range() {
    let (seed, n) = fuzz_seed_and_frames();
    eprintln!("fuzz seed {seed}, {n} random frames (XDPCNI_FUZZ_SEED / XDPCNI_FUZZ_FRAMES)");
    with_datapath(|node, dp| {
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut frames: Vec<Vec<u8>> = (0..n).map(|_| fuzz_frame(&mut rng, a, b)).collect();
        // And every truncation of well-formed frames of each kind.
        for (proto, l4) in [
            (IPPROTO_TCP, tcp(1, 2)),
            (IPPROTO_UDP, udp(1, 2, b"payload")),
            (IPPROTO_ICMP, icmp(8, 1, 1)),
        ] {
            let whole = v4_frame(a, a.ipv4, b.ipv4, 64, (proto, l4.clone()));
            let whole6 = v6_frame(a, a.ipv6, b.ipv6, 64, (proto, l4));
            for f in [whole, whole6] {
                frames.extend((14..=f.len()).map(|len| f[..len].to_vec()));
            }
        }
        // The verdicts of frames a sends (rx_fastpath counts frames a
        // receives, here from itself).
        let sent_by_a = |dp: &Datapath| -> Result<u64> {
            Ok(dp
                .maps()
                .counters(a.host_ifindex)?
                .iter()
                .filter(|(v, _)| *v != Verdict::RxFastpath)
                .map(|(_, s)| s.packets)
                .sum())
        };
        let before = sent_by_a(dp)?;
        let mut actions = [0u64; 5];
        for f in &frames {
            let r = run(dp, a, f);
            assert!(
                matches!(r.action, XDP_DROP | XDP_PASS | XDP_REDIRECT),
                "action {} for {f:02x?}",
                r.action
            );
            if r.action == XDP_PASS {
                assert_eq!(&r.frame, f, "a passed frame reaches the kernel untouched");
            }
            actions[r.action as usize] += 1;
        }
        // Every run counted exactly once, in a row of a known verdict.
        let after = sent_by_a(dp)?;
        assert_eq!(
            after - before,
            frames.len() as u64,
            "one known verdict per frame"
        );
        let shared: u64 = dp
            .maps()
            .shared_counters()?
            .iter()
            .map(|(_, s)| s.packets)
            .sum();
        assert_eq!(shared, 0, "nothing counted outside the pods' slots");
        eprintln!(
            "{} frames: {} pass, {} drop, {} redirect",
            frames.len(),
            actions[XDP_PASS as usize],
            actions[XDP_DROP as usize],
            actions[XDP_REDIRECT as usize]
        );
        assert!(actions[XDP_REDIRECT as usize] > 0 && actions[XDP_PASS as usize] > 0);
        Ok(())
    })
}

/// The kernel's coarse clock (what `bpf_ktime_get_coarse_ns` reads): it
/// moves once a tick.
fn coarse_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a timespec the call writes.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    u64::try_from(ts.tv_sec).unwrap() * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap()
}

/// The policy check's per-CPU cache (lib/policy.h, pol_cache) serves a
/// recorded flow's packets within one tick of the coarse clock; a new
/// generation must reach the flow at its next packet all the same, in the
/// same tick, on both hooks. Attempts are repeated until some ran whole
/// within one tick (the case the cache could get wrong); every attempt must
/// drop. The thread is pinned to one CPU: the cache is per CPU.
#[test]
fn policy_flow_cache_a_new_generation_reaches_a_cached_flow_within_its_tick() {
    with_datapath(|node, dp| {
        xdpcni_e2e::traffic::pin_to_cpu(0).unwrap();
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let mut info = b.endpoint(RedirectPolicy::Devmap, 0);
        info.flags |= EP_POLICY;
        for addr in b.addrs() {
            dp.raw_maps().raw_upsert_endpoint(addr, &info)?;
        }
        let verdicts = |allow: u64| PodVerdicts {
            flags: POL_ISOLATED_IN,
            any_peer: [allow, 0],
            any_port: [allow, 0],
            ..Default::default()
        };
        let to_b = v4_frame(
            a,
            a.ipv4,
            b.ipv4,
            64,
            (IPPROTO_UDP, udp(4000, 53, &[0; 18])),
        );
        let (mut attempts, mut within_a_tick) = (0, 0);
        while within_a_tick < 5 && attempts < 500 {
            attempts += 1;
            dp.sync_policy(&[(b.addrs().to_vec(), verdicts(1), 0)])?;
            let t0 = coarse_ns();
            // Checked again under the new generation (or new), then from the cache.
            for _ in 0..2 {
                assert_eq!(run(dp, a, &to_b).action, XDP_REDIRECT);
                let r = tc_run(dp.tc_from_pod_program(), a.host_ifindex, &to_b, 1)?;
                assert_eq!(r.action, TC_ACT_REDIRECT);
            }
            dp.sync_policy(&[(b.addrs().to_vec(), verdicts(0), 0)])?;
            let xdp = run(dp, a, &to_b).action;
            let tc = tc_run(dp.tc_from_pod_program(), a.host_ifindex, &to_b, 1)?.action;
            if coarse_ns() == t0 {
                within_a_tick += 1;
            }
            assert_eq!(
                (xdp, tc),
                (XDP_DROP, TC_ACT_SHOT),
                "attempt {attempts}: the flow refused by the new generation"
            );
        }
        assert!(
            within_a_tick >= 5,
            "only {within_a_tick} of {attempts} attempts ran within one tick"
        );
        let stats = PolicyStats::read_pinned(dp.pin_dir())?;
        assert!(
            stats.hit >= 3 * attempts,
            "cache hits counted as hits: {stats:?}"
        );
        assert_eq!(stats.refused, 2 * attempts, "{stats:?}");
        Ok(())
    });
}

/// The north-south frontend the uplink tests call (`cost::outside_udp_frontend`).
const NS_FE: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);

/// A node of two pods that forwards and owns [`NS_FE`]: a flow to it is
/// masqueraded to the source of the forwarding route toward its backend.
fn forwarding_node() -> WiredNode {
    let node = WiredNode::new(2).expect("building the node");
    node.ns.sysctl("net.ipv4.ip_forward", "1").unwrap();
    node.ns
        .ip(&["addr", "add", "192.0.2.1/32", "dev", "lo"])
        .unwrap();
    node
}

/// An outside client's UDP datagram to [`NS_FE`]:30080 from port `sport`,
/// as it comes in on `dev`'s host side.
fn outside_frame(dev: &Pod, ttl: u8, flags_frag: u16, sport: u16) -> Vec<u8> {
    eth(
        dev.host_mac,
        [2, 0, 0, 0, 0, 1],
        ETH_P_IP,
        &packet::ipv4_full(
            Ipv4Addr::new(203, 0, 113, 10),
            NS_FE,
            ttl,
            IPPROTO_UDP,
            flags_frag,
            &[],
            &udp(sport, 30080, &[0; 18]),
        ),
    )
}

/// Packets of verdict `v` counted on `dev`'s host veth.
fn counted_on(pins: &PinDir, dev: &Pod, v: Verdict) -> u64 {
    Maps::open_pinned(pins.path())
        .unwrap()
        .counters(dev.host_ifindex)
        .unwrap()
        .get(v)
        .packets
}

/// The north-south NAT table is made at the size asked for, before the
/// objects that use it (a table made already keeps its size), and an LRU
/// past its size evicts: 1,500 UDP flows from outside to a node port
/// (3,000 entries) through a 1,024-entry table, every one translated and
/// handed to the backend's pod, 3,000 entries made, what the table no
/// longer holds counted as evicted.
#[test]
fn north_south_nat_table_at_its_chosen_size_evicts_past_it_and_counts_it() {
    use xdpcni_ebpf::{make_nat_table, ServiceStats};
    let node = forwarding_node();
    let pins = PinDir::new("xnat").expect("pin dir");
    assert_eq!(make_nat_table(pins.path(), 1024).unwrap(), 1024);
    assert_eq!(
        make_nat_table(pins.path(), 4096).unwrap(),
        1024,
        "a table made already keeps its size"
    );
    assert!(make_nat_table(&pins.path().join("other"), 16).is_err());
    in_netns(&node.ns, || {
        let mut dp = Datapath::open(pins.path())?;
        node.register_all(dp.raw_maps(), RedirectPolicy::Devmap, 0)?;
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let svc = xdpcni_e2e::cost::outside_udp_frontend(pins.path(), NS_FE, b.ipv4)?;
        let prog = dp.tc_from_node_program().expect("the uplink program");
        let flows: u16 = 1500;
        for port in 0..flows {
            let frame = outside_frame(a, 64, 0, 20000 + port);
            let r = tc_run(prog, a.host_ifindex, &frame, 1)?;
            assert_eq!(r.action, TC_ACT_REDIRECT, "flow {port}");
        }
        let st = ServiceStats::read_pinned(pins.path())?.expect("the Service maps");
        assert_eq!(st.nat_capacity, 1024, "{st:?}");
        assert_eq!(st.nat_made, 2 * u64::from(flows), "{st:?}");
        assert!(st.nat_entries <= 1024, "{st:?}");
        assert_eq!(
            st.nat_evictions,
            2 * u64::from(flows) - u64::from(st.nat_entries),
            "{st:?}"
        );
        assert!(st.nat_evictions >= 2 * u64::from(flows) - 1024, "{st:?}");
        assert_eq!(st.nat_no_tuple, 0, "{st:?}");
        drop(svc);
        Ok(())
    })
    .expect("test body");
}

/// What the uplink's program is not sure of goes to the kernel untouched
/// (kube-proxy's rules decide it): an IPv4 fragment for a north-south
/// frontend (first and later ones: no ports to key a flow by), a TTL-1
/// datagram (the kernel answers time exceeded after kube-proxy's DNAT),
/// while the same datagram whole and with TTL 64 is translated.
#[test]
fn north_south_fragments_and_ttl_one_go_to_the_kernel_untouched() {
    let node = forwarding_node();
    let pins = PinDir::new("xnsfrag").expect("pin dir");
    in_netns(&node.ns, || {
        let mut dp = Datapath::open(pins.path())?;
        node.register_all(dp.raw_maps(), RedirectPolicy::Devmap, 0)?;
        let (a, b) = (&node.pods[0], &node.pods[1]);
        let _svc = xdpcni_e2e::cost::outside_udp_frontend(pins.path(), NS_FE, b.ipv4)?;
        let prog = dp.tc_from_node_program().expect("the uplink program");
        let frame = |ttl: u8, flags_frag: u16, sport: u16| outside_frame(a, ttl, flags_frag, sport);
        let slot = |v: Verdict| counted_on(&pins, a, v);
        for (what, f, v) in [
            ("first fragment", frame(64, 0x2000, 40001), Verdict::PassL4),
            ("later fragment", frame(64, 0x0010, 40002), Verdict::PassL4),
            ("TTL 1", frame(1, 0, 40003), Verdict::PassTtl),
        ] {
            let before = slot(v);
            let r = tc_run(prog, a.host_ifindex, &f, 1)?;
            assert_eq!(r.action, TC_ACT_UNSPEC, "{what}");
            assert_eq!(r.frame, f, "{what}: untouched");
            assert_eq!(slot(v), before + 1, "{what}: counted as {v:?}");
        }
        let r = tc_run(prog, a.host_ifindex, &frame(64, 0, 40004), 1)?;
        assert_eq!(r.action, TC_ACT_REDIRECT, "the whole datagram");
        Ok(())
    })
    .expect("test body");
}

/// A north-south flow to another node's backend is made only where the
/// route to the backend leaves by a device the uplink program runs on
/// (`svc_uplinks`, kept by attach_uplink / detach_uplink), for the
/// backend's replies come back by it: with the route's device bare the
/// flow is left to kube-proxy (`pass_nat`); with the program attached
/// there it is masqueraded to the route's source, TTL decremented and
/// sent (`ns_to_node`); detached again, a new flow and the made one's next
/// packet are left to the kernel.
#[test]
fn north_south_remote_backend_only_where_the_route_device_runs_the_program() {
    let node = forwarding_node();
    // The device toward "another node": a veth pair of the node's own.
    let (dev, peer) = (
        xdpcni_e2e::netns::unique_name("xdm"),
        xdpcni_e2e::netns::unique_name("xdp"),
    );
    for args in [
        vec!["link", "add", &dev, "type", "veth", "peer", "name", &peer],
        vec!["addr", "add", "10.79.0.1/24", "dev", &dev],
        vec!["link", "set", &dev, "up"],
        vec!["link", "set", &peer, "up"],
        vec![
            "route",
            "add",
            "10.78.1.0/24",
            "via",
            "10.79.0.2",
            "dev",
            &dev,
        ],
    ] {
        node.ns.ip(&args).unwrap();
    }
    let pins = PinDir::new("xnsrem").expect("pin dir");
    in_netns(&node.ns, || {
        let mut dp = Datapath::open(pins.path())?;
        node.register_all(dp.raw_maps(), RedirectPolicy::Devmap, 0)?;
        let a = &node.pods[0];
        let backend = Ipv4Addr::new(10, 78, 1, 10);
        let _svc = xdpcni_e2e::cost::outside_udp_frontend(pins.path(), NS_FE, backend)?;
        let via = node.ns.ifindex(&dev)?;
        let frame = |sport: u16| outside_frame(a, 64, 0, sport);
        let counted = |v: Verdict| counted_on(&pins, a, v);
        fn prog(dp: &Datapath) -> &aya::programs::SchedClassifier {
            dp.tc_from_node_program().expect("the uplink program")
        }
        // The route's device without the program: kube-proxy's.
        let before = counted(Verdict::PassNat);
        let r = tc_run(prog(&dp), a.host_ifindex, &frame(40001), 1)?;
        assert_eq!(
            (r.action, counted(Verdict::PassNat)),
            (TC_ACT_UNSPEC, before + 1)
        );
        assert_eq!(r.frame, frame(40001), "left untouched");
        // With it: masqueraded to the route's source, sent by the route.
        assert!(dp.attach_uplink(via)?);
        let before = counted(Verdict::NsToNode);
        let r = tc_run(prog(&dp), a.host_ifindex, &frame(40002), 1)?;
        assert_eq!(
            (r.action, counted(Verdict::NsToNode)),
            (TC_ACT_REDIRECT, before + 1)
        );
        let ip = &r.frame[14..34];
        assert_eq!(
            &ip[12..16],
            &[10, 79, 0, 1],
            "masqueraded to the route's source"
        );
        assert_eq!(&ip[16..20], &backend.octets(), "to the backend");
        assert_eq!(ip[8], 63, "TTL decremented");
        assert_eq!(packet::checksum(ip), 0, "IPv4 header checksum");
        assert_eq!(
            &r.frame[36..38],
            &80u16.to_be_bytes(),
            "to the backend's port"
        );
        // Detached: neither a new flow nor the made one's next packet.
        assert!(dp.detach_uplink(via)?);
        for sport in [40003, 40002] {
            let before = counted(Verdict::PassNat);
            let r = tc_run(prog(&dp), a.host_ifindex, &frame(sport), 1)?;
            assert_eq!(
                (r.action, counted(Verdict::PassNat)),
                (TC_ACT_UNSPEC, before + 1),
                "port {sport}"
            );
        }
        Ok(())
    })
    .expect("test body");
}
