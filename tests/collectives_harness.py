"""The harness of tests/test_collectives.py (and test_ops, test_adasum, test_alltoall,
test_horovod, test_process_sets): meshes, cases, the one program per (algorithm, mesh),
the references and the tolerances. The tests themselves are in test_collectives.py.

Layout of every check: a global host array of shape (n, *local) is sharded over the
axis, so rank i holds block i (its own, different data); the shard_map body runs the
collective on its block and returns the result with a leading 1, so the global output
(n, *out) holds what every rank ended with. Each (algorithm, mesh) program bundles all
the cases of every primitive the algorithm has (allreduce, reduce_scatter, all_gather,
broadcast; shapes, dtypes, ops, including test_ops.py's other ops) and is compiled
once per session: compiling, not running, is what these tests spend their time on.

Tolerances for sums. Every algorithm here computes each output element as a binary
tree of n-1 additions of the n ranks' values (ring: a chain; butterfly, tree,
hierarchical: other trees; padding adds exact zeros), each addition rounded once in
the input dtype. With u = eps/2 the unit roundoff, the error of any such sum is
bounded by gamma_{n-1} * sum|x_i|, gamma_k = k u / (1 - k u) (Higham, "Accuracy and
Stability of Numerical Algorithms", 2nd ed., eq. 4.4 and section 4.2); "mean"
divides once more, so gamma_n * sum|x_i| / n. The float64 reference sums at most 8
values of at most 24 significant bits: exact unless their exponents differ by more
than ~26, and even then off by ~2^-53 relative, nothing next to the bound (which is
0 for one rank, where the reference is a copy). So the bound is what any correct
implementation must meet (lax.psum is held to it too), and two correct
implementations can differ by at most twice it. All-gather and broadcast only move
data: they must be bit-exact.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax import collectives as C

from conftest import flat_algorithms

DTYPES = {"f32": np.dtype(np.float32), "bf16": np.dtype(jnp.bfloat16), "f16": np.dtype(np.float16),
          "i32": np.dtype(np.int32), "u8": np.dtype(np.uint8), "bool": np.dtype(bool)}


# ---------------------------------------------------------------------------------------
# meshes and cases


@dataclass(frozen=True)
class MeshCase:
    spec: str
    count: int  # devices the mesh uses (the first `count`)
    axis: str | tuple[str, ...]  # the axis (or axes) the collective runs over
    few: bool = False  # run one case only (a flat algorithm over a tuple of axes)

    @property
    def n(self) -> int:
        names, sizes = dpjax.parse_mesh_spec(self.spec, self.count)
        axes = (self.axis,) if isinstance(self.axis, str) else self.axis
        return int(np.prod([sizes[names.index(a)] for a in axes]))

    @property
    def id(self) -> str:
        axis = self.axis if isinstance(self.axis, str) else "+".join(self.axis)
        return f"{self.spec.replace(',', '_').replace('=', '')}-over-{axis}"


# Axis sizes 1..8 over a subset of the devices, then flat algorithms over a tuple of
# axes (flattened, outer axis first; see test_flat_over_axes_out_of_mesh_order).
FLAT_MESHES = [MeshCase(f"data={n}", n, "data") for n in range(1, 9)] + [
    MeshCase("node=2,data=4", 8, ("node", "data"), few=True),
    MeshCase("node=3,data=2", 6, ("node", "data"), few=True),
]
HIER_MESHES = [
    MeshCase("node=2,data=4", 8, ("node", "data")),
    MeshCase("node=4,data=2", 8, ("node", "data")),
    MeshCase("node=1,data=8", 8, ("node", "data")),
    MeshCase("node=8,data=1", 8, ("node", "data")),
    MeshCase("node=2,data=3", 6, ("node", "data")),
    MeshCase("node=3,data=2", 6, ("node", "data")),
    MeshCase("node=1,data=1", 1, ("node", "data")),
]
# "hierarchical" over one axis: its one-level case (the inner ring alone).
HIER_ONE_AXIS = [MeshCase(f"data={n}", n, "data") for n in (1, 3, 4, 8)]


@dataclass(frozen=True)
class Case:
    """One input: its per-rank shape, dtype, op, (broadcast) root and scale factors."""

    shape: tuple[int, ...]
    dtype: str = "f32"
    op: str = "sum"
    per_rank: bool = False  # reduce_scatter: dim 0 is shape[0] * n
    root: int | None = None
    pre: float = 1.0  # prescale_factor
    post: float = 1.0  # postscale_factor

    def local_shape(self, n: int) -> tuple[int, ...]:
        if self.per_rank:
            return (self.shape[0] * n, *self.shape[1:])
        return self.shape

    @property
    def id(self) -> str:
        dims = "x".join(map(str, self.shape)) or "scalar"
        out = f"{self.dtype}-{'nx' if self.per_rank else ''}{dims}"
        out += f"-{self.op}" if self.op != "sum" else ""
        out += f"-pre{self.pre:g}-post{self.post:g}" if (self.pre, self.post) != (1, 1) else ""
        return out + (f"-root{self.root}" if self.root is not None else "")


# Compiling is what costs time here (every ppermute step is unrolled), so rather than
# the full product of axis sizes x shapes x dtypes x ops, each (algorithm, axis size)
# runs a float32 scalar, a float32 multi-dimensional mean and one low-precision case
# that cycles with n through (bf16, mean), (f16, sum), (bf16, sum), (f16, mean): every
# algorithm meets every (dtype, op) pair, and the odd element counts (1, 35, 37, 5, 3)
# are padded at every n > 1.
def _low_precision(n: int, bf16_shape, f16_shape, per_rank=False) -> Case:
    dtype, op = [("bf16", "mean"), ("f16", "sum"), ("bf16", "sum"), ("f16", "mean")][(n - 1) % 4]
    return Case(bf16_shape if dtype == "bf16" else f16_shape, dtype, op, per_rank)


def allreduce_cases(n: int) -> list[Case]:
    return [Case(()), Case((2, 3, 4), "f32", "mean"), _low_precision(n, (5, 7), (37,))]


def reduce_scatter_cases(n: int) -> list[Case]:
    return [Case((1,), per_rank=True), Case((2, 3), "f32", "mean", per_rank=True),
            _low_precision(n, (5,), (1, 2, 2), per_rank=True)]


def all_gather_cases(n: int) -> list[Case]:
    return [Case((1,)), Case((2, 3)), _low_precision(n, (4,), (3,))]


def broadcast_cases(n: int) -> list[Case]:
    # four roots (fewer when n < 4), each with another shape and dtype
    return [Case((3, 5), root=0), Case((), root=n - 1), Case((5,), "bf16", root=n // 2),
            Case((7,), "f16", root=1 % n)]


def one_case(n: int) -> list[Case]:
    return [Case((7,))]


# The other ops (test_ops.py), in the same programs: a catalogue of cases that are not
# already above (every op on float32, int32, uint8, bfloat16 and float16 but the float
# sums and means, the bool ops, scaled sums and means), dealt out over the axis sizes:
# the program of (algorithm, k-th mesh) takes 3 allreduce and 2 reduce_scatter cases,
# so over the 8 sizes every algorithm runs every case of the catalogue once (at a size
# that depends on the algorithm) while each program stays small.
def _catalogue(per_rank: bool) -> list[Case]:
    dtypes = ("f32", "i32", "u8", "f16") if per_rank else ("f32", "i32", "u8", "bf16", "f16")
    shape = (2, 3) if per_rank else (5, 3)
    out = [Case(shape, d, op, per_rank) for d in dtypes for op in ("min", "max", "product")]
    out += [Case((9,), "i32", op, per_rank) for op in ("sum", "mean")]
    out += [Case((7,), "u8", op, per_rank) for op in (() if per_rank else ("sum", "mean"))]
    out += [Case((3,), "bool", op, per_rank) for op in (("max",) if per_rank else ("min", "max", "product"))]
    out += [Case((3,), "f32", "sum", per_rank, pre=0.5, post=4.0)]
    out += [] if per_rank else [Case((2, 2), "i32", "mean", per_rank, pre=3.0, post=2.0)]
    return out


OP_CATALOGUE = {"allreduce": (_catalogue(False), 3), "reduce_scatter": (_catalogue(True), 2)}
assert [len(c) for c, _ in OP_CATALOGUE.values()] == [24, 16]  # 8 sizes x (3, 2) cases


def op_cases(primitive: str, slot: int) -> list[Case]:
    """The catalogue's cases for the program in `slot` (k-th mesh, shifted per algorithm)."""
    catalogue, per_program = OP_CATALOGUE[primitive]
    return [catalogue[(slot * per_program + i) % len(catalogue)] for i in range(per_program)]


