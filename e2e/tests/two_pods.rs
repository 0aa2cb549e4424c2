//! Two pods on one node (network namespaces), the datapath attached to their
//! host veths in native and in generic mode, redirecting via devmap and via
//! cpumap, and on the tc hook (bpf_redirect_peer). IP forwarding is off in
//! the node namespace, so every packet that arrives crossed it through the
//! datapath; the counters say which way.
//! Needs root and bpffs at /sys/fs/bpf.

#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic

use std::net::IpAddr;
use xdpcni_ebpf::testing::RawDatapath;

use anyhow::{ensure, Result};
use xdpcni_e2e::{
    in_netns,
    topo::{Pod, WiredNode},
    traffic::{ping, tcp_transfer, udp_echo},
    PinDir,
};
use xdpcni_ebpf::{
    abi::{RedirectPolicy, Verdict},
    AttachMode, Datapath,
};

const TCP_BYTES: usize = 4 << 20;

fn assert_pod_offloads(pod: &Pod, mode: AttachMode) -> Result<()> {
    let gro = pod.ns.offload("eth0", "generic-receive-offload")?;
    ensure!(
        gro == "on",
        "GRO must be on in the pod to receive redirected frames, is {gro}"
    );
    let csum = pod.ns.offload("eth0", "tx-checksumming")?;
    let tso = pod.ns.offload("eth0", "tcp-segmentation-offload")?;
    match mode {
        AttachMode::Native => ensure!(csum == "off", "native needs tx checksum off, is {csum}"),
        AttachMode::Generic | AttachMode::Tc => {
            ensure!(tso == "on", "{mode} keeps TSO, is {tso}");
            ensure!(csum == "on", "{mode} keeps checksum offload, is {csum}");
        }
    }
    Ok(())
}

fn traffic_both_ways(a: &Pod, b: &Pod) -> Result<Vec<f64>> {
    let mut mbps = Vec::new();
    for (x, y) in [(a, b), (b, a)] {
        for to in y.addrs() {
            ping(&x.ns, to, 3)?;
            udp_echo(&x.ns, &y.ns, to, 10, 1200)?;
            mbps.push(tcp_transfer(&x.ns, &y.ns, to, TCP_BYTES)?);
        }
    }
    Ok(mbps)
}

