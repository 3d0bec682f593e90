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
JAX starts (`dpjax.mesh.simulate_cpu_devices`, i.e. XLA's
--xla_force_host_platform_device_count); on a GPU host with enough devices the same
command runs on the GPUs unchanged.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import sys
import time

import _bench
from _bench import median

KIB = 1024
MIB = 1024 * 1024
DEFAULT_SIZES = tuple(4 * KIB * 4**k for k in range(8))  # 4 KiB .. 64 MiB
QUICK_SIZES = (4 * KIB, 256 * KIB, 4 * MIB)
ALGORITHMS = ("psum", "ring", "butterfly", "tree", "ps", "ps-n", "hierarchical")
ALL_TO_ALL = ("psum", "pairwise", "bruck")  # "psum": XLA's own all-to-all, the baseline


def baseline_label(primitive: str) -> str:
    return "psum (XLA all-reduce)" if primitive == "allreduce" else "XLA all-to-all"


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


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


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
# Devices and programs


class Variant:
    """One algorithm on its mesh: labels, the dpjax call, and the cost.schedule arguments."""

    def __init__(self, name: str, n: int, devices, primitive: str = "allreduce"):
        from dpjax import make_mesh

        self.name, self.n, self.primitive = name, n, primitive
        self.algorithm = {"ps-n": "ps"}.get(name, name)
        self.options = {"ps": {"num_servers": 1}, "ps-n": {"num_servers": n}}.get(name, {})
        if name == "hierarchical":
            if n % 2 or n < 4:
                raise SystemExit(f"error: hierarchical needs an even device count >= 4, got {n}")
            self.groups, self.inner = 2, n // 2
            self.mesh = make_mesh(f"node=2,data={n // 2}", devices)
            self.axis = ("node", "data")
            self.label = f"hierarchical (node=2, data={n // 2})"
        else:
            self.groups, self.inner = 1, n
            self.mesh = make_mesh(f"data={n}", devices)
            self.axis = "data"
            self.label = {"ps": "ps (1 server)", "ps-n": f"ps ({n} servers)"}.get(name, name)
        if primitive == "all_to_all":
            self.label = baseline_label(primitive) if name == "psum" else name

    def schedule(self, nelems: int):
        from dpjax.collectives import cost

        if self.primitive == "all_to_all":  # nelems: one rank's whole input
            return cost.schedule(self.call_name(), self.n, nelems, 4, primitive="all_to_all")
        if self.algorithm == "hierarchical":
            return cost.schedule("hierarchical", self.inner, nelems, 4, groups=self.groups)
        return cost.schedule(self.algorithm, self.n, nelems, 4, **self.options)

    def call_name(self, algorithm=None) -> str:
        """The dpjax algorithm name ("psum" is XLA's own op: "xla" for all-to-all)."""
        alg = algorithm or self.algorithm
        return "xla" if self.primitive == "all_to_all" and alg == "psum" else alg

    def compile(self, x, algorithm=None):
        """Compiled `jit(shard_map(allreduce))` (or all_to_all) of this variant, or of
        `algorithm` on its mesh."""
        import jax
        from jax.sharding import PartitionSpec as P

        from dpjax import collectives

        alg = self.call_name(algorithm)
        opts = self.options if algorithm is None else {}
        axis, nloc = self.axis, x.shape[0] // self.n

        def body(v_N):
            assert v_N.shape == (nloc,), v_N.shape
            if self.primitive == "all_to_all":
                return collectives.all_to_all(v_N, axis, algorithm=alg)
            return collectives.allreduce(v_N, axis, algorithm=alg, **opts)

        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P(axis), out_specs=P(axis)))
        return f.lower(x).compile()

    def place(self, host_array):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        # each process places only the blocks its own devices hold
        return jax.make_array_from_callback(host_array.shape, NamedSharding(self.mesh, P(self.axis)),
                                            lambda idx: host_array[idx])


_PERMUTE_RE = re.compile(
    r"=\s*(?P<result>\S+)\s+collective-permute(?:-start)?\(.*?source_target_pairs=\{(?P<pairs>(?:\{\d+,\d+\},?)*)\}")
_ARRAY_RE = re.compile(r"\b[a-z]+\d*\[([0-9,]*)\]")