def mesh_cases(mc: MeshCase, cases_fn) -> list[Case]:
    # a flat algorithm over a tuple of axes only has to show the flattening is right
    return cases_fn(mc.n)[1:2] if mc.few else cases_fn(mc.n)


def params(meshes, cases_fn):
    return [pytest.param(mc, case, id=f"{mc.id}-{case.id}")
            for mc in meshes for case in mesh_cases(mc, cases_fn)]


def make_input(n: int, case: Case, salt: str) -> np.ndarray:
    """(n, *local) values, different on every rank; deterministic per (n, case, salt).

    Integers are small (their sums and products stay far from overflow); bools mostly
    True (so "all" is sometimes True and "any" sometimes False); a float product's
    factors are +-[0.5, 2], so that no product of 8 underflows (float16's normal range
    ends at 6e-5, below which the relative rounding bound does not hold)."""
    rng = np.random.default_rng(zlib.crc32(f"{n}/{case.id}/{salt}".encode()))
    shape, dtype = (n, *case.local_shape(n)), DTYPES[case.dtype]
    if case.dtype == "bool":
        return rng.random(shape) < 0.7
    if case.dtype in ("i32", "u8"):
        return rng.integers(-6 if case.dtype == "i32" else 0, 7, shape).astype(dtype)
    if case.op == "product":
        return (rng.choice([-1, 1], shape) * rng.uniform(0.5, 2, shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------------------------------
# one program per (algorithm variant, mesh)


def run_bundle(mesh, axis, bodies: dict, inputs: dict) -> dict:
    """One jitted shard_map applying bodies[k] to rank-local inputs[k]; every rank's output."""
    names = list(bodies)
    spec = P(axis)

    def program(*blocks):
        outs = []
        for k, b in zip(names, blocks):
            assert b.shape == (1, *inputs[k].shape[1:]), (k, b.shape)  # one block per rank
            outs.append(bodies[k](b[0])[None])
        return tuple(outs)

    fn = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=(spec,) * len(names),
                               out_specs=(spec,) * len(names)))
    placed = [jax.device_put(inputs[k], jax.sharding.NamedSharding(mesh, spec)) for k in names]
    return {k: np.asarray(o) for k, o in zip(names, fn(*placed))}


