//! The table's rows (workload and path names, in order) and the target
//! lines computed from one run's medians.

#[allow(clippy::wildcard_imports)]
use super::*;

pub const W_UDP64: &str = "UDP 64-byte frames";
pub const W_UDP1400: &str = "UDP 1400-byte payload";
pub const W_TCP: &str = "TCP 1 stream (iperf3)";
pub const W_UDP_P50: &str = "UDP RTT p50 (busy-poll)";
pub const W_UDP_P99: &str = "UDP RTT p99 (busy-poll)";
pub const W_TCP_P50: &str = "TCP RTT p50 (busy-poll)";
pub const W_TCP_P99: &str = "TCP RTT p99 (busy-poll)";
pub const W_FWD_XDP: &str = "Forwarding 64-byte, XDP_DROP sink";
pub const W_FWD_RAW: &str = "Forwarding 64-byte, raw-table sink";
pub const W_PINNED: &str = "Pinned sender (CPU 0), raw-table sink";
pub const W_PROG_NS: &str = "Program per packet (bpf_stats)";
/// Not a row: the per-stage table after the main one (`--only stage`).
pub const W_STAGES: &str = "The program's cost per stage";
pub const W_ADD_P50: &str = "CNI ADD p50";
pub const W_ADD_P99: &str = "CNI ADD p99";
pub const W_ATTACH_P50: &str = "ADD to fast path p50 (agent)";
pub const W_ATTACH_P99: &str = "ADD to fast path p99 (agent)";
pub const W_CEILING: &str = "UDP 64-byte XDP-drop ceiling";
pub const W_NP_APPLY_P50: &str = "NetworkPolicy created -> enforced p50";
pub const W_NP_APPLY_P99: &str = "NetworkPolicy created -> enforced p99";
pub const W_NP_REMOVE_P50: &str = "NetworkPolicy deleted -> allowed p50";
pub const W_NP_REMOVE_P99: &str = "NetworkPolicy deleted -> allowed p99";
pub const W_NP_FWD: &str = "Forwarding 64-byte, kernel path, raw-table sink";
pub const W_MIGRATE: &str = "Datapath migration from the previous release";
pub const W_XNODE_TCP: &str = "TCP 1 stream across nodes (iperf3)";
pub const W_XNODE_UDP64: &str = "Across nodes: UDP 64-byte frames";
pub const W_XNODE_RR: &str = "Across nodes: TCP RTT p50 (busy-poll)";
pub const W_XNODE_HOST: &str = "Across nodes: the nodes' own TCP stream (iperf3)";
pub const W_MIGRATE_READY: &str = "Agent start with a migration, to ready";
pub const W_SVC_TCP: &str = "Service: TCP 1 stream (iperf3)";
pub const W_SVC_UDP64: &str = "Service: UDP 64-byte frames";
pub const W_SVC_RR: &str = "Service: TCP RTT p50 (busy-poll)";
pub const W_SVC_HOST_RR: &str = "Service from the node's own socket: TCP RTT p50 (busy-poll)";
pub const W_NS_TCP: &str = "NodePort from outside: TCP 1 stream (iperf3)";
pub const W_NS_UDP64: &str = "NodePort from outside: UDP 64-byte frames";
pub const W_NS_RR: &str = "NodePort from outside: TCP RTT p50 (busy-poll)";
pub const W_NPF_TCP: &str = "NetworkPolicy: TCP 1 stream (iperf3)";
pub const W_NPF_UDP64: &str = "NetworkPolicy: UDP 64-byte frames";
pub const W_NPF_RR: &str = "NetworkPolicy: TCP RTT p50 (busy-poll)";
pub const W_NPF_SCALE: &str = "NetworkPolicy: UDP 64-byte, policies selecting the server";
pub const W_NPF_PROG: &str = "NetworkPolicy: program per packet (bpf_stats)";
pub const W_NPF_CLOSE_P50: &str = "NetworkPolicy changed -> enforced p50, 1000 in force";
pub const W_NPF_CLOSE_P99: &str = "NetworkPolicy changed -> enforced p99, 1000 in force";
pub const W_NPF_OPEN_P50: &str = "NetworkPolicy changed -> allowed p50, 1000 in force";
pub const W_NPF_OPEN_P99: &str = "NetworkPolicy changed -> allowed p99, 1000 in force";
/// The policy scale rows' paths: allow policies selecting the server, all
/// on the fast path with the namespace's deny-all.
pub const NPF_1: &str = "fast path, 1 allow policy (+ deny-all)";
pub const NPF_100: &str = "fast path, 100 allow policies (+ deny-all)";
pub const NPF_1000: &str = "fast path, 1000 allow policies (+ deny-all)";
/// The headroom rows: native devmap with no headroom asked, and the default
/// native devmap measured again beside it.
pub const HEADROOM_0: &str = "native devmap, headroom 0";
pub const HEADROOM_PAIR: &str = "native devmap, beside headroom 0";
/// The NetworkPolicy rows' paths.
pub const NP_AGENT: &str = "agent (Kubernetes mode), pods on XDP";
pub const NP_NONE: &str = "kernel path, no policy";
pub const NP_100: &str = "kernel path, 100 policies";
/// The ceiling rows: the UDP 64-byte sender into an XDP program that only
/// drops, at the host veth, in each mode: no XDP path can deliver more.
pub const CEILINGS: &[(&str, aya::programs::XdpMode)] = &[
    (
        "sender -> XDP_DROP (native)",
        aya::programs::XdpMode::Driver,
    ),
    ("sender -> XDP_DROP (generic)", aya::programs::XdpMode::Skb),
];