def permute_skeleton(hlo_text: str):
    """[(elements, pairs)] of every collective-permute of a compiled program, in order."""
    ops = []
    for line in hlo_text.splitlines():
        m = _PERMUTE_RE.search(line)
        if not m:
            continue
        dims = _ARRAY_RE.search(m.group("result")).group(1)
        pairs = [(int(s), int(t)) for s, t in re.findall(r"\{(\d+),(\d+)\}", m.group("pairs"))]
        ops.append((math.prod(int(d) for d in dims.split(",") if d), pairs))
    return ops


def compile_floor(variant: Variant, ops, nelems: int):
    """The same collective-permutes with no arithmetic: (compiled, inputs).

    The first permute sends (a cut of) an input of the algorithm's size, each later
    one the previous one's result (cut to, or zero-padded to, its size), so they run
    one after another on data another device just wrote, as in the algorithm; the only
    other work is that cut or pad where the size changes, and writing a result the size
    of the input at the end (as any allreduce must).
    """
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    axis, n = variant.axis, variant.n

    def body(x):
        y = x
        for size, pairs in ops:
            if y.shape[0] > size:
                y = y[:size]
            elif y.shape[0] < size:
                y = jnp.pad(y, (0, size - y.shape[0]))
            y = lax.ppermute(y, axis, pairs)
        # An allreduce writes a result the size of its input; so does the floor.
        return jnp.broadcast_to(y[:1], x.shape)

    f = jax.jit(jax.shard_map(body, mesh=variant.mesh, in_specs=P(axis), out_specs=P(axis)))
    inputs = [variant.place(jnp.ones((n * nelems,), jnp.float32))]
    return f.lower(*inputs).compile(), inputs


def timed(fn, *args) -> float:
    t = time.perf_counter()
    jax_block(fn(*args))
    return time.perf_counter() - t


def to_host(arr):
    """The whole array as numpy, gathered from every process when it spans several."""
    import numpy as np

    if arr.is_fully_addressable:
        return np.asarray(arr)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(arr, tiled=True))


def jax_block(out):
    import jax

    jax.block_until_ready(out)


# ---------------------------------------------------------------------------------------
# The run


def run(args, log=print):
    import numpy as np

    from dpjax.collectives import cost

    n = args.devices
    devices = _bench.pick_devices(args.devices, args.platform)
    variants = {name: Variant(name, n, devices, args.primitive) for name in ["psum"] + args.algorithms}
    from dpjax import distributed

    for v in variants.values():
        distributed.ready(v.mesh)  # the transport's communicators for each mesh (MPI: from this thread)
    bound = cost.bus_factor(args.primitive, n)
    rows = []
    rng = np.random.default_rng(0)
    for nbytes in args.sizes:
        nelems = nbytes // 4
        host = rng.standard_normal(n * nelems, dtype=np.float32)
        psum_times, size_rows = [], []
        for name in args.algorithms:
            if name == "psum":
                continue
            v = variants[name]
            x = v.place(host)
            base = v.compile(x, algorithm="psum")
            prog = v.compile(x)
            hlo = prog.as_text()
            comm = cost.hlo_comm(hlo)
            sched = v.schedule(nelems)
            mismatch = (comm.steps, comm.max_bytes) != (sched.total_steps, sched.total_bytes)
            ok = None
            if not args.no_check:
                want, got = to_host(base(x)), to_host(prog(x))
                ok = bool(np.allclose(got, want, rtol=1e-5, atol=1e-5 * math.sqrt(n)))
            floor = None
            if args.floor:
                floor = compile_floor(v, permute_skeleton(hlo), nelems)
            # psum, the algorithm (, psum, the floor), in that order every repetition, each
            # awaited: the ratios are of calls made back to back
            calls = {"psum": lambda i, f=base, a=x: jax_block(f(a)), "alg": lambda i, f=prog, a=x: jax_block(f(a))}
            if floor:
                calls.update({"psum2": calls["psum"], "floor": lambda i, f=floor: jax_block(f[0](*f[1]))})
            times = _bench.interleave(calls, args.reps, args.warmup, rotate=False)
            ta, tf = times["alg"], times.get("floor", [])
            tb = times["psum"] + times.get("psum2", [])
            ratios = [a / b for a, b in zip(ta, times["psum"])]
            fratios = [f / b for f, b in zip(tf, times.get("psum2", []))]
            psum_times += tb
            size_rows.append(dict(
                algorithm=name, label=v.label, size_bytes=nbytes,
                time_s=median(ta), ratio=median(ratios),
                psum_time_s=median(tb),
                floor_ratio=median(fratios) if floor else None,
                floor_time_s=median(tf) if floor else None,
                steps=comm.steps, bytes_sent=comm.max_bytes,
                bytes_over_bound=comm.max_bytes / (bound * nbytes),
                model_steps=sched.total_steps, model_bytes=sched.total_bytes,
                mismatch=mismatch, correct=ok, reps=args.reps))
            del x, base, prog, floor, calls
            flag = "" if ok in (None, True) else "  WRONG RESULT"
            flag += "  MISMATCH: compiled program differs from cost.schedule" if mismatch else ""
            log(f"  {fmt_size(nbytes):>8}  {v.label:<28} {size_rows[-1]['time_s'] * 1e3:9.3f} ms"
                f"  x{size_rows[-1]['ratio']:.2f} psum{flag}")
        # psum's own row: every psum timing taken at this size (it ran beside each algorithm).
        v = variants["psum"]
        x = v.place(host)
        prog = v.compile(x)
        comm = cost.hlo_comm(prog.as_text())
        if not psum_times:  # only psum was asked for
            for _ in range(args.warmup):
                jax_block(prog(x))
            psum_times = [timed(prog, x) for _ in range(args.reps)]
        sched = v.schedule(nelems)
        rows.append(dict(
            algorithm="psum", label=baseline_label(args.primitive), size_bytes=nbytes,
            time_s=median(psum_times), ratio=1.0, psum_time_s=median(psum_times),
            floor_ratio=None, floor_time_s=None, steps=comm.steps, bytes_sent=comm.max_bytes,
            bytes_over_bound=comm.max_bytes / (bound * nbytes),
            model_steps=sched.total_steps, model_bytes=sched.total_bytes,
            mismatch=(comm.steps, comm.max_bytes) != (sched.total_steps, sched.total_bytes),
            correct=True, reps=len(psum_times)))
        rows += size_rows
        del x, prog
    return rows, devices


