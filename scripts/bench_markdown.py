#!/usr/bin/env python3
"""Markdown from the JSON output of the bench command
(`cargo run --release -p pgfence-testing --example bench -- --json`).

usage: scripts/bench_markdown.py RUN.json [RUN.json ...]
       scripts/bench_markdown.py --doc DIR > BENCHMARKS.md
       scripts/bench_markdown.py --readme DIR

The first form prints, per run, the write table and the lease renewal table. The second writes
the whole of BENCHMARKS.md from what `scripts/bench` leaves in DIR: `meta.json` (machine,
commands, load, run time) and one JSON per run, named in it. The third prints README.md's
benchmark paragraph from the same files (scripts/bench puts it between the README's
`bench:start` and `bench:end` comments).
"""

import json
import math
import statistics
import sys
import textwrap

ORDER = [
    "unfenced",
    "unfenced-pgb-session",
    "fenced",
    "fenced-pgb-session",
    "fenced-pgb-tx",
    "fenced-wc8",
    "deferred",
    "deferred+flush",
    "solo",
    "pinned",
    "naive",
    "ldk-node",
    "coalesced",
    "unfenced-pgb-session",
    "fenced-pgb-session",
    "fenced-pgb-tx",
]

DESCRIPTIONS = {
    "unfenced": "`INSERT .. ON CONFLICT DO UPDATE`, one prepared statement, one pooled "
    "connection per writer. The baseline: no fence at all.",
    "fenced": "**the store**: `PgKvStore::write` with the library's defaults. The fenced "
    "statement (lease CTE, `FOR KEY SHARE`), shared by the writes that queue while "
    "`write_concurrency` (4) statements run.",
    "fenced-wc8": "the store with `write_concurrency` 8, on a table of its own: more "
    "statements at once, fewer writes in each.",
    "deferred": "`PgKvStore::write_deferred`: the store's write, committed without waiting "
    "for its WAL flush (`synchronous_commit = off` for that transaction only).",
    "deferred+flush": "`write_deferred`, then `PgKvStore::flush()`, each time: what a deferred "
    "write made durable at once costs.",
    "solo": "the store's fenced single-key statement, prepared, one per write, never shared.",
    "pinned": "`solo` with `synchronous_commit` set in the statement.",
    "naive": "the seed's first design: `BEGIN`; `UPDATE` of the lease row; upsert; `COMMIT`. "
    "Four round trips, prepared statements, one pooled connection per writer.",
    "ldk-node": "ldk-node's pattern: the fenced statement sent as a SQL string, so "
    "tokio-postgres prepares it on every write (two round trips), every write on one "
    "connection behind a mutex.",
}


def ms(us):
    return f"{us / 1000:.3f}"


def order_key(r):
    v = r["variant"]
    return (r["writers"], ORDER.index(v) if v in ORDER else len(ORDER), v)


def by_key(run):
    return {(r["writers"], r["variant"]): r for r in run["results"]}


def round_ratios(r, base, index):
    """Per-round ratios of r to base (index 0: writes/s, 1: p50), rounds paired in order."""
    a = r.get("rounds_ops_per_sec_p50_us", [])
    b = base.get("rounds_ops_per_sec_p50_us", [])
    return [x[index] / y[index] for x, y in zip(a, b) if y[index]]


def median_range(values):
    if not values:
        return "–"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.2f}"
    return f"**{med:.2f}** ({min(values):.2f}–{max(values):.2f})"


def median(values):
    return statistics.median(values) if values else float("nan")


def run_head(run):
    head = (
        f"{run['server_version'].split(' on ')[0]}, {run['cpus']} CPUs, {run['transport']}, "
        f"{run['value_size']}-byte values, {run['duration_secs']:g} s per variant and "
        f"concurrency in {run['rounds']} interleaved rounds"
    )
    if "rtt_p50_us" in run:
        head += f"; `SELECT 1` round trip p50 {ms(run['rtt_p50_us'])} ms, p99 {ms(run['rtt_p99_us'])} ms"
    if run.get("load_start"):
        head += f"; load average {run['load_start']} at the start, {run['load_end']} at the end"
    return head + "."


def run_tables(run):
    """The old form: one table of everything per run, and the renewal table."""
    out = [run_head(run) + "\n"]
    out.append(
        "| writers | variant | writes/s | p50 ms | p99 ms | p50 ×unf | p99 ×unf | writes/s ×unf "
        "| WAL B/write | MultiXacts/write | server CPU µs/write | client CPU µs/write |"
    )
    out.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(run["results"], key=order_key):
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
        for r in sorted(run["results"], key=order_key):
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


