#!/usr/bin/env python3
"""Checks a scale report (scale.md) is complete: every figure has its row for
each path it is measured on, and every target has its line in the exact form
`target NAME: VALUE (goal OP N) met|missed`. The numbers are not judged here
(a --quick run is too short for that); their presence is."""
import re
import sys

FILLS = [0, 50, 110, 250]
ROWS = {}
for fill in FILLS:
    for op in ["ADD", "DEL"]:
        for stat in ["p50", "p99"]:
            ROWS[f"CNI {op} {stat} at {fill} pods"] = ["xdpcni", "ptp"]
for figure in [
    "agent idle CPU, 250 pods (Kubernetes mode)",
    "agent RSS, 250 pods",
    "pod reconcile p99, 250 pods (histogram bucket)",
    "annotation PATCH -> mode applied p50, 250 pods",
    "annotation PATCH -> mode applied p99, 250 pods",
    "1000 Nodes created -> 1000 routes",
    "Node added/removed -> route p50, 1000 nodes",
    "Node added/removed -> route p99, 1000 nodes",
    "agent idle CPU, 250 pods, 1000 nodes",
    "5000 Services created -> NAT'd ports in the map",
    "NAT'd ports in the map, 5000 Services",
    "node task p50, 250 pods, 1000 nodes, 5000 Services",
    "node task p99, 250 pods, 1000 nodes, 5000 Services",
    "agent idle CPU, 250 pods, 1000 nodes, 5000 Services",
    "agent RSS, 250 pods, 1000 nodes, 5000 Services",
    "policy created -> in force p50, 1000 policies",
    "policy created -> in force p99, 1000 policies",
    "nftables transaction, 1000 policies (mean)",
    "agent idle CPU, 250 pods (standalone mode)",
    "agent RSS, 250 pods (standalone mode)",
]:
    ROWS[figure] = ["xdpcni"]
ROWS["forwarding 64-byte to a selected pod, kernel path"] = ["no policy", "1000 policies"]
ROWS["XDP program per packet (bpf_stats)"] = ["2 endpoints", "65536 endpoints"]
TARGETS = {
    "add_p99_250_pods": "<= 1.2",
    "agent_idle_cpu_250_pods": "< 1",
    "agent_rss_250_pods_1000_nodes_5000_services": "< 64",
    "annotation_p99_250_pods": "< 100",
    "route_converge_1000_nodes": "< 1000",
    "prog_ns_64k_endpoints": "<= 1.1",
    "policy_update_1000": "< 100",
}
LINE = re.compile(r"^target ([a-z0-9_]+): ([0-9]+\.[0-9]+) \(goal (>=|<=|<) ([0-9.]+)\) (met|missed)$")


def main(path):
    text = open(path).read()
    rows = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 6 and cells[0] != "figure":
            rows.add((cells[0], cells[2]))
    problems = [f"no row for {f} / {p}" for f, paths in ROWS.items() for p in paths if (f, p) not in rows]
    seen = {}
    for line in text.splitlines():
        if line.startswith("target "):
            m = LINE.match(line)
            if not m:
                problems.append(f"malformed target line: {line}")
                continue
            seen[m.group(1)] = f"{m.group(3)} {m.group(4)}"
    for name, goal in TARGETS.items():
        if seen.get(name) != goal:
            problems.append(f"target {name}: {seen.get(name)!r}, wanted goal {goal}")
    if problems:
        print("scale report incomplete:\n  " + "\n  ".join(problems))
        sys.exit(1)
    print(f"scale report complete: {len(rows)} rows, {len(seen)} targets")


if __name__ == "__main__":
    main(sys.argv[1])
