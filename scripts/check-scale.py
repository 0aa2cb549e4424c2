#!/usr/bin/env python3
"""Checks a scale report (scale.md): every figure has its row for each path it
is measured on, with a median inside its min-max; every target has its line in
the exact form `target NAME: VALUE (goal OP N) met|missed`, with the goal this
file names and a verdict that is what VALUE OP N says (a report cannot call a
missed goal met). Whether the goals are met is judged only with
`--require-met` (a full run: a --quick run is too short for that).

    check-scale.py REPORT [--require-met]"""
import operator
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


OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt}


def row_problems(line):
    """A table row's figure and path, and what is wrong with its numbers."""
    cells = [c.strip() for c in line.strip("|").split("|")]
    if not line.startswith("| ") or len(cells) != 6 or cells[0] == "figure" or cells[0].startswith("---"):
        return None, []
    key = (cells[0], cells[2])
    try:
        median = float(cells[3])
        low, high = (float(x) for x in cells[4].split("-", 1))
    except ValueError:
        return key, [f"{key}: median {cells[3]!r} / min-max {cells[4]!r} are not numbers"]
    if not (low <= median <= high) or low < 0:
        return key, [f"{key}: median {median} outside its min-max {low}-{high}"]
    return key, []


def target_problems(m, require_met):
    """What is wrong with a target line's verdict (or its goal, if missed)."""
    name, value, op, goal, verdict = m.groups()
    met = OPS[op](float(value), float(goal))
    if verdict != ("met" if met else "missed"):
        return [f"target {name}: {value} {op} {goal} is {'met' if met else 'missed'}, the line says {verdict}"]
    if require_met and not met:
        return [f"target {name}: {value}, goal {op} {goal}: missed"]
    return []


def main(path, require_met):
    text = open(path).read()
    rows = set()
    problems = []
    for line in text.splitlines():
        key, wrong = row_problems(line)
        if key:
            rows.add(key)
        problems += wrong
    problems += [f"no row for {f} / {p}" for f, paths in ROWS.items() for p in paths if (f, p) not in rows]
    seen = {}
    for line in text.splitlines():
        if line.startswith("target "):
            m = LINE.match(line)
            if not m:
                problems.append(f"malformed target line: {line}")
                continue
            seen[m.group(1)] = f"{m.group(3)} {m.group(4)}"
            problems += target_problems(m, require_met)
    for name, goal in TARGETS.items():
        if seen.get(name) != goal:
            problems.append(f"target {name}: {seen.get(name)!r}, wanted goal {goal}")
    if problems:
        print("scale report wrong or incomplete:\n  " + "\n  ".join(problems))
        sys.exit(1)
    print(f"scale report complete and consistent: {len(rows)} rows, {len(seen)} targets")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--require-met"]
    if len(args) != 1:
        sys.exit(__doc__)
    main(args[0], "--require-met" in sys.argv[1:])
