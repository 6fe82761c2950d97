#!/usr/bin/env python3
"""The end-to-end A/B of stats: `fenced_write` (benches/write_latency.rs) built with and
without the recordings of `PgKvStore::stats()`, in many short interleaved rounds.

The recordings cannot be switched off, so the baseline is a second build of the same commit:
a worktree (target/nostats) with benches/no-stats.patch applied, which empties the recorder
and drops the clock reads around each operation. Nothing else differs between the builds. It
builds into a target dir of its own (target/nostats/target), seeded from target/release.

Each round runs every build once, in an order that alternates (AB, BA, ...), so a trend of the
machine's load weighs on both alike. Every run starts its own private cluster. The figures:
each build's median of its round medians, and the median of the paired ratios (build ÷
baseline, one pair per round) with a distribution-free 95% confidence interval.

Run from the repository root:

    python3 benches/stats_ab.py --rounds 20 [--metrics] [--json out.json]
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "target")
WORKTREE = os.path.join(TARGET, "nostats")
WORKTREE_TARGET = os.path.join(WORKTREE, "target")
PATCH = os.path.join(ROOT, "benches", "no-stats.patch")


def sh(args, cwd=ROOT, env=None, capture=False):
    return subprocess.run(args, cwd=cwd, env=env, check=True, text=True,
                          stdout=subprocess.PIPE if capture else None)


def prepare_worktree():
    """target/nostats: this checkout's HEAD with the recordings patched out."""
    head = sh(["git", "rev-parse", "HEAD"], capture=True).stdout.strip()
    if not os.path.isdir(WORKTREE):
        sh(["git", "worktree", "add", "--detach", WORKTREE, head])
        sh(["git", "apply", PATCH], cwd=WORKTREE)
    # The library's sources must be HEAD's (a later commit of benches or docs is fine), and
    # uncommitted changes would be in one build only.
    src = [sh(["git", "rev-parse", "HEAD:src"], cwd=cwd, capture=True).stdout
           for cwd in (ROOT, WORKTREE)]
    if src[0] != src[1]:
        sys.exit(f"{WORKTREE} has other sources than HEAD: remove it "
                 "(git worktree remove --force target/nostats) and run again")
    if sh(["git", "status", "--porcelain", "--", "src", "Cargo.toml", "Cargo.lock"],
          capture=True).stdout:
        sys.exit("uncommitted changes in src/ or Cargo.*: the two builds would differ in them")
    return head


def seed_worktree_target():
    """The worktree's own target dir, seeded with this checkout's release dependencies.

    A target dir of its own: cargo names a path package's artifacts by its path relative to
    the workspace, so in one shared target dir the two builds would overwrite each other, or
    one would be taken for the other. The copied artifacts of pgfence itself would look newer
    than the worktree's sources, so those are touched: cargo then rebuilds pgfence.
    """
    release = os.path.join(TARGET, "release")
    seeded = os.path.join(WORKTREE_TARGET, "release")
    if os.path.isdir(seeded) or not os.path.isdir(release):
        return
    os.makedirs(seeded)
    for part in ("build", ".fingerprint", "deps"):
        sh(["cp", "-a", os.path.join(release, part), seeded])
    for top in ("src", "pgfence-testing", "benches", "Cargo.toml"):
        sh(["find", os.path.join(WORKTREE, top), "-path", WORKTREE_TARGET, "-prune", "-o",
            "-type", "f", "-exec", "touch", "{}", "+"])


def build(cwd, target, features):
    """Builds the bench in `cwd` into `target`; returns the executable."""
    env = dict(os.environ, CARGO_TARGET_DIR=target, CARGO_INCREMENTAL="0")
    args = ["cargo", "bench", "--bench", "write_latency", "--no-run",
            "--message-format=json-render-diagnostics"]
    if features:
        args += ["--features", features]
    out = sh(args, cwd=cwd, env=env, capture=True).stdout
    for line in out.splitlines():
        msg = json.loads(line)
        if (msg.get("reason") == "compiler-artifact" and msg.get("executable")
                and msg["target"]["name"] == "write_latency"):
            return msg["executable"]
    sys.exit(f"no write_latency executable built in {cwd}")


