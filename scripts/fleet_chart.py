#!/usr/bin/env python3
"""Chart the JSON output of the fleet_scale example
(`cargo run --release -p pgfence-testing --example fleet_scale -- --json`).

usage: scripts/fleet_chart.py OUT.svg RUN.json

Four panels against the number of stores (log scale): the most server connections seen, the
threads the stores added, the resident memory they added, and the renewal p99 (the upper bound
of its histogram bucket). One line for stores on one fleet, one for stores opened alone. Plain
SVG, no dependencies.
"""

import json
import math
import sys

MODES = [("fleet", "one Fleet", "#55a868"), ("alone", "each store alone", "#c44e52")]
PANELS = [
    ("server connections", lambda r: r["connections"]),
    ("threads added", lambda r: r["threads"] - r["threads_before"]),
    ("RSS added (MiB)", lambda r: max(r["rss_mib"] - r["rss_mib_before"], 0.0)),
    ("renewal p99 (ms, bucket bound)", lambda r: r["renewal_p99_ms"]),
]
PW, PH = 200, 180  # plot area of one panel
MX, MY = 60, 40  # margins left and top of each panel
W, H = 4 * (PW + MX + 20) + 20, PH + MY + 90


def text(x, y, s, size=11, anchor="start"):
    s = s.replace("&", "&amp;").replace("<", "&lt;")
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"'
            f' font-family="sans-serif">{s}</text>')


def nice_max(v):
    if v <= 0:
        return 1.0
    p = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if m * p >= v:
            return m * p
    return 10 * p


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out, path = sys.argv[1], sys.argv[2]
    with open(path) as f:
        run = json.load(f)
    runs = run["runs"]
    counts = sorted({r["stores"] for r in runs})
    lo, hi = math.log10(min(counts)), math.log10(max(counts))
    hi = hi if hi > lo else lo + 1
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}">',
             f'<rect width="{W}" height="{H}" fill="white"/>']
    for i, (title, value) in enumerate(PANELS):
        x0, y0 = 20 + i * (PW + MX + 20) + MX, MY
        points = {m: [(r["stores"], value(r)) for r in runs
                      if r["mode"] == m and value(r) is not None] for m, _, _ in MODES}
        top = nice_max(max([v for ps in points.values() for _, v in ps] or [1]))
        parts.append(text(x0 + PW / 2, y0 - 14, title, 12, "middle"))
        parts.append(f'<rect x="{x0}" y="{y0}" width="{PW}" height="{PH}" fill="none" '
                     'stroke="#888"/>')
        for k in range(5):
            v = top * k / 4
            y = y0 + PH - PH * k / 4
            parts.append(text(x0 - 6, y + 4, f"{v:g}", 10, "end"))
            parts.append(f'<line x1="{x0}" x2="{x0 + PW}" y1="{y}" y2="{y}" stroke="#eee"/>')
        for n in counts:
            x = x0 + PW * (math.log10(n) - lo) / (hi - lo)
            parts.append(text(x, y0 + PH + 16, f"{n:,}", 10, "middle"))
        parts.append(text(x0 + PW / 2, y0 + PH + 34, "stores", 11, "middle"))
        for mode, _, color in MODES:
            ps = sorted(points[mode])
            xy = [(x0 + PW * (math.log10(n) - lo) / (hi - lo), y0 + PH - PH * v / top)
                  for n, v in ps]
            if len(xy) > 1:
                d = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
                parts.append(f'<polyline points="{d}" fill="none" stroke="{color}" '
                             'stroke-width="2"/>')
            for x, y in xy:
                parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>')
    y = H - 22
    for j, (_, label, color) in enumerate(MODES):
        x = 80 + j * 220
        parts.append(f'<rect x="{x}" y="{y - 10}" width="14" height="10" fill="{color}"/>')
        parts.append(text(x + 20, y, label, 12))
    parts.append(text(W - 20, y, f'pool {run["pool"]}, TTL {run["ttl_ms"]} ms, '
                                 f'held {run["hold_s"]} s', 11, "end"))
    parts.append("</svg>")
    with open(out, "w") as f:
        f.write("\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
