#!/usr/bin/env python3
"""Renders the benchmark's JSON (every sample) as a PNG: one panel per
workload, one bar per path (median), whiskers at min and max."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    doc = json.load(open(src))
    rows = doc["summary"]
    workloads = []
    for r in rows:
        if r["workload"] not in workloads:
            workloads.append(r["workload"])
    cols = 2
    nrows = (len(workloads) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(14, 3.6 * nrows), squeeze=False)
    for ax, w in zip(axes.flat, workloads):
        sel = [r for r in rows if r["workload"] == w]
        labels = [r["path"] for r in sel]
        med = [r["median"] for r in sel]
        err = [[m - r["min"] for m, r in zip(med, sel)], [r["max"] - m for m, r in zip(med, sel)]]
        colors = ["#888888" if "ptp" in l else "#1f77b4" for l in labels]
        ax.barh(labels, med, xerr=err, color=colors, capsize=3)
        ax.invert_yaxis()
        ax.set_title(f"{w} ({sel[0]['unit']})", fontsize=10)
        ax.tick_params(labelsize=8)
        for i, (m, r) in enumerate(zip(med, sel)):
            ax.text(m, i, f" {m:.2f} {r['ratio']}", va="center", fontsize=7)
    for ax in list(axes.flat)[len(workloads):]:
        ax.axis("off")
    fig.suptitle(f"xdpcni vs ptp - {doc['machine']}, {doc['reps']} reps x {doc['secs']} s", fontsize=11)
    fig.tight_layout()
    fig.savefig(dst, dpi=90)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