def doc_tables(run):
    """BENCHMARKS.md's two tables of a run: throughput and latency, then where the time goes."""
    results = by_key(run)
    out = [
        "| writers | variant | writes/s | ×unf, median of rounds (range) | p50 ms | p50 ×unf, "
        "median of rounds | p99 ms |",
        "|---:|---|---:|---|---:|---:|---:|",
    ]
    for r in sorted(run["results"], key=order_key):
        base = results.get((r["writers"], "unfenced"))
        own = r["variant"] == "unfenced" or not base
        tput = "–" if own else median_range(round_ratios(r, base, 0))
        p50 = "–" if own else f"{median(round_ratios(r, base, 1)):.3f}"
        out.append(
            f"| {r['writers']} | {r['variant']} | {r['ops_per_sec']:.0f} | {tput} "
            f"| {ms(r['p50_us'])} | {p50} | {ms(r['p99_us'])} |"
        )
    out.append("")
    out.append(
        "| writers | variant | writes/statement | statements in flight | statement ms | wait ms "
        "| MultiXacts/write | WAL B/write | server CPU µs/write | client CPU µs/write |"
    )
    out.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(run["results"], key=order_key):
        wps = r.get("writes_per_statement")
        cell = lambda k, f: f(r[k]) if k in r else "–"
        out.append(
            f"| {r['writers']} | {r['variant']} | {f'{wps:.2f}' if wps else '1'} "
            f"| {cell('in_flight_mean', lambda v: f'{v:.2f}')} "
            f"| {cell('statement_us', ms)} | {cell('wait_us', ms)} "
            f"| {r['multixacts_per_op']:.2f} | {r['wal_bytes_per_op']:.0f} "
            f"| {r.get('server_cpu_us_per_op', float('nan')):.0f} "
            f"| {r.get('client_cpu_us_per_op', float('nan')):.0f} |"
        )
    return "\n".join(out)


def target_row(what, run, writers, variant, index, goal, at_least, base="unfenced"):
    results = by_key(run or {"results": []})
    r, base = results.get((writers, variant)), results.get((writers, base))
    if not r or not base:
        return f"| {what} | not measured | |"
    rounds = round_ratios(r, base, index)
    med = median(rounds)
    whole = r["ops_per_sec"] / base["ops_per_sec"] if index == 0 else r["p50_us"] / base["p50_us"]
    met = med >= goal if at_least else med <= goal
    return (
        f"| {what} | {median_range(rounds)}; whole run {whole:.2f} "
        f"| {'met' if met else '**missed**'} |"
    )