/// (name, unit, higher is better), in table order.
pub const WORKLOADS: &[(&str, &str, bool)] = &[
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
    (W_XNODE_UDP64, "Mpps", true),
    (W_XNODE_RR, "us", false),
    (W_XNODE_HOST, "Gbit/s", true),
    (W_SVC_TCP, "Gbit/s", true),
    (W_SVC_UDP64, "Mpps", true),
    (W_SVC_RR, "us", false),
    (W_SVC_HOST_RR, "us", false),
    (W_NS_TCP, "Gbit/s", true),
    (W_NS_UDP64, "Mpps", true),
    (W_NS_RR, "us", false),
    (W_NPF_TCP, "Gbit/s", true),
    (W_NPF_UDP64, "Mpps", true),
    (W_NPF_RR, "us", false),
    (W_NPF_SCALE, "Mpps", true),
    (W_NPF_PROG, "ns", false),
    (W_NPF_CLOSE_P50, "ms", false),
    (W_NPF_CLOSE_P99, "ms", false),
    (W_NPF_OPEN_P50, "ms", false),
    (W_NPF_OPEN_P99, "ms", false),
];

pub const XNODE_HG: &str = "xdpcni hostGateway";
pub const XNODE_HG_KERNEL: &str = "xdpcni hostGateway, fast path off (kernel path)";
pub const XNODE_UPLINK: &str = "uplink program attached";
pub const XNODE_NO_UPLINK: &str = "no uplink program";
pub const XNODE_NOOP_UPLINK: &str = "a program that does nothing (the tcx hook alone)";
pub const XNODE_VXLAN: &str = "xdpcni vxlan";
pub const XNODE_VXLAN_KERNEL: &str = "xdpcni vxlan, fast path off (kernel path)";
pub const XNODE_VXLAN_CSUM: &str = "xdpcni vxlan, tx checksum offload off";
pub const XNODE_SAME: &str = "xdpcni tc, same node";
pub const XNODE_PTP_CT: &str = "ptp, conntrack on (as on a kube-proxy node)";

