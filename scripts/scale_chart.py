#!/usr/bin/env python3
"""Chart the JSON output of the scale command
(`cargo run --release -p pgfence-testing --example scale -- --json`).

usage: scripts/scale_chart.py OUT.svg RUN.json

Left: median latency of a fenced write, a read, a remove and a `list_paginated` page (first
and middle) against the number of rows, on a log scale. Right: the median of a fenced batch of
100 puts, the same statement unfenced, and one fenced write, at each round trip. Plain SVG,
no dependencies.
"""

import json
import math
import sys

SERIES = [
    ("write", "#55a868"),
    ("read", "#4c72b0"),
    ("remove", "#c44e52"),
    ("first page", "#8172b2"),
    ("middle page", "#dd8452"),
]
BARS = [
    ("fenced_batch_p50_ms", "fenced batch of 100", "#55a868"),
    ("unfenced_batch_p50_ms", "unfenced batch statement", "#4c72b0"),
    ("fenced_write_p50_ms", "one fenced write", "#dd8452"),
]
W, H = 980, 420
LEFT = (70, 40, 420, 320)  # x, y, width, height of the left plot area
RIGHT = (600, 40, 340, 320)


def text(x, y, s, size=12, anchor="start", rotate=None):
    transform = f' transform="rotate({rotate} {x} {y})"' if rotate else ""
    s = s.replace("&", "&amp;").replace("<", "&lt;")
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"'
            f' font-family="sans-serif"{transform}>{s}</text>')


def nice_max(v):
    if v <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(v))
    for step in (1, 2, 2.5, 5, 10):
        if step * exp >= v:
            return step * exp
    return 10 * exp


def axes(out, area, ymax, ylabel):
    x, y, w, h = area
    out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="none" stroke="#888"/>')
    for i in range(6):
        v = ymax * i / 5
        yy = y + h - h * i / 5
        out.append(f'<line x1="{x}" y1="{yy:.1f}" x2="{x + w}" y2="{yy:.1f}" stroke="#eee"/>')
        out.append(text(x - 6, yy + 4, f"{v:g}", 11, "end"))
    out.append(text(x - 48, y + h / 2, ylabel, 12, "middle", -90))


def size_panel(out, run):
    sizes = run["sizes"]
    x, y, w, h = LEFT
    ymax = nice_max(max(s[name]["p50_ms"] for s in sizes for name, _ in SERIES) * 1.1)
    axes(out, LEFT, ymax, "median latency, ms")
    lo, hi = math.log10(sizes[0]["rows"]), math.log10(sizes[-1]["rows"])
    span = max(hi - lo, 1e-9)

    def px(rows):
        return x + 20 + (w - 40) * (math.log10(rows) - lo) / span

    for s in sizes:
        out.append(text(px(s["rows"]), y + h + 18, f"{s['rows']:,}", 11, "middle"))
    out.append(text(x + w / 2, y + h + 38, "rows in the table (log scale), 1 KiB values", 12,
                    "middle"))
    for i, (name, color) in enumerate(SERIES):
        points = [(px(s["rows"]), y + h - h * s[name]["p50_ms"] / ymax) for s in sizes]
        path = " ".join(f"{a:.1f},{b:.1f}" for a, b in points)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for a, b in points:
            out.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{color}"/>')
        out.append(f'<rect x="{x + 10}" y="{y + 8 + 16 * i}" width="12" height="3" fill="{color}"/>')
        out.append(text(x + 28, y + 13 + 16 * i, name, 11))
    out.append(text(x + w / 2, y - 14, "Cost against table size (pgfence store calls)", 13,
                    "middle"))


def batch_panel(out, run):
    runs = run["batches"]
    x, y, w, h = RIGHT
    ymax = nice_max(max(r[key] for r in runs for key, _, _ in BARS) * 1.1)
    axes(out, RIGHT, ymax, "median, ms")
    group = w / len(runs)
    bar = group / (len(BARS) + 1)
    for g, r in enumerate(runs):
        for i, (key, _, color) in enumerate(BARS):
            bh = h * r[key] / ymax
            bx = x + g * group + bar / 2 + i * bar
            out.append(f'<rect x="{bx:.1f}" y="{y + h - bh:.1f}" width="{bar * 0.9:.1f}"'
                       f' height="{bh:.1f}" fill="{color}"/>')
        label = f"round trip {r['rtt_p50_ms']:.2f} ms"
        out.append(text(x + g * group + group / 2, y + h + 18, label, 11, "middle"))
        ratio = r["fenced_batch_p50_ms"] / r["unfenced_batch_p50_ms"]
        per_write = r["fenced_batch_p50_ms"] / r["fenced_write_p50_ms"]
        out.append(text(x + g * group + group / 2, y + h + 34,
                        f"{ratio:.2f}x unfenced, {per_write:.2f}x one write", 11, "middle"))
    for i, (_, name, color) in enumerate(BARS):
        out.append(f'<rect x="{x + 10}" y="{y + 6 + 16 * i}" width="10" height="10" fill="{color}"/>')
        out.append(text(x + 26, y + 15 + 16 * i, name, 11))
    out.append(text(x + w / 2, y - 14, "Batch of 100 puts vs unfenced and one write", 13,
                    "middle"))


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[3])
    with open(sys.argv[2]) as f:
        run = json.load(f)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}"'
           f' viewBox="0 0 {W} {H}">', f'<rect width="{W}" height="{H}" fill="white"/>']
    if run["sizes"]:
        size_panel(out, run)
    if run["batches"]:
        batch_panel(out, run)
    version = run["server_version"].split(" ")[0]
    out.append(text(W / 2, H - 8, f"PostgreSQL {version}, {run['samples']} samples per size,"
                    " medians", 11, "middle"))
    out.append("</svg>")
    with open(sys.argv[1], "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
