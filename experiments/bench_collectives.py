"""Allreduce algorithms against XLA's own `lax.psum` (and, with `--all-to-all`, the
all-to-alls against `lax.all_to_all`): time, bandwidth, cost model, bytes.

    python experiments/bench_collectives.py --floor --markdown table.md --json runs.jsonl \\
        --plot experiments/plots/collectives_busbw.png

For every per-device message size (float32, 4 KiB .. 64 MiB in powers of 4 unless
`--sizes` says otherwise) and every algorithm (psum, ring, butterfly, tree, ps with one
server, ps with n servers, hierarchical on a node=2 x data=n/2 layout with axis
("node", "data")), one `jax.jit(jax.shard_map(allreduce))` is compiled on a
pre-placed input and:

  * checked once against psum on the same input (a wrong answer is reported, not timed
    silently);
  * timed interleaved with psum: each repetition calls psum, then the algorithm, each
    call awaited with `block_until_ready` (the CPU backend deadlocks with ~40+
    collective programs in flight, and an awaited call is what we want to time).
    Nothing is donated. Reported: the median over `--reps` repetitions (after
    `--warmup` untimed calls) and the ratio to psum, which is the median over
    repetitions of t_algo / t_psum measured back to back, so load from other processes
    hits both alike;
  * read: `dpjax.collectives.cost.hlo_comm` counts the collective steps and the bytes
    the busiest device sends in the compiled program; the table shows those bytes over
    the Patarasuk-Yuan lower bound 2(n-1)/n * N, and the run fails loudly (`MISMATCH`)
    if the compiled program disagrees with `cost.schedule`;
  * modelled: `cost.schedule(...).time(link)`, the alpha-beta prediction, with the
    link's alpha (latency) and beta (1 / bandwidth) fitted to psum's own medians
    (below), or given by `--latency-us` / `--bandwidth-gbps`.

Bandwidths follow nccl-tests (PERFORMANCE.md): algbw = N / t with N the bytes each
device contributes, busbw = algbw * 2(n-1)/n for allreduce, the figure comparable to a
link's peak whatever n is.

Link fit (the default): psum is modelled as one step that moves the ring's bytes,
t = alpha + 2(n-1)/n * N / bw, and (alpha, 1/bw) are the least-squares fit of that
line to psum's medians at all sizes, on the relative error (so 4 KiB counts as much
as 64 MiB; alpha clamped at >= 0). This calibrates the model on XLA's own collective:
the model's ratios show what the alpha-beta view predicts for the explicit schedules
on "the same link". Where the explicit algorithms pay more per step or per byte than
psum (they do on the CPU backend: every ppermute is a rendezvous of all devices plus
a copy into a new buffer, and the local arithmetic is extra passes over memory) the
model underestimates them, and the table shows by how much.

`--floor` also times each algorithm's communication alone: a program with the same
`collective-permute`s as the compiled algorithm (same shapes, same source-target
pairs, same order, read from the compiled HLO), each sending what the previous one
received, no arithmetic, and a result the size of the input written at the end. Its
ratio to psum is a floor no rewrite of the local arithmetic can go below on that
backend (up to the cut / zero-pad copies it needs where consecutive sizes differ).

`--all-to-all` times the all-to-all algorithms instead (`pairwise`, `bruck`; the
default `--algorithms` then) against XLA's own `lax.all_to_all(..., tiled=True)`, which
takes psum's place in every column ("psum" rows and ratios then mean XLA's all-to-all):
the same interleaving, check, HLO count against `cost.schedule(..., primitive=
"all_to_all")`, model (fitted to XLA's all-to-all as one step moving (n-1)/n * N) and
floor; bytes are over the lower bound (n-1)/n * N (every block but a rank's own must
leave it) and busbw = algbw * (n-1)/n, as nccl-tests defines it for alltoall.

Devices: with no accelerator requested (`--platform auto` on a machine without one,
or `--platform cpu`) the script asks JAX for `--devices` simulated CPU devices before
JAX starts (`dpjax.simulate_cpu_devices`, i.e. XLA's
--xla_force_host_platform_device_count); on a GPU host with enough devices the same
command runs on the GPUs unchanged.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time

import _bench
from _collectives_report import (KIB, MIB, baseline_label, finish_rows, fit_link, fmt_size, markdown, plot,
                                 print_table)
from _collectives_variants import run

DEFAULT_SIZES = tuple(4 * KIB * 4**k for k in range(8))  # 4 KiB .. 64 MiB
QUICK_SIZES = (4 * KIB, 256 * KIB, 4 * MIB)
ALGORITHMS = ("psum", "ring", "butterfly", "tree", "ps", "ps-n", "hierarchical")
ALL_TO_ALL = ("psum", "pairwise", "bruck")  # "psum": XLA's own all-to-all, the baseline


# ---------------------------------------------------------------------------------------
# Arguments


def parse_size(text: str) -> int:
    """'4KiB', '64k', '1MiB', '1m', '4096' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r}; use e.g. 4KiB, 1MiB, 65536")
    value = float(m.group(1)) * {"": 1, "k": KIB, "m": MIB, "g": 1024 * MIB}[m.group(2)]
    if value < 4 or value % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return int(value)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Median time of each dpjax allreduce (ring, butterfly, tree, ps, "
                    "hierarchical) against XLA's psum, interleaved in one run, with bus "
                    "bandwidth, the alpha-beta model's prediction and the bytes each device "
                    "sends in the compiled program over the lower bound 2(n-1)/n*N.",
        epilog="Example: python experiments/bench_collectives.py --quick. "
               "See the module docstring for how the link is fitted.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--sizes", type=lambda s: [parse_size(t) for t in s.split(",") if t.strip()],
      help="comma-separated per-device message sizes, e.g. 4KiB,1MiB,64MiB "
           "(default: 4 KiB .. 64 MiB in powers of 4)")
    a("--quick", action="store_true",
      help="a short run: sizes 4 KiB, 256 KiB, 4 MiB (unless --sizes), 3 reps, 1 warm-up")
    a("--all-to-all", action="store_true",
      help="time the all-to-all algorithms (pairwise, bruck) against lax.all_to_all instead")
    a("--algorithms", default=None,
      help="comma-separated subset of " + ", ".join(ALGORITHMS)
           + " (ps: one server; ps-n: n servers; psum is always timed as the baseline); with --all-to-all "
           + "of pairwise, bruck (default: all of them)")
    a("--reps", type=int, default=7, help="timed repetitions per algorithm and size")
    a("--warmup", type=int, default=2, help="untimed calls per program before timing")
    a("--devices", type=int, default=8, help="devices in the allreduce")
    a("--platform", default="auto",
      help="'auto' (an accelerator if the default backend has enough devices, else "
           "simulated CPU devices), 'cpu', or an accelerator platform such as 'gpu'")
    a("--latency-us", type=float, help="link latency alpha in microseconds (default: fitted to psum)")
    a("--bandwidth-gbps", type=float,
      help="link bandwidth in GB/s = 1e9 bytes/s (default: fitted to psum)")
    a("--floor", action="store_true",
      help="also time each algorithm's collective-permutes alone (no arithmetic): the "
           "communication floor on this backend")
    a("--no-check", action="store_true", help="skip the comparison with psum's result")
    a("--processes", type=int, default=1,
      help="run across this many processes on this host (dpjax.launch, jax.distributed: gloo on "
           "CPU), --devices split evenly between them; hierarchical's node axis is the process")
    a("--collectives", choices=("gloo", "mpi"), default="gloo",
      help="with --processes: how the processes exchange data (dpjax.distributed.transport): gloo (TCP; "
           "started by dpjax.launch) or mpi (JAX's MPI collectives through MPItrampoline: needs "
           "MPITRAMPOLINE_LIB and Open MPI's mpirun, which starts the processes; one device each)")
    a("--markdown", metavar="FILE", help="write the results as markdown tables")
    a("--json", metavar="FILE", help="write one JSON object per (size, algorithm)")
    a("--plot", metavar="FILE", help="write a PNG of bus bandwidth against size (needs matplotlib)")
    _bench.add_smoke(p, "4 devices, 4 and 8 KiB, 1 repetition, every algorithm")
    args = p.parse_args(argv)
    if args.smoke:
        args.devices = 2 * args.processes if args.processes > 1 else 4  # hierarchical: node=2 x data=2
        if args.processes > 1 and args.collectives == "mpi":
            args.devices = args.processes  # an MPI rank is one device
        args.sizes, args.reps, args.warmup, args.floor = [4 * KIB, 8 * KIB], 1, 0, args.processes == 1
        _bench.smoke_outputs(args, "markdown", "json", "plot")
    if args.quick:
        args.sizes = args.sizes or list(QUICK_SIZES)
        args.reps, args.warmup = min(args.reps, 3), min(args.warmup, 1)
    args.sizes = args.sizes or list(DEFAULT_SIZES)
    args.primitive = "all_to_all" if args.all_to_all else "allreduce"
    known = ALL_TO_ALL if args.all_to_all else ALGORITHMS
    if args.algorithms is None and not args.all_to_all and (args.devices < 4 or args.devices % 2):
        known_here = [k for k in known if k != "hierarchical"]  # it needs node=2 x data>=2
    else:
        known_here = known
    args.algorithms = [s.strip() for s in (args.algorithms or ",".join(known_here)).split(",") if s.strip()]
    for name in args.algorithms:
        if name not in known:
            p.error(f"unknown algorithm {name!r}; choose from {', '.join(known)}")
    if args.reps < 1 or args.warmup < 0 or args.devices < 1:
        p.error("--reps and --devices must be >= 1 and --warmup >= 0")
    if (args.latency_us is None) != (args.bandwidth_gbps is None):
        p.error("give both --latency-us and --bandwidth-gbps, or neither (then both are fitted)")
    if args.bandwidth_gbps is not None and (args.bandwidth_gbps <= 0 or args.latency_us < 0):
        p.error("--bandwidth-gbps must be > 0 and --latency-us >= 0")
    if args.processes < 1 or args.devices % args.processes:
        p.error(f"--devices {args.devices} must split evenly over --processes {args.processes}")
    if args.processes > 1 and args.floor:
        p.error("--floor runs in one process only")
    if args.collectives == "mpi" and args.processes > 1 and args.devices != args.processes:
        p.error(f"--collectives mpi takes one device per process: give --devices {args.processes}")
    if args.plot and not args.plot.lower().endswith(".png"):
        p.error("--plot writes a PNG; give a FILE ending in .png")
    return args


