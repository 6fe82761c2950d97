#!/usr/bin/env python3
"""Chart the JSON output of `cargo run --release -p pgfence-testing --example bench -- --json`.

usage: scripts/bench_chart.py OUT.png RUN.json [RUN.json ...]

One row per run (e.g. TCP loopback, Unix socket, delay proxy), two panels each: median write
latency with the p99 as a thin bar on top, and throughput, per number of concurrent writers,
for every variant in the run (unfenced, fenced, solo, naive; older runs: coalesced). Needs
matplotlib.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ["unfenced", "fenced", "solo", "naive", "coalesced"]
COLORS = {"unfenced": "#4c72b0", "fenced": "#55a868", "solo": "#dd8452", "naive": "#c44e52", "coalesced": "#8172b2"}


def title(run):
    transport = run["transport"]
    if run.get("delay_us"):
        transport = f"delay proxy, {run['delay_us']} µs each way"
    elif transport.startswith("unix"):
        transport = "Unix socket"
    elif transport.startswith("tcp"):
        transport = "TCP loopback"
    if "rtt_p50_us" in run:
        transport += f" (SELECT 1 round trip p50 {run['rtt_p50_us'] / 1000:.2f} ms)"
    version = run["server_version"].split(" (")[0].split(" on ")[0]
    return f"{transport} — {version}, {run['cpus']} CPUs, {run['value_size']} B values"


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, paths = sys.argv[1], sys.argv[2:]
    runs = [json.load(open(p)) for p in paths]
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 3.6 * len(runs)), squeeze=False)
    for row, run in zip(axes, runs):
        results = run["results"]
        writers = sorted({r["writers"] for r in results})
        variants = [v for v in ORDER if any(r["variant"] == v for r in results)]
        width = 0.8 / len(variants)
        lat_ax, tput_ax = row
        for i, variant in enumerate(variants):
            by_w = {r["writers"]: r for r in results if r["variant"] == variant}
            xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(writers))]
            p50 = [by_w[w]["p50_us"] / 1000 if w in by_w else 0 for w in writers]
            p99 = [by_w[w]["p99_us"] / 1000 if w in by_w else 0 for w in writers]
            tput = [by_w[w]["ops_per_sec"] if w in by_w else 0 for w in writers]
            color = COLORS.get(variant, "gray")
            lat_ax.bar(xs, p50, width, color=color, label=variant)
            lat_ax.vlines(xs, p50, p99, color=color, linewidth=1.5)
            lat_ax.scatter(xs, p99, color=color, marker="_", s=60)
            bars = tput_ax.bar(xs, tput, width, color=color, label=variant)
            for bar, w in zip(bars, writers):
                r = by_w.get(w)
                if r and "vs_unfenced" in r:
                    tput_ax.annotate(
                        f"{r['vs_unfenced']['ops_per_sec']:.2f}x",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7,
                    )
        for ax in row:
            ax.set_xticks(range(len(writers)))
            ax.set_xticklabels([str(w) for w in writers])
            ax.set_xlabel("concurrent writers")
            ax.grid(axis="y", alpha=0.3)
        lat_ax.set_yscale("log")
        lat_ax.set_ylabel("write latency, ms (bar p50, tick p99)")
        tput_ax.set_ylabel("writes per second (x: vs unfenced)")
        lat_ax.set_title(title(run), fontsize=9, loc="left")
        lat_ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("pgfence: store write (fenced, coalescing) vs unfenced upsert vs one fenced statement per write (solo) vs naive transaction", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
