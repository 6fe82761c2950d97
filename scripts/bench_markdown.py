#!/usr/bin/env python3
"""Markdown tables from the JSON output of `cargo run --release -p pgfence-testing --example bench -- --json`.

usage: scripts/bench_markdown.py RUN.json [RUN.json ...]

Prints, per run, the write table (throughput, latency, ratios to unfenced, WAL, MultiXacts and
CPU per write) and the lease renewal table, as pasted into BENCHMARKS.md.
"""

import json
import sys

ORDER = ["unfenced", "fenced", "solo", "naive", "coalesced"]


def ms(us):
    return f"{us / 1000:.3f}"


def run_tables(run):
    out = []
    head = (
        f"{run['server_version'].split(' on ')[0]}, {run['cpus']} CPUs, {run['transport']}, "
        f"{run['value_size']}-byte values, {run['duration_secs']:g} s per variant and "
        f"concurrency in {run['rounds']} interleaved rounds"
    )
    if "rtt_p50_us" in run:
        head += f"; `SELECT 1` round trip p50 {ms(run['rtt_p50_us'])} ms, p99 {ms(run['rtt_p99_us'])} ms"
    out.append(head + ".\n")
    out.append(
        "| writers | variant | writes/s | p50 ms | p99 ms | p50 ×unf | p99 ×unf | writes/s ×unf "
        "| WAL B/write | MultiXacts/write | server CPU µs/write | client CPU µs/write |"
    )
    out.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    key = lambda r: (r["writers"], ORDER.index(r["variant"]) if r["variant"] in ORDER else 9)
    for r in sorted(run["results"], key=key):
        vs = r.get("vs_unfenced")
        ratio = lambda k: f"{vs[k]:.2f}" if vs else "–"
        out.append(
            f"| {r['writers']} | {r['variant']} | {r['ops_per_sec']:.0f} | {ms(r['p50_us'])} "
            f"| {ms(r['p99_us'])} | {ratio('p50')} | {ratio('p99')} | {ratio('ops_per_sec')} "
            f"| {r['wal_bytes_per_op']:.0f} | {r['multixacts_per_op']:.2f} "
            f"| {r.get('server_cpu_us_per_op', float('nan')):.0f} "
            f"| {r.get('client_cpu_us_per_op', float('nan')):.0f} |"
        )
    if any("renewal" in r for r in run["results"]):
        out.append("")
        out.append(
            "| writers | variant | renewal p50 ms | renewal p99 ms | max ms | samples "
            "| async-commit renewal p50 ms | p99 ms |"
        )
        out.append("|---:|---|---:|---:|---:|---:|---:|---:|")
        for r in sorted(run["results"], key=key):
            n = r.get("renewal")
            a = r.get("renewal_async_commit")
            if not n:
                continue
            async_cols = f"{ms(a['p50_us'])} | {ms(a['p99_us'])}" if a else "– | –"
            out.append(
                f"| {r['writers']} | {r['variant']} | {ms(n['p50_us'])} | {ms(n['p99_us'])} "
                f"| {ms(n['max_us'])} | {n['samples']} | {async_cols} |"
            )
    return "\n".join(out)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        with open(path) as f:
            print(run_tables(json.load(f)))
        print()


if __name__ == "__main__":
    main()