# The primitives each algorithm has ("lax": the lax twins of the float cases).
BASE_CASES = {"allreduce": allreduce_cases, "reduce_scatter": reduce_scatter_cases,
              "all_gather": all_gather_cases, "broadcast": broadcast_cases}


def primitives(algorithm: str) -> tuple[str, ...]:
    """The primitives of BASE_CASES an algorithm implements, read from its registration
    (a new algorithm needs no entry here); "lax" is the lax twins' own variant."""
    if algorithm == "lax":
        return ("allreduce", "reduce_scatter", "all_gather")
    return tuple(p for p in BASE_CASES if C.registry.get(algorithm).implements(p))


def body_of(algorithm: str, opts: dict, primitive: str, axis, n: int, case: Case):
    """The shard_map body of one case: local block -> what this rank ends with."""

    def body(x):
        assert x.shape == case.local_shape(n), (x.shape, case)  # the local shape
        if algorithm == "lax":
            if primitive == "allreduce":
                return (lax.pmean if case.op == "mean" else lax.psum)(x, axis)
            if primitive == "reduce_scatter":
                out = lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
                return (out / (n if case.op == "mean" else 1)).astype(x.dtype)
            return lax.all_gather(x, axis, axis=0, tiled=True)
        if primitive in ("allreduce", "reduce_scatter"):
            fn = C.allreduce if primitive == "allreduce" else C.reduce_scatter
            kw = opts if primitive == "allreduce" else {}
            return fn(x, axis, algorithm=algorithm, op=case.op, prescale_factor=case.pre,
                      postscale_factor=case.post, **kw)
        if primitive == "all_gather":
            return C.all_gather(x, axis, algorithm=algorithm)
        return C.broadcast(x, axis, root=case.root, algorithm=algorithm)

    return body