fn two_pods(mode: AttachMode, redirect: RedirectPolicy) {
    let node = WiredNode::new(2).expect("node");
    let pins = PinDir::new("xl").expect("pins");
    let (a, b) = (&node.pods[0], &node.pods[1]);
    assert_eq!(node.ns.sysctl_get("net.ipv4.ip_forward").unwrap(), "0");
    assert_eq!(
        node.ns.sysctl_get("net.ipv6.conf.all.forwarding").unwrap(),
        "0"
    );

    // Before the datapath: no forwarding, so no pod-to-pod connectivity.
    assert!(
        ping(&a.ns, IpAddr::V4(b.ipv4), 1).is_err(),
        "kernel must not forward here"
    );

    let ncpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let cpu_mask = (1u64 << ncpus.min(63)) - 1;
    let dp = in_netns(&node.ns, || {
        let mut dp = Datapath::open(pins.path())?;
        node.register_all(dp.raw_maps(), redirect, cpu_mask)?;
        if redirect == RedirectPolicy::Cpumap {
            for cpu in 0..ncpus {
                dp.raw_enable_cpu(cpu, 2048)?;
            }
        }
        for pod in &node.pods {
            let att = dp.switch_mode(pod.host_ifindex, mode)?;
            ensure!(att.changed && att.mode == mode);
        }
        Ok(dp)
    })
    .expect("datapath");
    for pod in &node.pods {
        pod.apply_mode_offloads(mode).unwrap();
        assert_pod_offloads(pod, mode).unwrap();
        if mode == AttachMode::Tc {
            // No XDP at all: the tcx link runs the tc program.
            assert!(node.ns.xdp_attached(&pod.host_veth).unwrap().is_none());
            let att = in_netns(&node.ns, || Ok(dp.attachment(pod.host_ifindex)?))
                .unwrap()
                .expect("attached");
            assert_eq!(att.mode, AttachMode::Tc);
            assert_eq!(att.prog_id, dp.tc_from_pod_program_id().unwrap());
            continue;
        }
        let (nl_mode, prog_id) = node
            .ns
            .xdp_attached(&pod.host_veth)
            .unwrap()
            .expect("attached");
        let want = if mode == AttachMode::Native {
            "xdp"
        } else {
            "xdpgeneric"
        };
        assert_eq!(nl_mode, want, "netlink attach mode");
        assert_eq!(prog_id, u64::from(dp.from_pod_program_id().unwrap()));
    }

    // Generic is a hybrid: the pods keep TSO and their GSO super-packets take
    // kernel routing (pass_gso), so the node forwards for them.
    let hybrid = mode == AttachMode::Generic;
    if hybrid {
        node.ns.sysctl("net.ipv4.ip_forward", "1").unwrap();
        node.ns.sysctl("net.ipv6.conf.all.forwarding", "1").unwrap();
    }
    let mbps = traffic_both_ways(a, b).expect("traffic");
    eprintln!("{mode}/{redirect:?}: TCP Mbit/s per transfer {mbps:.0?}");

    // 3 pings + 10 datagrams per family and direction, plus TCP: each side's
    // packets were redirected and the other side received them that way.
    let min = 2 * (3 + 10) + 2 * (3 + 10);
    for (x, y) in [(a, b), (b, a)] {
        let cx = dp.maps().counters(x.host_ifindex).unwrap();
        let cy = dp.maps().counters(y.host_ifindex).unwrap();
        let sent = match redirect {
            // tc hands every frame to the peer, whatever the destination's policy.
            _ if mode == AttachMode::Tc => {
                assert_eq!(cx.packets(Verdict::RedirectDevmap), 0);
                assert_eq!(cx.packets(Verdict::RedirectCpumap), 0);
                cx.packets(Verdict::RedirectPeer)
            }
            RedirectPolicy::Devmap => cx.packets(Verdict::RedirectDevmap),
            RedirectPolicy::Cpumap => {
                let queued = cx.packets(Verdict::RedirectCpumap);
                let delivered = cx.packets(Verdict::CpumapDelivered);
                assert_eq!(queued, delivered, "every frame queued to a CPU went on");
                assert_eq!(cx.packets(Verdict::RedirectDevmap), 0);
                queued
            }
        };
        assert!(
            sent >= min as u64,
            "{}: only {sent} redirected: {cx:?}",
            x.host_veth
        );
        assert!(cy.packets(Verdict::RxFastpath) >= min as u64, "{cy:?}");
        assert_eq!(cx.packets(Verdict::DropSpoofed), 0);
        assert_eq!(cx.packets(Verdict::DropCpumapLost), 0);
        // What was passed is control traffic (ND, multicast), never data,
        // and in generic mode the TCP super-packets: each side sent TCP
        // data, so each has some, while its MTU-sized frames and ACKs were
        // redirected above.
        assert_eq!(cx.packets(Verdict::PassNoEndpoint), 0, "{cx:?}");
        assert_eq!(cx.packets(Verdict::PassMtu), 0, "{cx:?}");
        if hybrid {
            assert!(cx.packets(Verdict::PassGso) > 0, "no super-packet: {cx:?}");
        } else {
            assert_eq!(cx.packets(Verdict::PassGso), 0, "{cx:?}");
        }
        if mode == AttachMode::Tc {
            // The pods keep TSO and the node does not forward: the TCP data
            // crossed as super-packets on the tc fast path. Wire frames are
            // at most 1514 bytes, so only those lift the mean above it.
            let s = cx.get(Verdict::RedirectPeer);
            assert!(
                s.bytes > s.packets * 1514,
                "no super-packet redirected whole: {s:?}"
            );
        }
    }
    if hybrid {
        node.ns.sysctl("net.ipv4.ip_forward", "0").unwrap();
        node.ns.sysctl("net.ipv6.conf.all.forwarding", "0").unwrap();
    }

    // Detached, the pods are cut off again: the kernel was never the path.
    in_netns(&node.ns, || {
        let mut dp = Datapath::open(pins.path())?;
        for pod in &node.pods {
            ensure!(dp.raw_detach(pod.host_ifindex)?);
            ensure!(dp.attachment(pod.host_ifindex)?.is_none());
        }
        Ok(())
    })
    .unwrap();
    assert!(node.ns.xdp_attached(&a.host_veth).unwrap().is_none());
    assert!(ping(&a.ns, IpAddr::V4(b.ipv4), 1).is_err());
}

#[test]
fn native_devmap() {
    two_pods(AttachMode::Native, RedirectPolicy::Devmap);
}

#[test]
fn native_cpumap() {
    two_pods(AttachMode::Native, RedirectPolicy::Cpumap);
}

#[test]
fn generic_devmap() {
    two_pods(AttachMode::Generic, RedirectPolicy::Devmap);
}

#[test]
fn generic_cpumap() {
    two_pods(AttachMode::Generic, RedirectPolicy::Cpumap);
}

#[test]
fn tc_peer_devmap() {
    two_pods(AttachMode::Tc, RedirectPolicy::Devmap);
}

/// A destination whose policy is cpumap (for XDP senders) is reached by
/// bpf_redirect_peer from a tc sender all the same.
#[test]
fn tc_peer_to_cpumap_destinations() {
    two_pods(AttachMode::Tc, RedirectPolicy::Cpumap);
}
