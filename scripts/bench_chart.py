#!/usr/bin/env python3
"""Chart the JSON output of the bench command
(`cargo run --release -p pgfence-testing --example bench -- --json`).

usage: scripts/bench_chart.py OUT.svg RUN.json [RUN.json ...]

One panel per run (e.g. a delay proxy, TCP loopback): writes per second on a log scale, per
number of concurrent writers, one bar per variant, each labelled with its median per-round
ratio to unfenced. Plain SVG, no dependencies.
"""

import json
import math
import statistics
import sys

# The variants in the order bench_markdown.py (beside this file) lists them.
from bench_markdown import ORDER

COLORS = {
    "unfenced": "#4c72b0",
    "fenced": "#55a868",
    "fenced-wc8": "#8fd19e",
    "deferred": "#64b5cd",
    "deferred+flush": "#ccb974",
    "solo": "#dd8452",
    "pinned": "#937860",
    "naive": "#c44e52",
    "ldk-node": "#8172b2",
    "coalesced": "#8172b2",
}
PANEL_W, PANEL_H = 470, 350
PLOT = (60, 50, 390, 220)  # x, y, width, height of a panel's plot area


def title(run):
    transport = run["transport"]
    if run.get("delay_us"):
        transport = f"delay proxy, {run['delay_us']} µs each way"
    elif transport.startswith("unix"):
        transport = "Unix socket"
    elif transport.startswith("tcp"):
        transport = "TCP loopback"
    if "rtt_p50_us" in run:
        transport += f", round trip {run['rtt_p50_us'] / 1000:.2f} ms"
    return transport


def ratio(r, base):
    a = r.get("rounds_ops_per_sec_p50_us", [])
    b = base.get("rounds_ops_per_sec_p50_us", [])
    rounds = [x[0] / y[0] for x, y in zip(a, b) if y[0]]
    if rounds:
        return statistics.median(rounds)
    return r["ops_per_sec"] / base["ops_per_sec"]


def esc(s):
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def panel(run, ox):
    px, py, pw, ph = PLOT
    px += ox
    results = run["results"]
    writers = sorted({r["writers"] for r in results})
    variants = [v for v in ORDER if any(r["variant"] == v for r in results)]
    variants += sorted({r["variant"] for r in results} - set(variants))
    top = max(r["ops_per_sec"] for r in results)
    lo, hi = 1, math.ceil(math.log10(max(top, 10)) + 0.15)
    y = lambda v: py + ph - (math.log10(max(v, 10**lo)) - lo) / (hi - lo) * ph
    out = [f'<text x="{px}" y="{py - 28}" font-size="13" font-weight="bold">{esc(title(run))}</text>']
    for e in range(lo, hi + 1):
        yy = y(10**e)
        out.append(f'<line x1="{px}" x2="{px + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{px - 6}" y="{yy + 4:.1f}" font-size="10" text-anchor="end">{10**e:,}</text>')
    group = pw / len(writers)
    bar = group * 0.8 / len(variants)
    for gi, w in enumerate(writers):
        by_v = {r["variant"]: r for r in results if r["writers"] == w}
        base = by_v.get("unfenced")
        for vi, v in enumerate(variants):
            r = by_v.get(v)
            if not r:
                continue
            x = px + gi * group + group * 0.1 + vi * bar
            yy = y(r["ops_per_sec"])
            out.append(
                f'<rect x="{x:.1f}" y="{yy:.1f}" width="{bar - 1:.1f}" height="{py + ph - yy:.1f}" '
                f'fill="{COLORS.get(v, "gray")}"><title>{esc(v)}, {w} writers: '
                f'{r["ops_per_sec"]:.0f} writes/s</title></rect>'
            )
            if base and v != "unfenced":
                cx, cy = x + bar / 2, yy - 3
                out.append(
                    f'<text x="{cx:.1f}" y="{cy:.1f}" font-size="8" text-anchor="start" '
                    f'transform="rotate(-90 {cx:.1f} {cy:.1f})">{ratio(r, base):.2f}x</text>'
                )
        out.append(
            f'<text x="{px + gi * group + group / 2:.1f}" y="{py + ph + 15}" font-size="11" '
            f'text-anchor="middle">{w}</text>'
        )
    out.append(
        f'<text x="{px + pw / 2}" y="{py + ph + 32}" font-size="11" text-anchor="middle">'
        "concurrent writers</text>"
    )
    out.append(
        f'<text x="{px - 45}" y="{py + ph / 2}" font-size="11" text-anchor="middle" '
        f'transform="rotate(-90 {px - 45} {py + ph / 2})">writes per second</text>'
    )
    out.append(f'<rect x="{px}" y="{py}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    for vi, v in enumerate(variants):
        lx = px + (vi % 4) * 100
        ly = py + ph + 48 + (vi // 4) * 14
        out.append(f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{COLORS.get(v, "gray")}"/>')
        out.append(f'<text x="{lx + 14}" y="{ly}" font-size="11">{esc(v)}</text>')
    return out


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out_path, paths = sys.argv[1], sys.argv[2:]
    runs = [json.load(open(p)) for p in paths]
    width = PANEL_W * len(runs)
    body = []
    for i, run in enumerate(runs):
        body += panel(run, i * PANEL_W)
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{PANEL_H}" '
        f'viewBox="0 0 {width} {PANEL_H}" font-family="sans-serif">',
        f'<rect width="{width}" height="{PANEL_H}" fill="white"/>',
        *body,
        "</svg>",
    ]
    with open(out_path, "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