def doc(directory):
    meta = json.load(open(f"{directory}/meta.json"))
    runs = {name: json.load(open(f"{directory}/{name}.json")) for name in meta["runs"]}
    proxy, loopback = runs["proxy"], runs["loopback"]
    pgbouncer = runs.get("pgbouncer")
    bouncer = (pgbouncer or {}).get("pgbouncer_version") or "PgBouncer"
    rtt = ms(proxy["rtt_p50_us"])
    out = []
    w = out.append
    w("# pgfence benchmarks")
    w("")
    w(
        "<!-- Written by scripts/bench (scripts/bench_markdown.py --doc "
        f"{meta['results']}); edit those, not this file. -->"
    )
    w("")
    if meta.get("quick"):
        w("**A quick run (`scripts/bench --quick`, 1 s per variant): a check of the script, not figures to quote.**")
        w("")
    w(
        "What fencing costs, measured side by side: every variant writes the same table in one "
        "run, in interleaved rounds, so that drift in the machine's load hits all alike. "
        "Ratios are to unfenced at the same number of writers. Each is the median of the "
        "per-round ratios (a variant against unfenced in the same round), with their range. "
        "The variants:"
    )
    w("")
    for v in ORDER:
        if any(r["variant"] == v for r in proxy["results"]):
            w(f"- **{v}**: {DESCRIPTIONS.get(v, '')}")
    w("")
    w(
        "All pools are deadpool with `RecyclingMethod::Fast`, statements prepared once per "
        "connection (except `ldk-node`'s), pool size = the largest number of writers. "
        "Values are 1 KiB, each write's different in every byte from the key's last."
    )
    w("")
    w("## Targets")
    w("")
    w("| target | median of rounds (range); whole-run ratio | |")
    w("|---|---|---|")
    w(target_row(f"1 writer, ~{rtt} ms round trip: p50 ≤ 1.02x unfenced", proxy, 1, "fenced", 1, 1.02, False))
    w(target_row(f"16 writers, ~{rtt} ms round trip: writes/s ≥ 1.0x unfenced", proxy, 16, "fenced", 0, 1.0, True))
    w(target_row(f"64 writers, ~{rtt} ms round trip: writes/s ≥ 3x unfenced", proxy, 64, "fenced", 0, 3.0, True))
    w(target_row("64 writers, TCP loopback: writes/s ≥ 3x unfenced", loopback, 64, "fenced", 0, 3.0, True))
    w(
        target_row(
            f"1 writer through {bouncer.rsplit('.', 1)[0] if bouncer[-1].isdigit() else bouncer}, "
            "transaction ÷ session mode p50 ≤ 1.15x",
            pgbouncer, 1, "fenced-pgb-tx", 1, 1.15, False, base="fenced-pgb-session",
        )
    )
    w("")
    w("## Machine and commands")
    w("")
    w(f"- Commit `{meta['commit']}`{' (with uncommitted changes)' if meta.get('dirty') else ''}, {meta['date']}.")
    w(f"- {meta['cpu']}, {meta['cores']} cores, Linux {meta['kernel']}. The machine is shared.")
    w(f"- {proxy['server_version'].split(' (')[0]}: a private cluster the bench starts (`pgfence_testing::TestCluster`), on the same machine.")
    w(
        f"- Load average (1, 5, 15 min) {meta['load_start']} at the start, {meta['load_end']} at "
        f"the end. The whole command took {meta['seconds'] / 60:.1f} min."
    )
    loads = [float(meta["load_end"].split()[0])] + [
        float(run.get(k, "0").split()[0]) for run in runs.values() for k in ("load_start", "load_end")
    ]
    if max(loads) > meta["cores"]:
        w(
            f"- **The 1-minute load reached {max(loads):.1f} on {meta['cores']} cores during the "
            "run**. The bench's own server, proxy and writers count in it, and so does any "
            "other work on the machine. Expect the figures to move between runs; the per-round "
            "ranges show how much."
        )
    w("")
    w("Made by one command, `scripts/bench`, which ran:")
    w("")
    w("```sh")
    for command in meta["commands"]:
        w(command)
    w("```")
    w("")
    w(
        f"The raw JSON and the trace of statements in flight are in `{meta['results']}/`. "
        "`--trace-inflight` samples the statements in flight every millisecond: the connections "
        "in use of the variant's pool (the store's from `PgKvStore::stats`), or whether "
        "`ldk-node`'s mutex is held. *statement ms* is a statement's mean duration by Little's "
        "law (in flight ÷ statements per second). *wait ms* is the rest of the mean write "
        "latency: the wait for a statement, and the client's own time around it. Both are "
        "estimates: the sampler runs on the bench's own runtime, beside the writers."
    )
    w("")
    w("![writes per second against unfenced, per variant and number of writers](docs/bench.svg)")
    w("")
    w(
        "*Writes per second (log scale) at 1, 16 and 64 writers, with the median per-round "
        "ratio to unfenced; from the JSON above by `scripts/bench_chart.py`.*"
    )
    for title, run in [
        (f"Through a delay proxy, ~{rtt} ms round trip", proxy),
        ("TCP loopback", loopback),
    ]:
        w("")
        w(f"## {title}")
        w("")
        w(run_head(run))
        w("")
        w(doc_tables(run))
    if pgbouncer:
        w("")
        w(through_pgbouncer(pgbouncer))
    w("")
    w(one_writer(proxy, loopback))
    w("")
    w(why(proxy, loopback))
    w("")
    w("## Earlier measurements")
    w("")
    w(
        "Measured with other commands (up to commit `f2896ae`, and the fenced functions of "
        "transaction mode since), and kept in "
        "[docs/benchmarks-archive.md](docs/benchmarks-archive.md):"
    )
    w("")
    for title, anchor in ARCHIVE:
        w(f"- [{title}](docs/benchmarks-archive.md#{anchor})")
    return "\n".join(out) + "\n"