def program(cache, mesh_of, mc: MeshCase, variant, cases_fn=None):
    """(inputs, outputs) of every case of every primitive of `variant` on `mc`, compiled
    once per session; both dicts keyed "primitive/case id", values (n, ...) per rank.

    cases_fn: a special family of allreduce cases only (else every primitive's base
    cases, and the other ops' cases for the variants test_ops.py reads)."""
    name, algorithm, options = variant

    def build():
        table = {"allreduce": cases_fn} if cases_fn else BASE_CASES
        bodies, inputs = {}, {}
        for primitive in primitives(algorithm):
            cases = list(mesh_cases(mc, table[primitive])) if primitive in table else []
            if not cases_fn and primitive in OP_CATALOGUE and (name, mc) in OP_SLOTS:
                cases += [c for c in op_cases(primitive, OP_SLOTS[name, mc]) if op_supported(algorithm, primitive, c)]
            for c in cases:
                key = f"{primitive}/{c.id}"
                inputs[key] = make_input(mc.n, c, primitive)
                bodies[key] = body_of(algorithm, options(mc.n), primitive, mc.axis, mc.n, c)
        return inputs, run_bundle(mesh_of(mc.spec, mc.count), mc.axis, bodies, inputs)

    return cache.get(("program", name, mc, getattr(cases_fn, "__name__", None)), build)


# The programs that also hold the other ops, and their slot in the catalogue: every
# variant on its meshes, shifted by 5 slots per variant (the ps variants differ only in
# their server count: one of them is enough).
OP_MESHES = {"psum": FLAT_MESHES[:8], "ring": FLAT_MESHES[:8], "butterfly": FLAT_MESHES[:8],
             "tree": FLAT_MESHES[:8], "ps-Smid": FLAT_MESHES[:8], "hierarchical": HIER_MESHES + HIER_ONE_AXIS}
OP_SLOTS = {(name, mc): 5 * v + k for v, (name, meshes) in enumerate(OP_MESHES.items())
            for k, mc in enumerate(meshes)}


def op_supported(algorithm: str, primitive: str, case: Case) -> bool:
    """The XLA baseline reduces with psum / pmin / pmax (allreduce) and psum_scatter."""
    if algorithm != "psum":
        return True
    return case.op in (("sum", "mean") if primitive == "reduce_scatter" else ("sum", "mean", "min", "max"))


LAX = ("lax", "lax", lambda n: {})


# ---------------------------------------------------------------------------------------
# references and tolerances


def sum_bound(x_nd: np.ndarray, dtype: np.dtype, op: str) -> np.ndarray:
    """Worst-case rounding error of the sum (or mean) over axis 0, elementwise (see top)."""
    n = x_nd.shape[0]
    u = float(ml_dtypes.finfo(dtype).eps) / 2
    k = n - 1 + (op == "mean")
    gamma = k * u / (1 - k * u)
    abs_sum = np.abs(x_nd.astype(np.float64)).sum(0)
    return gamma * abs_sum / (n if op == "mean" else 1)


def assert_close_to_sum(got, want64, bound, dtype, what):
    """got (of `dtype`) within `bound` of the float64 `want64`, elementwise."""
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, want {dtype}"
    assert got.shape == want64.shape, f"{what}: shape {got.shape}, want {want64.shape}"
    err = np.abs(got.astype(np.float64) - want64)
    worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else ()
    assert np.all(err <= bound), (
        f"{what}: |got - exact| = {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst} "
        f"(got {got[worst]}, exact {want64[worst]})"
    )


def reduce_ref(x, op):
    s = x.astype(np.float64).sum(0)
    return s / x.shape[0] if op == "mean" else s


def lax_twin(cache, mesh_of, mc, primitive, case, cases_fn=None) -> np.ndarray:
    """The same input through lax.psum / pmean / psum_scatter / all_gather."""
    return program(cache, mesh_of, mc, LAX, cases_fn)[1][f"{primitive}/{case.id}"]


def check_sum(got, x, want, bound, twin, dtype, what):
    """Against float64 within the bound, and against the lax twin within twice it."""
    assert_close_to_sum(got, want, bound, dtype, f"{what} vs float64")
    assert_close_to_sum(twin, want, bound, dtype, f"lax twin of {what} vs float64")
    assert_close_to_sum(got, twin.astype(np.float64), 2 * bound, dtype, f"{what} vs lax twin")


# ---------------------------------------------------------------------------------------
# allreduce


def flat_variants():
    """(id, algorithm, options(n)) for every flat allreduce algorithm."""
    out = []
    for alg in flat_algorithms(C.ALGORITHMS):
        if alg == "ps":  # one server, a middle number, every rank a server
            out += [("ps-S1", alg, lambda n: {"num_servers": 1}),
                    ("ps-Smid", alg, lambda n: {"num_servers": (n + 1) // 2}),
                    ("ps-Sn", alg, lambda n: {"num_servers": n})]
        else:
            out.append((alg, alg, lambda n: {}))
    return out


FLAT_VARIANTS = flat_variants()
HIERARCHICAL = ("hierarchical", "hierarchical", lambda n: {})
