#!/usr/bin/env python3
"""Checks a benchmark report (bench.md) is complete: every workload has a row
for every path it runs on, and every target has its line in the
exact form `target NAME: VALUE (goal OP N) met|missed`. The numbers are not
judged here (a --quick run is too short for that); their presence is."""
import re
import sys

XDP = ["native devmap", "native cpumap", "generic devmap", "generic cpumap"]
MAIN = ["ptp (baseline)", "xdpcni off"] + XDP
# xdpcni's tc mode and Cilium's technique: every socket and forwarding
# workload but the XDP sink, which a packet redirected to the peer never
# reaches.
TC = "xdpcni tc"
PEER = "tc redirect_peer (Cilium's same-node technique)"
FLOOR = MAIN + [TC, PEER, "direct veth (no forwarding)"]
ROWS = {
    "UDP 64-byte frames": FLOOR + ["native devmap, headroom 0"],
    "UDP 1400-byte payload": FLOOR,
    "TCP 1 stream (iperf3)": FLOOR,
    "UDP RTT p50 (busy-poll)": FLOOR,
    "UDP RTT p99 (busy-poll)": FLOOR,
    "TCP RTT p50 (busy-poll)": FLOOR,
    "TCP RTT p99 (busy-poll)": FLOOR,
    "Forwarding 64-byte, XDP_DROP sink": MAIN,
    "Forwarding 64-byte, raw-table sink": MAIN + [TC, PEER],
    "Pinned sender (CPU 0), raw-table sink": [
        "ptp (baseline)",
        "native devmap",
        "generic devmap",
        TC,
        "native cpumap, cpus 1",
        "generic cpumap, cpus 1",
    ],
    "Program per packet (bpf_stats)": XDP + [TC, PEER],
    "CNI ADD p50": ["ptp (baseline)", "xdpcni off", "native devmap"],
    "CNI ADD p99": ["ptp (baseline)", "xdpcni off", "native devmap"],
    "ADD to fast path p50 (agent)": ["native devmap"],
    "ADD to fast path p99 (agent)": ["native devmap"],
    "UDP 64-byte XDP-drop ceiling": ["sender -> XDP_DROP (native)", "sender -> XDP_DROP (generic)"],
    "NetworkPolicy created -> enforced p50": ["agent (Kubernetes mode), pods on XDP"],
    "NetworkPolicy created -> enforced p99": ["agent (Kubernetes mode), pods on XDP"],
    "NetworkPolicy deleted -> allowed p50": ["agent (Kubernetes mode), pods on XDP"],
    "NetworkPolicy deleted -> allowed p99": ["agent (Kubernetes mode), pods on XDP"],
    "Forwarding 64-byte, kernel path, raw-table sink": ["kernel path, no policy", "kernel path, 100 policies"],
    "Datapath migration from the previous release": None,
    "Agent start with a migration, to ready": None,
    "TCP 1 stream across nodes (iperf3)": [
        "ptp (baseline)",
        "ptp, conntrack on (as on a kube-proxy node)",
        "xdpcni hostGateway",
        "xdpcni hostGateway, fast path off (kernel path)",
        "xdpcni vxlan",
        "xdpcni vxlan, fast path off (kernel path)",
        "xdpcni vxlan, tx checksum offload off",
        "xdpcni tc, same node",
    ],
    "Across nodes: the nodes' own TCP stream (iperf3)": [
        "uplink program attached",
        "no uplink program",
        "a program that does nothing (the tcx hook alone)",
    ],
}
XNODE = [
    "xdpcni hostGateway",
    "xdpcni hostGateway, fast path off (kernel path)",
    "xdpcni vxlan",
    "xdpcni vxlan, fast path off (kernel path)",
]
for w in ["Across nodes: UDP 64-byte frames", "Across nodes: TCP RTT p50 (busy-poll)"]:
    ROWS[w] = XNODE
SERVICE = [
    "ClusterIP, translated at the socket",
    "pod IP, no Service",
    "kube-proxy's path (iptables DNAT)",
]
for w in ["Service: TCP 1 stream (iperf3)", "Service: UDP 64-byte frames", "Service: TCP RTT p50 (busy-poll)",
          "Service from the node's own socket: TCP RTT p50 (busy-poll)"]:
    ROWS[w] = SERVICE
for w in ["NodePort from outside: TCP 1 stream (iperf3)", "NodePort from outside: UDP 64-byte frames",
          "NodePort from outside: TCP RTT p50 (busy-poll)"]:
    ROWS[w] = ["NodePort, xdpcni at tc on the uplink", "NodePort, kube-proxy 1.20.2 (iptables)",
               "NodePort to another node's backend, xdpcni at tc on the uplink",
               "NodePort to another node's backend, kube-proxy 1.20.2"]