def fit_link(rows, n, args):
    """(Link, how) from the flags, or fitted to psum's medians (see the module docstring)."""
    import numpy as np

    from dpjax.collectives import cost

    if args.latency_us is not None:
        return (cost.Link(args.latency_us * 1e-6, args.bandwidth_gbps * 1e9),
                "given by --latency-us / --bandwidth-gbps")
    pts = sorted((r["size_bytes"], r["time_s"]) for r in rows if r["algorithm"] == "psum")
    t = np.array([p[1] for p in pts])
    b = np.array([cost.bus_factor(args.primitive, n) * p[0] for p in pts])
    if len(pts) < 2:
        return cost.Link(float(t[0]), float("inf")), f"psum at {fmt_size(pts[0][0])} taken as pure latency"
    # alpha + b * beta = t, least squares on the relative error (each row divided by t),
    # so 4 KiB and 64 MiB weigh alike; alpha is kept >= 0 and beta > 0.
    (alpha, beta), *_ = np.linalg.lstsq(np.stack([1 / t, b / t], axis=1), np.ones_like(t), rcond=None)
    if alpha < 0:
        alpha, beta = 0.0, float(np.sum(b / t) / np.sum((b / t) ** 2))
    beta = max(beta, 1e-15)
    return cost.Link(float(alpha), float(1 / beta)), (
        f"fitted to {baseline_label(args.primitive)}: t = alpha + "
        f"{'2(n-1)/n' if args.primitive == 'allreduce' else '(n-1)/n'} * N / bandwidth, least squares on the relative "
        f"error over {fmt_size(pts[0][0])} .. {fmt_size(pts[-1][0])}")


def finish_rows(rows, n, link, primitive="allreduce"):
    from dpjax.collectives import cost

    for r in rows:
        algbw = r["size_bytes"] / r["time_s"]
        r["algbw_GBps"] = algbw / 1e9
        r["busbw_GBps"] = algbw * cost.bus_factor(primitive, n) / 1e9
        r["model_time_s"] = model_time(r, link)
    return rows


def model_time(r, link):
    from dpjax.collectives import cost

    s = cost.Schedule(r["model_steps"], r["model_bytes"])
    return s.time(link)


# ---------------------------------------------------------------------------------------
# Output


COLUMNS = ("size", "algorithm", "median ms", "x psum", "floor x psum", "busbw GB/s",
           "model ms", "model x psum", "steps", "bytes/bound")


