"""gloo against MPI as the CPU transport between processes (issue 21): every allreduce
algorithm and psum, `bench_collectives.py --processes P --collectives gloo|mpi`, run in
alternation for several rounds so that load on a shared machine hits both alike; medians
over rounds of each run's median.

    MPITRAMPOLINE_LIB=... python experiments/compare_transports.py --processes 2,4 --rounds 3 \\
        --sizes 4KiB,256KiB,4MiB,32MiB --markdown transports.md

Each run is its own job (dpjax.launch for gloo, mpirun for mpi: dpjax.distributed.transport
says why), one simulated CPU device per process. Round r runs, for each process count,
gloo then mpi when r is even and mpi then gloo when it is odd. `uptime`'s 1-minute load
is read before every run and reported. The goal line (issue 21): per size, dpjax's best
explicit allreduce (any algorithm, either transport) over the fastest transport's psum.
Without MPITRAMPOLINE_LIB it refuses in one line (a smoke run skips the mpi runs, saying so).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import _bench
from _bench import median

HERE = os.path.dirname(os.path.abspath(__file__))
TRANSPORTS = ("gloo", "mpi")
GOAL = 1.2  # issue 21: the best explicit allreduce within 1.2x of the fastest transport


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--processes", default="2,4", help="comma-separated process counts (one device each)")
    p.add_argument("--rounds", type=int, default=3, help="alternating gloo / mpi rounds")
    p.add_argument("--sizes", default="4KiB,256KiB,4MiB,32MiB", help="per-process sizes (bench_collectives)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per run (bench_collectives)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per program (bench_collectives)")
    p.add_argument("--markdown", metavar="FILE", help="write the tables as markdown")
    _bench.add_smoke(p, "2 processes, 4 KiB, 1 round, 1 repetition; mpi skipped without MPITRAMPOLINE_LIB")
    args = p.parse_args(argv)
    if args.smoke:
        args.processes, args.rounds, args.sizes, args.reps, args.warmup = "2", 1, "4KiB", 1, 0
        _bench.smoke_outputs(args, "markdown")
    args.processes = [int(n) for n in args.processes.split(",")]
    if args.rounds < 1 or min(args.processes) < 2:
        p.error("--rounds must be >= 1 and every process count >= 2")
    return args


def load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def one_run(args, n: int, transport: str) -> list[dict] | None:
    """One bench_collectives job: its rows, or None when it was skipped (one line said why)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.jsonl")
        cmd = [sys.executable, os.path.join(HERE, "bench_collectives.py"), "--processes", str(n), "--devices",
               str(n), "--collectives", transport, "--sizes", args.sizes, "--reps", str(args.reps), "--warmup",
               str(args.warmup), "--json", out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        skipped = [line for line in r.stdout.splitlines() if line.startswith("skipped: ")]
        if r.returncode == 0 and skipped and not os.path.exists(out):
            print(f"  {transport} x{n}: {skipped[0]}", flush=True)
            return None
        if r.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"error: {' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        with open(out) as f:
            return [json.loads(line) for line in f]


def measure(args, transports):
    """{(n, transport, algorithm, size): [per-run medians]}, labels, loads."""
    times, labels, loads = {}, {}, []
    for rnd in range(args.rounds):
        for n in args.processes:
            for transport in transports if rnd % 2 == 0 else transports[::-1]:
                loads.append(float(load()))
                rows = one_run(args, n, transport)
                print(f"round {rnd + 1}, {n} processes, {transport}: load {loads[-1]:.2f}"
                      + ("" if rows is None else f", {len(rows)} rows"), flush=True)
                for r in rows or []:
                    times.setdefault((n, transport, r["algorithm"], r["size_bytes"]), []).append(r["time_s"])
                    # the run's paired ratio: the algorithm over psum called just before it
                    times.setdefault((n, transport, r["algorithm"], r["size_bytes"], "ratio"), []).append(r["ratio"])
                    labels[r["algorithm"]] = r["label"].split(" (")[0] if r["algorithm"] != "ps-n" else "ps-n"
    return times, labels, loads


def tables(times, labels, args, loads) -> str:
    from bench_collectives import fmt_size

    out = [f"{args.rounds} rounds, gloo and mpi alternating; each cell the median over rounds of a run's "
           f"median of {args.reps} awaited calls, in ms; load (1 min) {min(loads):.2f} .. {max(loads):.2f} "
           f"(median {median(loads):.2f})."]
    out.append("Goal (issue 21: <= 1.2): dpjax's best explicit allreduce over the fastest transport's psum, "
               "as paired ratios: for each transport, the algorithm's median (over rounds) ratio to psum called "
               "just before it in the same run, times that transport's psum over the fastest psum; the best "
               "(algorithm, transport). Absolute: the fastest explicit cell over the fastest psum cell (a minimum "
               "over more noisy cells, so biased low).")
    for n in args.processes:
        have = [t for t in TRANSPORTS if any(k[:2] == (n, t) for k in times)]
        algs = list(dict.fromkeys(k[2] for k in times if k[0] == n and len(k) == 4))
        cols = [(t, a) for t in have for a in algs if (n, t, a, _first_size(times, n)) in times]
        out += ["", f"{n} processes, 1 CPU device each:", "",
                "| per process | " + " | ".join(f"{t} {labels[a]}" for t, a in cols)
                + " | goal, paired | goal, absolute |", "|---" * (len(cols) + 3) + "|"]
        for size in sorted({k[3] for k in times if k[0] == n and len(k) == 4}):
            cell = {(t, a): median(times[(n, t, a, size)]) for t, a in cols if (n, t, a, size) in times}
            psum = {t: v for (t, a), v in cell.items() if a == "psum"}
            fastest = min(psum.values())
            paired = min(((median(times[(n, t, a, size, "ratio")]) * psum[t] / fastest, t, a)
                          for t, a in cell if a != "psum"), default=None)
            best = min(((v / fastest, t, a) for (t, a), v in cell.items() if a != "psum"), default=None)
            out.append(f"| {fmt_size(size)} | " + " | ".join(
                f"{cell[c] * 1e3:.3f}" if c in cell else "" for c in cols)
                + f" | {_goal(paired, labels)} | {_goal(best, labels)} |")
    return "\n".join(out) + "\n"


def _goal(best, labels) -> str:
    if best is None:
        return ""
    return f"{best[0]:.2f} ({best[1]} {labels[best[2]]}): " + ("met" if best[0] <= GOAL else "not met")


def _first_size(times, n):
    return min(k[3] for k in times if k[0] == n and len(k) == 4)


def main(argv=None) -> int:
    args = parse_args(argv)
    from dpjax.distributed import transport

    why = transport.problem("mpi")
    if why and not args.smoke:
        print(f"error: {why}", file=sys.stderr)
        return 2
    if why:
        print(f"skipped: the mpi runs: {why}", flush=True)
    times, labels, loads = measure(args, TRANSPORTS[:1] if why else TRANSPORTS)
    text = tables(times, labels, args, loads)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