POLICY = ["fast path, policy in the datapath", "kernel path, the same policy", "fast path, no policy"]
for w in ["NetworkPolicy: TCP 1 stream (iperf3)", "NetworkPolicy: UDP 64-byte frames", "NetworkPolicy: TCP RTT p50 (busy-poll)"]:
    ROWS[w] = POLICY
SCALE = ["fast path, no policy"] + [f"fast path, {n} allow {'policy' if n == 1 else 'policies'} (+ deny-all)" for n in (1, 100, 1000)]
for w in ["NetworkPolicy: UDP 64-byte, policies selecting the server", "NetworkPolicy: program per packet (bpf_stats)"]:
    ROWS[w] = SCALE
for w in ["enforced p50", "enforced p99", "allowed p50", "allowed p99"]:
    ROWS[f"NetworkPolicy changed -> {w}, 1000 in force"] = POLICY[:2]
TARGETS = {
    "tc_vs_peer_udp64": ">= 1",
    "tc_vs_peer_fwd64_raw": ">= 1",
    "tc_vs_ptp_tcp": ">= 1",
    "default_vs_best_peer_udp64": ">= 1",
    "default_vs_peer_tcp": ">= 1",
    "tcp_default": ">= 0.9",
    "tcp_generic": ">= 0.85",
    "udp64_best": ">= 1.15",
    "fwd64_xdp_sink_best": ">= 1.3",
    "fwd64_raw_sink_best": ">= 1.1",
    "rr_p50_best": ">= 1.1",
    "prog_ns_redirect": "<= 150",
    "prog_ns_tc_minus_peer": "<= 15",
    "cpumap_pinned": ">= 1.1",
    "svc_vs_podip_tcp": ">= 0.97",
    "svc_vs_kubeproxy_udp64": ">= 1.15",
    "svc_vs_kubeproxy_rr": ">= 1.15",
    "kpr_host_clusterip_vs_kubeproxy_rr": ">= 1.1",
    "kpr_nodeport_vs_kubeproxy_udp64": ">= 1.5",
    "kpr_nodeport_vs_kubeproxy_rr": ">= 1.2",
    "kpr_nodeport_remote_vs_kubeproxy_udp64": ">= 1.5",
    "kpr_nodeport_remote_vs_kubeproxy_rr": ">= 1.2",
    "policy_fast_vs_kernel_udp64": ">= 1.2",
    "policy_fast_vs_nopolicy_udp64": ">= 0.95",
    "policy_update_p99_1000_ms": "<= 100",
    "xnode_hostgw_udp64": ">= 1.2",
    "xnode_hostgw_rr": ">= 1.15",
    "xnode_vxlan_tcp": ">= 1.1",
    "xnode_vxlan_udp64": ">= 1.2",
    "xnode_host_tcp": ">= 0.98",
}
LINE = re.compile(r"^target ([a-z0-9_]+): (-?[0-9]+\.[0-9]+|none) \(goal (>=|<=) ([0-9.]+)\) (met|missed)$")


def main(path):
    text = open(path).read()
    rows = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 5 and cells[0] != "workload":
            rows.add((cells[0], cells[1]))
    problems = []
    for workload, paths in ROWS.items():
        if paths is None:  # one row, whatever its path (it names a count that --quick lowers)
            if not any(w == workload for w, _ in rows):
                problems.append(f"no row for {workload}")
            continue
        for p in paths:
            if (workload, p) not in rows:
                problems.append(f"no row for {workload} / {p}")
    seen = {}
    for line in text.splitlines():
        if line.startswith("target "):
            m = LINE.match(line)
            if not m:
                problems.append(f"malformed target line: {line}")
                continue
            seen[m.group(1)] = f"{m.group(3)} {m.group(4)}"
    for name, goal in TARGETS.items():
        if name not in seen:
            problems.append(f"no target line for {name}")
        elif seen[name] != goal:
            problems.append(f"target {name} has goal {seen[name]}, not {goal}")
    # The per-stage table (BPF_PROG_TEST_RUN) of the same run: every stage
    # and the whole program, and Cilium's minimal program beside them.
    stages = [l for l in text.splitlines() if re.match(r"^\| [0-6] ", l)]
    if len(stages) != 7:
        problems.append(f"{len(stages)} stage rows in the per-stage table, wanted 7")
    if "the program (stages 1-6)" not in text or "Cilium's minimal same-node program" not in text:
        problems.append("the per-stage table's totals or Cilium's program are missing")
    if problems:
        for p in problems:
            print(f"check-bench: {p}", file=sys.stderr)
        sys.exit(1)
    print(f"bench report: ok ({len(rows)} rows, {len(seen)} target lines)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "target/bench/bench.md")
