"""bench_collectives.py's programs and its timed run: `Variant` (one algorithm on its
mesh, compiled inside `jit(shard_map(...))`), the communication floor (`permute_skeleton`
read from the compiled HLO, `compile_floor`), and `run`, which checks, counts and times
every algorithm interleaved with the baseline (see bench_collectives.py's docstring).
"""

from __future__ import annotations

import math
import re
import time

import _bench
from _bench import median
from _collectives_report import baseline_label, fmt_size


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