/// The fast paths of the main table ("best mode" picks among them).
pub const XDP_PATHS: &[&str] = &[
    "native devmap",
    "native cpumap",
    "generic devmap",
    "generic cpumap",
    TC_PATH,
];

/// The goals of issue 9, from the medians of this run.
pub fn targets(m: &BTreeMap<(String, String), f64>) -> Vec<Target> {
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
            goal: 1.0,
            what: format!(
                "{TC_PATH} vs {PEER_PATH}, UDP 64-byte frames: the cost of the shared checks"
            ),
        },
        Target {
            name: "tc_vs_peer_fwd64_raw",
            value: vs(W_FWD_RAW, TC_PATH, PEER_PATH),
            op: Op::AtLeast,
            goal: 1.0,
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
    // The slowest mode's program, and tc's beside Cilium's minimal one.
    let slowest = XDP_PATHS
        .iter()
        .filter_map(|p| get(W_PROG_NS, p).map(|v| (v, *p)))
        .max_by(|a, b| a.0.total_cmp(&b.0));
    out.push(Target {
        name: "prog_ns_redirect",
        value: slowest.map(|s| s.0),
        op: Op::AtMost,
        goal: 150.0,
        what: format!(
            "the slowest fast path's program ({}), bpf_stats under the UDP 64-byte flood, median of the repetitions",
            slowest.map_or("none measured", |s| s.1)
        ),
    });
    out.push(Target {
        name: "prog_ns_tc_minus_peer",
        value: get(W_PROG_NS, TC_PATH)
            .zip(get(W_PROG_NS, PEER_PATH))
            .map(|(t, p)| t - p),
        op: Op::AtMost,
        goal: 15.0,
        what: format!("{TC_PATH}'s program minus {PEER_PATH}'s, ns per packet (bpf_stats)"),
    });
    // Services (issue 34): the socket's translation against the pod IP
    // and against kube-proxy's path, same node, same run.
    for (name, w, p, q, goal) in [
        (
            "svc_vs_podip_tcp",
            W_SVC_TCP,
            SVC_CLUSTERIP,
            SVC_PODIP,
            0.97,
        ),
        (
            "svc_vs_kubeproxy_udp64",
            W_SVC_UDP64,
            SVC_CLUSTERIP,
            SVC_KUBEPROXY,
            1.15,
        ),
        // Lower is better: kube-proxy's p50 over the ClusterIP's.
        (
            "svc_vs_kubeproxy_rr",
            W_SVC_RR,
            SVC_KUBEPROXY,
            SVC_CLUSTERIP,
            1.15,
        ),
        // Issue 55: the node's own socket, lower is better.
        (
            "kpr_host_clusterip_vs_kubeproxy_rr",
            W_SVC_HOST_RR,
            SVC_KUBEPROXY,
            SVC_CLUSTERIP,
            1.1,
        ),
    ] {
        out.push(Target {
            name,
            value: vs(w, p, q),
            op: Op::AtLeast,
            goal,
            what: if w == W_SVC_RR || w == W_SVC_HOST_RR {
                format!("{w}: {q} vs {p} (lower is better)")
            } else {
                format!("{w}: {p} vs {q}")
            } + &if w == W_SVC_HOST_RR {
                // The node's own packets take the node's stack both ways
                // on every path: the pod IP, untranslated, bounds it.
                vs(w, SVC_KUBEPROXY, SVC_PODIP)
                    .map(|r| {
                        format!("; bound: the node's socket to the {SVC_PODIP} (no translation can beat it) is {r:.2}x")
                    })
                    .unwrap_or_default()
            } else {
                String::new()
            },
        });
    }
    // Issue 55: north-south, the uplink's program against kube-proxy, one
    // node, one run (the NodePort of a local backend from outside).
    for (name, w, p, q, goal) in [
        (
            "kpr_nodeport_vs_kubeproxy_udp64",
            W_NS_UDP64,
            NS_TC,
            NS_KUBEPROXY,
            1.5,
        ),
        // Lower is better: kube-proxy's p50 over the program's.
        (
            "kpr_nodeport_vs_kubeproxy_rr",
            W_NS_RR,
            NS_KUBEPROXY,
            NS_TC,
            1.2,
        ),
        // The same goals for another node's backend (SNAT, the route to it).
        (
            "kpr_nodeport_remote_vs_kubeproxy_udp64",
            W_NS_UDP64,
            NS_TC_REMOTE,
            NS_KUBEPROXY_REMOTE,
            1.5,
        ),
        (
            "kpr_nodeport_remote_vs_kubeproxy_rr",
            W_NS_RR,
            NS_KUBEPROXY_REMOTE,
            NS_TC_REMOTE,
            1.2,
        ),
    ] {
        out.push(Target {
            name,
            value: vs(w, p, q),
            op: Op::AtLeast,
            goal,
            what: if w == W_NS_RR {
                format!("{w}: {q} vs {p} (lower is better)")
            } else {
                format!("{w}: {p} vs {q}")
            },
        });
    }
    // The fast path between nodes (issue 36), two nodes, same run: against
    // the kernel path under the same pods; the nodes' own stream with the
    // uplink program and without.
    for (name, w, p, q, goal) in [
        (
            "xnode_hostgw_udp64",
            W_XNODE_UDP64,
            XNODE_HG,
            XNODE_HG_KERNEL,
            1.2,
        ),
        // Lower is better: the kernel path's p50 over the fast path's.
        (
            "xnode_hostgw_rr",
            W_XNODE_RR,
            XNODE_HG_KERNEL,
            XNODE_HG,
            1.15,
        ),
        (
            "xnode_vxlan_tcp",
            W_XNODE_TCP,
            XNODE_VXLAN,
            XNODE_VXLAN_KERNEL,
            1.1,
        ),
        (
            "xnode_vxlan_udp64",
            W_XNODE_UDP64,
            XNODE_VXLAN,
            XNODE_VXLAN_KERNEL,
            1.2,
        ),
        (
            "xnode_host_tcp",
            W_XNODE_HOST,
            XNODE_UPLINK,
            XNODE_NO_UPLINK,
            0.98,
        ),
    ] {
        out.push(Target {
            name,
            value: vs(w, p, q),
            op: Op::AtLeast,
            goal,
            what: if w == W_XNODE_RR {
                format!("{w}: {q} vs {p} (lower is better)")
            } else {
                format!("{w}: {p} vs {q}")
            },
        });
    }
    // NetworkPolicy on the fast path (issue 35), same node, same run.
    for (name, q, goal) in [
        ("policy_fast_vs_kernel_udp64", NPF_KERNEL, 1.2),
        ("policy_fast_vs_nopolicy_udp64", NPF_NONE, 0.95),
    ] {
        out.push(Target {
            name,
            value: vs(W_NPF_UDP64, NPF_FAST, q),
            op: Op::AtLeast,
            goal,
            what: format!("{W_NPF_UDP64}: {NPF_FAST} vs {q}"),
        });
    }
    let worst = [NPF_FAST, NPF_KERNEL]
        .iter()
        .filter_map(|p| get(W_NPF_CLOSE_P99, p).map(|v| (v, *p)))
        .chain(
            [NPF_FAST, NPF_KERNEL]
                .iter()
                .filter_map(|p| get(W_NPF_OPEN_P99, p).map(|v| (v, *p))),
        )
        .max_by(|a, b| a.0.total_cmp(&b.0));
    out.push(Target {
        name: "policy_update_p99_1000_ms",
        value: worst.map(|w| w.0),
        op: Op::AtMost,
        goal: 100.0,
        what: format!(
            "with 1000 policies in force, a policy deleted or created -> enforced, p99, the slower of both paths and both changes ({})",
            worst.map_or("none measured", |w| w.1)
        ),
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