# ---------------------------------------------------------------------------------------
# The command


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from dpjax import distributed
    from dpjax.distributed import launchers

    if args.processes > 1 and launchers.detect(os.environ) is None:  # start them
        command = [sys.executable, os.path.abspath(__file__), *argv]
        if args.collectives == "mpi":
            return _bench.mpirun(command, args.processes, args.smoke)
        from dpjax.launch import launch

        return launch(command, args.processes, devices_per_process=args.devices // args.processes,
                      collectives=args.collectives)
    if args.processes > 1:
        distributed.initialize(collectives=args.collectives)
        _bench.simulate(args.devices // args.processes)
        distributed.ready()  # the world's communicator (MPI), before any large buffer
    elif args.platform in ("auto", "cpu"):
        _bench.simulate(args.devices)  # before JAX initialises; only shapes the CPU backend
    import jax

    if jax.process_index() != 0:  # every process times; process 0 reports
        run(args, log=lambda s: None)
        return 0
    return distributed.leave_now(report(args, argv))  # MPI: the exit handler would exit 0


def report(args, argv) -> int:
    import jax

    t0 = time.time()
    print(f"{args.primitive} of {', '.join(fmt_size(s) for s in args.sizes)} per device; "
          f"{args.reps} reps after {args.warmup} warm-up", flush=True)
    rows, devices = run(args, log=lambda s: print(s, flush=True))
    n = args.devices
    link, how = fit_link(rows, n, args)
    finish_rows(rows, n, link, args.primitive)
    info = dict(n=n, platform=devices[0].platform, jax=jax.__version__, primitive=args.primitive,
                baseline=baseline_label(args.primitive),
                machine=_bench.machine(),
                alpha_us=link.latency * 1e6, bandwidth_GBps=link.bandwidth / 1e9, link_how=how,
                reps=args.reps, processes=args.processes, date=datetime.date.today().isoformat(),
                seconds=round(time.time() - t0, 1))
    print_table(rows, info)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, info, argv))
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps({**r, **{f"run_{k}": v for k, v in info.items()}}) + "\n")
    if args.plot and plot(rows, info, args.plot):
        print(f"wrote {args.plot}")
    bad = [r for r in rows if r["correct"] is False or r["mismatch"]]
    for r in bad:
        print(f"error: {r['label']} at {fmt_size(r['size_bytes'])}: "
              + ("wrong result; " if r["correct"] is False else "")
              + (f"compiled program sends ({r['steps']} steps, {r['bytes_sent']} B), "
                 f"cost.schedule says ({r['model_steps']}, {r['model_bytes']})" if r["mismatch"] else ""),
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