ARCHIVE = [
    ("Scale: cost against table size, batches at a round trip", "scale"),
    ("Many stores", "many-stores"),
    ("Stats: the cost of the counters", "stats"),
    ("Write coalescing: why 16 writers are not slower (the MultiXact experiment)", "write-coalescing-why-16-writers-are-not-slower"),
    ("`batch_100`: where its time goes", "batch_100-where-its-time-goes"),
    ("Memory of queued writes", "memory-of-queued-writes"),
    ("Ten standbys", "ten-standbys"),
    ("Transaction mode: the cost of unnamed statements", "transaction-mode-the-cost-of-unnamed-statements-issue-17"),
    ("Transaction mode: a fenced function per table (pgbench and a throwaway program)", "transaction-mode-a-fenced-function-per-table-issue-28-2026-12-03"),
    ("Surprises", "surprises"),
]


def through_pgbouncer(run):
    """The section on PgBouncer: the store in transaction mode against session mode."""
    res = by_key(run)
    version = run.get("pgbouncer_version") or "PgBouncer"
    out = [
        "## Through PgBouncer: transaction ÷ session mode",
        "",
        run_head(run).replace(f"{run['transport']}, ", "TCP loopback, "),
        "",
        f"Two private bouncers ({version}, `pgfence_testing::PgBouncer`) in front of the server. "
        "**fenced-pgb-session**: the store through the session-mode one. **fenced-pgb-tx**: the "
        "store through the transaction-mode one, opened with "
        "`Builder::pool_mode(PoolMode::Transaction)`: a single write is one unnamed call of "
        "the table's fenced PL/pgSQL function; a shared statement (a queue's writes) runs unnamed "
        "between `BEGIN` and `COMMIT` in one round trip. Each on a table of its own. "
        "**fenced** is the store direct, **unfenced-pgb-session** the unfenced upsert through the "
        "session-mode bouncer. *PgBouncer CPU* is the bouncer's process.",
        "",
        "| writers | variant | writes/s | p50 ms | p99 ms | writes/statement | server CPU µs/write "
        "| PgBouncer CPU µs/write | client CPU µs/write |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cpu = lambda r, k: f"{r[k]:.0f}" if k in r else "–"
    for r in sorted(run["results"], key=order_key):
        wps = r.get("writes_per_statement")
        out.append(
            f"| {r['writers']} | {r['variant']} | {r['ops_per_sec']:.0f} | {ms(r['p50_us'])} "
            f"| {ms(r['p99_us'])} | {f'{wps:.2f}' if wps else '1'} "
            f"| {cpu(r, 'server_cpu_us_per_op')} | {cpu(r, 'pooler_cpu_us_per_op')} "
            f"| {cpu(r, 'client_cpu_us_per_op')} |"
        )
    out += [
        "",
        "| writers | transaction ÷ session: writes/s, median of rounds (range) | p50 | whole run: "
        "writes/s, p50 | server CPU per write |",
        "|---:|---|---|---|---:|",
    ]
    for writers in run["concurrency"]:
        tx, session = res.get((writers, "fenced-pgb-tx")), res.get((writers, "fenced-pgb-session"))
        if not tx or not session:
            continue
        srv = "server_cpu_us_per_op"
        cpu_ratio = f"{tx[srv] / session[srv]:.2f}" if srv in tx and srv in session else "–"
        out.append(
            f"| {writers} | {median_range(round_ratios(tx, session, 0))} "
            f"| {median_range(round_ratios(tx, session, 1))} "
            f"| {tx['ops_per_sec'] / session['ops_per_sec']:.2f}, "
            f"{tx['p50_us'] / session['p50_us']:.2f} | {cpu_ratio} |"
        )
    return "\n".join(out)


def one_writer(proxy, loopback):
    """The section on one writer: the fence's SQL against the library around it."""
    out = ["## One writer", ""]
    for name, run in [("Through the proxy", proxy), ("On loopback", loopback)]:
        res = by_key(run)
        u, f, s = (res.get((1, v)) for v in ("unfenced", "fenced", "solo"))
        if not (u and f and s):
            continue
        r = lambda a, b: f"{median(round_ratios(a, b, 1)):.3f}"
        out.append(
            f"- {name}: p50 {ms(u['p50_us'])} ms unfenced, {ms(s['p50_us'])} ms `solo`, "
            f"{ms(f['p50_us'])} ms the store. The fenced SQL costs {r(s, u)}x (solo ÷ "
            f"unfenced), the library around it {r(f, s)}x (store ÷ solo), medians of rounds."
        )
    out.append("")
    out.append(
        "The library's part is its client time: the write's own task, its key's turn, the "
        "statement permit and the pool, all outside the statement (*wait ms* above)."
    )
    return "\n".join(out)


def bound(results):
    """The wait at 16 writers from counts alone, without the sampler's estimates."""
    f, u = results.get((16, "fenced")), results.get((16, "unfenced"))
    if not f or not u or "writes_per_statement" not in f:
        return "- (No bound: the run lacks 16 writers of fenced and unfenced.)"
    write_ms = 16 / f["ops_per_sec"] * 1000  # Little's law for 16 closed-loop writers.
    statement_ms = 4 / (f["ops_per_sec"] / f["writes_per_statement"]) * 1000
    return (
        "- The same from counts alone, without sampling: 16 writers at "
        f"{f['ops_per_sec']:.0f} writes/s spend {write_ms:.2f} ms per write (Little's law; "
        f"unfenced: {16 / u['ops_per_sec'] * 1000:.2f} ms). With at most 4 statements at once, "
        f"of {f['ops_per_sec'] / f['writes_per_statement']:.0f} a second, a statement takes at "
        f"most {statement_ms:.2f} ms. So a write waits at least {write_ms - statement_ms:.2f} ms "
        "outside a statement."
    )


def why(proxy, loopback):
    """The section on 16 writers behind a round trip, with this run's figures."""
    p, l = by_key(proxy), by_key(loopback)

    def get(results, writers, variant, key, f):
        r = results.get((writers, variant))
        return f(r[key]) if r and key in r else "?"

    def value(results, writers, variant):
        r, base = results.get((writers, variant)), results.get((writers, "unfenced"))
        return median(round_ratios(r, base, 0)) if r and base else float("nan")

    def ratio(results, writers, variant):
        v = value(results, writers, variant)
        return "?" if math.isnan(v) else f"{v:.2f}"

    f2 = lambda v: f"{v:.2f}"
    flight = p.get((16, "fenced"), {}).get("in_flight_mean", 0)
    cap = "it runs at its cap" if flight >= 3.5 else "below its cap"
    cases = [(res, w) for res in (p, l) for w in (16, 64)]
    wc8_better = sum(value(r, w, "fenced-wc8") > value(r, w, "fenced") for r, w in cases)
    out = [
        "## What holds 16 writers back behind a round trip",
        "",
        "From the tables above (16 writers, through the proxy):",
        "",
        f"- The store runs {get(p, 16, 'fenced', 'in_flight_mean', f2)} statements at once on "
        f"average, against its `write_concurrency` of 4: {cap}. Each "
        f"carries {get(p, 16, 'fenced', 'writes_per_statement', f2)} writes and takes "
        f"{get(p, 16, 'fenced', 'statement_us', ms)} ms. Unfenced runs "
        f"{get(p, 16, 'unfenced', 'in_flight_mean', f2)} statements of "
        f"{get(p, 16, 'unfenced', 'statement_us', ms)} ms.",
        f"- On top, a store write waits {get(p, 16, 'fenced', 'wait_us', ms)} ms. In the code "
        "(`src/write/coalesce.rs`), a writer's next write comes back just after its "
        "statement's permit went to a write already queued. So it waits for the next statement to end: about a statement's time ÷ "
        "`write_concurrency`. Part of the wait is the store's own client time (its task per "
        "write, its wake-ups), which every write pays, queue or not. At 1 writer, where "
        f"nothing queues, the estimate of it is {get(p, 1, 'fenced', 'wait_us', ms)} ms; it "
        "grows with the machine's load.",
        bound(p),
        f"- More statements shorten the wait but not the write: with `write_concurrency` 8 the "
        f"wait is {get(p, 16, 'fenced-wc8', 'wait_us', ms)} ms, with "
        f"{get(p, 16, 'fenced-wc8', 'writes_per_statement', f2)} writes per statement, "
        f"{get(p, 16, 'fenced-wc8', 'multixacts_per_op', f2)} MultiXacts per write (against "
        f"{get(p, 16, 'fenced', 'multixacts_per_op', f2)}) and statements of "
        f"{get(p, 16, 'fenced-wc8', 'statement_us', ms)} ms. Its ratio to unfenced is "
        f"{ratio(p, 16, 'fenced-wc8')} here (the default: {ratio(p, 16, 'fenced')}), and "
        f"{ratio(l, 16, 'fenced-wc8')} on loopback (the default: {ratio(l, 16, 'fenced')}); at "
        f"64 writers {ratio(p, 64, 'fenced-wc8')} and {ratio(l, 64, 'fenced-wc8')} (the "
        f"default: {ratio(p, 64, 'fenced')} and {ratio(l, 64, 'fenced')}).",
        "",
        "So behind a round trip no statement takes less than the round trip. A shared statement "
        f"saves server CPU ({get(p, 16, 'fenced', 'server_cpu_us_per_op', lambda v: f'{v:.0f}')} "
        f"against {get(p, 16, 'unfenced', 'server_cpu_us_per_op', lambda v: f'{v:.0f}')} µs per "
        "write here: fewer commits, lease locks and MultiXacts). With 16 writers that saving "
        "must pay for the wait; with 64 it pays for it many times over. On these 2 shared "
        "cores the server, the client and the proxy also compete with other work for the CPU, "
        "so the ratios move with the load: see the ranges. `write_concurrency` 8 beat the "
        f"default 4 in {wc8_better} of the 4 cases (16 and 64 writers, proxy and loopback). "
        "An earlier sweep is in "
        "[the archive](docs/benchmarks-archive.md#write-coalescing-why-16-writers-are-not-slower).",
    ]
    return "\n".join(out)


def readme(directory):
    """README's benchmark paragraph, from the same run as BENCHMARKS.md."""
    meta = json.load(open(f"{directory}/meta.json"))
    proxy = json.load(open(f"{directory}/proxy.json"))
    loopback = json.load(open(f"{directory}/loopback.json"))
    pgbouncer = (
        json.load(open(f"{directory}/pgbouncer.json")) if "pgbouncer" in meta.get("runs", []) else None
    )
    p, l = by_key(proxy), by_key(loopback)

    def r(results, writers, variant, index):
        a, b = results.get((writers, variant)), results.get((writers, "unfenced"))
        return f"{median(round_ratios(a, b, index)):.2f}x" if a and b else "?"

    load = f"load average {meta['load_start'].split()[0]} to {meta['load_end'].split()[0]}"
    quick = " (a quick run: not figures to quote)" if meta.get("quick") else ""
    text = (
        f"Figures from the latest `scripts/bench` run{quick}: commit `{meta['commit']}`, "
        f"{meta['date']}, {meta['cores']} shared cores, {load}. "
        f"At a ~{ms(proxy['rtt_p50_us'])} ms round trip, one writer's median latency was "
        f"{r(p, 1, 'fenced', 1)} an unfenced upsert's. "
        f"With write coalescing, 16 writers got {r(p, 16, 'fenced', 0)} the unfenced "
        f"throughput and 64 writers {r(p, 64, 'fenced', 0)}. "
        f"On TCP loopback: {r(l, 16, 'fenced', 0)} and {r(l, 64, 'fenced', 0)}. "
        f"With 16 writers, the seed's designs got {r(p, 16, 'naive', 0)} (a transaction that "
        f"renews the lease) and {r(p, 16, 'ldk-node', 0)} (ldk-node's unprepared statement on "
        "one connection). "
    )
    if pgbouncer:
        b = by_key(pgbouncer)

        def tx(writers, index):
            t, s = b.get((writers, "fenced-pgb-tx")), b.get((writers, "fenced-pgb-session"))
            return f"{median(round_ratios(t, s, index)):.2f}x" if t and s else "?"

        text += (
            f"Through {pgbouncer.get('pgbouncer_version') or 'PgBouncer'} on loopback, the store "
            f"in transaction mode had {tx(1, 1)} the median latency of session mode with one "
            f"writer, and {tx(16, 0)} its throughput with 16. "
        )
    text += (
        "Ratios are medians of interleaved rounds. [BENCHMARKS.md][bench] has the figures, the "
        "machine and the command."
    )
    return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False) + "\n"


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--doc":
        sys.stdout.write(doc(sys.argv[2]))
        return
    if len(sys.argv) == 3 and sys.argv[1] == "--readme":
        sys.stdout.write(readme(sys.argv[2]))
        return
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        with open(path) as f:
            print(run_tables(json.load(f)))
        print()


if __name__ == "__main__":
    main()