def run_once(name, exe, args):
    """One criterion run of `fenced_write`; returns its median time per write, in µs."""
    home = os.path.join(TARGET, "stats-ab", name)
    env = dict(os.environ, CRITERION_HOME=home)
    env.pop("DATABASE_URL", None)  # A private cluster per run, the same for every build.
    load = os.getloadavg()[0]
    subprocess.run([exe, "--bench", "fenced_write", "--noplot",
                    "--warm-up-time", str(args.warm_up), "--measurement-time",
                    str(args.measurement), "--sample-size", str(args.samples)],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    path = os.path.join(home, "write_latency", "fenced_write", "new", "estimates.json")
    with open(path) as f:
        median_ns = json.load(f)["median"]["point_estimate"]
    return median_ns / 1000.0, load


def median_ci(values, confidence=0.95):
    """The order statistics bounding the median with at least `confidence` (binomial)."""
    xs = sorted(values)
    n = len(xs)
    # The largest k with P(k <= Bin(n, 1/2) - 1 ... ): P(X < k) <= (1 - confidence) / 2.
    tail, k = 0.0, 0
    while True:
        p = math.comb(n, k) / 2 ** n
        if tail + p > (1 - confidence) / 2:
            break
        tail += p
        k += 1
    if k == 0:
        return xs[0], xs[-1]
    return xs[k - 1], xs[n - k]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--metrics", action="store_true",
                        help="also a third build: with stats and the `metrics` feature")
    parser.add_argument("--warm-up", type=float, default=1.0, help="seconds per run")
    parser.add_argument("--measurement", type=float, default=3.0, help="seconds per run")
    parser.add_argument("--samples", type=int, default=20, help="criterion samples per run")
    parser.add_argument("--json", help="write every round's figures here")
    args = parser.parse_args()

    head = prepare_worktree()
    seed_worktree_target()
    builds = [("without", build(WORKTREE, WORKTREE_TARGET, None)),
              ("with", build(ROOT, TARGET, None))]
    if args.metrics:
        builds.append(("with+metrics", build(ROOT, TARGET, "metrics")))
    exes = [exe for _, exe in builds]
    assert len(set(exes)) == len(exes), f"two builds made one executable: {exes}"

    rounds = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        for r in range(args.rounds):
            order = builds if r % 2 == 0 else builds[::-1]
            figures = {}
            for name, exe in order:
                figures[name] = run_once(name, exe, args)
            rounds.append(figures)
            print(f"round {r + 1:2}: " + ", ".join(
                f"{name} {us:.1f} µs (load {load:.1f})" for name, (us, load) in figures.items()),
                flush=True)
    except KeyboardInterrupt:
        # Interrupted (SIGINT): the rounds done so far still make a summary.
        print(f"interrupted after {len(rounds)} rounds", flush=True)
        if not rounds:
            raise
    ended = time.strftime("%H:%M UTC", time.gmtime())

    loads = [load for figures in rounds for _, load in figures.values()]
    print(f"\ncommit {head[:7]}, {started}–{ended}, {len(rounds)} rounds, "
          f"load average {min(loads):.1f}–{max(loads):.1f} (median "
          f"{statistics.median(loads):.1f})")
    base = [figures["without"][0] for figures in rounds]
    summary = {}
    for name, _ in builds:
        times = [figures[name][0] for figures in rounds]
        line = f"{name:>13}: median of round medians {statistics.median(times):.1f} µs"
        entry = {"median_us": statistics.median(times)}
        if name != "without":
            ratios = [t / b for t, b in zip(times, base)]
            low, high = median_ci(ratios)
            line += (f"; ÷ without: median ratio {statistics.median(ratios):.3f}, "
                     f"95% CI {low:.3f}–{high:.3f}, ratio of medians "
                     f"{statistics.median(times) / statistics.median(base):.3f}")
            entry.update(ratio=statistics.median(ratios), ci=[low, high])
        print(line)
        summary[name] = entry
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": head, "started": started, "ended": ended,
                       "args": vars(args), "summary": summary,
                       "rounds": [{name: {"median_us": us, "load": load}
                                   for name, (us, load) in figures.items()}
                                  for figures in rounds]}, f, indent=1)


if __name__ == "__main__":
    main()