def columns(info) -> list[str]:
    """COLUMNS, with the baseline named: psum, or XLA's all-to-all."""
    return [c.replace("psum", "psum" if info["primitive"] == "allreduce" else "XLA") for c in COLUMNS]


def cells(r, model_psum):
    floor = "" if r["floor_ratio"] is None else f"{r['floor_ratio']:.2f}"
    flag = "" if r["correct"] in (None, True) else " WRONG"
    flag += " MISMATCH" if r["mismatch"] else ""
    return (fmt_size(r["size_bytes"]), r["label"] + flag, f"{r['time_s'] * 1e3:.3f}",
            f"{r['ratio']:.2f}", floor, f"{r['busbw_GBps']:.2f}",
            f"{r['model_time_s'] * 1e3:.3f}", f"{r['model_time_s'] / model_psum:.2f}",
            str(r["steps"]), f"{r['bytes_over_bound']:.2f}")


def model_psum_of(rows):
    return {r["size_bytes"]: r["model_time_s"] for r in rows if r["algorithm"] == "psum"}


def print_table(rows, info):
    mp = model_psum_of(rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is a dependency, but a plain table is fine too
        print(" | ".join(COLUMNS))
        for r in rows:
            print(" | ".join(cells(r, mp[r["size_bytes"]])))
        return
    t = Table(title=f"{info['primitive']} on {info['n']} {info['platform']} devices, float32 "
                    f"(link: alpha {info['alpha_us']:.1f} us, {info['bandwidth_GBps']:.2f} GB/s, "
                    f"{info['link_how']})")
    for c in columns(info):
        t.add_column(c, justify="left" if c in ("size", "algorithm") else "right")
    last = None
    for r in rows:
        if last is not None and r["size_bytes"] != last:
            t.add_section()
        last = r["size_bytes"]
        t.add_row(*cells(r, mp[r["size_bytes"]]))
    Console(width=160).print(t)


def markdown(rows, info, argv) -> str:
    mp = model_psum_of(rows)
    algs = [r["algorithm"] for r in rows if r["size_bytes"] == rows[0]["size_bytes"]]
    labels = {r["algorithm"]: r["label"] for r in rows}
    out = [f"Command: `python experiments/bench_collectives.py {' '.join(argv)}`".rstrip(),
           "",
           f"{info['n']} {info['platform']} devices ({info['machine']}"
           + (f"; {info['processes']} processes joined by jax.distributed" if info["processes"] > 1 else "")
           + f"), jax {info['jax']}, "
           f"float32, median of {info['reps']} interleaved repetitions; link "
           f"alpha = {info['alpha_us']:.1f} us, bandwidth = {info['bandwidth_GBps']:.2f} GB/s "
           f"({info['link_how']}).",
           "",
           f"Time relative to {info['baseline']} (median of back-to-back ratios; lower is better):",
           "",
           "| size | " + " | ".join(labels[a] for a in algs) + " |",
           "|---" * (len(algs) + 1) + "|"]
    for size in sorted({r["size_bytes"] for r in rows}):
        by = {r["algorithm"]: r for r in rows if r["size_bytes"] == size}
        out.append(f"| {fmt_size(size)} | " + " | ".join(
            f"{by[a]['ratio']:.2f}" if a in by else "" for a in algs) + " |")
    out += ["", "All figures:", "",
            "| " + " | ".join(columns(info)) + " |", "|---" * len(COLUMNS) + "|"]
    out += ["| " + " | ".join(cells(r, mp[r["size_bytes"]])) + " |" for r in rows]
    return "\n".join(out) + "\n"


def plot(rows, info, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"not writing {path}: matplotlib is not installed (pip install matplotlib, "
              f"or pip install -e '.[plot]')", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    algs = list(dict.fromkeys(r["algorithm"] for r in rows))
    for a in algs:
        pts = sorted((r["size_bytes"], r["busbw_GBps"], r["label"]) for r in rows if r["algorithm"] == a)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                linewidth=2.5 if a == "psum" else 1.5, color="black" if a == "psum" else None,
                label=pts[0][2])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({r["size_bytes"] for r in rows})
    ax.set_xticks(ticks, [fmt_size(s).replace(" ", "") for s in ticks])
    ax.set_xlabel("message size per device")
    ax.set_ylabel("bus bandwidth (GB/s), nccl-tests definition")
    ax.set_title(f"{info['primitive']}, {info['n']} {info['platform']} devices, float32 "
                 f"(median of {info['reps']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


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
