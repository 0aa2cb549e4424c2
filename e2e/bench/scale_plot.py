#!/usr/bin/env python3
"""Renders the scale benchmark's JSON as a PNG: CNI ADD and DEL latency
against the node's fill (xdpcni and ptp, p50 and p99), and the agent's idle
CPU and RSS at each size of the cluster."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    doc = json.load(open(src))
    rows = {(r["figure"], r["path"]): r["median"] for r in doc["summary"]}
    fills = doc["fills"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for ax, op in zip(axes[:2], ["ADD", "DEL"]):
        for path, color in [("xdpcni", "#1f77b4"), ("ptp", "#888888")]:
            for stat, style in [("p50", "-o"), ("p99", "--s")]:
                ys = [rows.get((f"CNI {op} {stat} at {f} pods", path)) for f in fills]
                if all(y is not None for y in ys):
                    ax.plot(fills, ys, style, color=color, label=f"{path} {stat}")
        ax.set_title(f"CNI {op} latency as the node fills")
        ax.set_xlabel("pods on the node")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    cpu = [
        ("250 pods", "agent idle CPU, 250 pods (Kubernetes mode)"),
        ("+1000 nodes", "agent idle CPU, 250 pods, 1000 nodes"),
        ("+5000 Services", "agent idle CPU, 250 pods, 1000 nodes, 5000 Services"),
        ("standalone, 250 pods", "agent idle CPU, 250 pods (standalone mode)"),
    ]
    labels = [c[0] for c in cpu if (c[1], "xdpcni") in rows]
    values = [rows[(c[1], "xdpcni")] for c in cpu if (c[1], "xdpcni") in rows]
    ax = axes[2]
    ax.barh(labels, values, color="#1f77b4")
    ax.axvline(1.0, color="#d62728", linestyle=":", label="goal < 1%")
    ax.invert_yaxis()
    ax.set_title("agent idle CPU")
    ax.set_xlabel("% of one CPU")
    ax.legend(fontsize=8)
    rss = rows.get(("agent RSS, 250 pods, 1000 nodes, 5000 Services", "xdpcni"))
    if rss is not None:
        ax.text(0.98, 0.02, f"RSS {rss:.1f} MiB (all)", transform=ax.transAxes, ha="right", fontsize=8)
    fig.suptitle("xdpcni at scale" + (" (--quick)" if doc.get("quick") else ""))
    fig.tight_layout()
    fig.savefig(dst, dpi=90)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
