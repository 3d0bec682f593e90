"""Every collective algorithm against lax.psum / psum_scatter / all_gather and float64 numpy.

Layout of every check: a global host array of shape (n, *local) is sharded over the
axis, so rank i holds block i (its own, different data); the shard_map body runs the
collective on its block and returns the result with a leading 1, so the global output
(n, *out) holds what every rank ended with. Each (primitive, algorithm, mesh) program
bundles all its cases (shapes, dtypes, ops) and is compiled once per session.

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

DTYPES = {"f32": np.dtype(np.float32), "bf16": np.dtype(jnp.bfloat16), "f16": np.dtype(np.float16)}


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


@dataclass(frozen=True)
class Case:
    """One input: its per-rank shape, dtype, op, and (broadcast) root."""

    shape: tuple[int, ...]
    dtype: str = "f32"
    op: str = "sum"
    per_rank: bool = False  # reduce_scatter: dim 0 is shape[0] * n
    root: int | None = None

    def local_shape(self, n: int) -> tuple[int, ...]:
        if self.per_rank:
            return (self.shape[0] * n, *self.shape[1:])
        return self.shape

    @property
    def id(self) -> str:
        dims = "x".join(map(str, self.shape)) or "scalar"
        out = f"{self.dtype}-{'nx' if self.per_rank else ''}{dims}"
        out += "-mean" if self.op == "mean" else ""
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


def mesh_cases(mc: MeshCase, cases_fn) -> list[Case]:
    # a flat algorithm over a tuple of axes only has to show the flattening is right
    return cases_fn(mc.n)[1:2] if mc.few else cases_fn(mc.n)


def params(meshes, cases_fn):
    return [pytest.param(mc, case, id=f"{mc.id}-{case.id}")
            for mc in meshes for case in mesh_cases(mc, cases_fn)]


def make_input(n: int, case: Case, salt: str) -> np.ndarray:
    """(n, *local) values, different on every rank; deterministic per (n, case, salt)."""
    rng = np.random.default_rng(zlib.crc32(f"{n}/{case.id}/{salt}".encode()))
    return rng.standard_normal((n, *case.local_shape(n))).astype(DTYPES[case.dtype])


# ---------------------------------------------------------------------------------------
# running a bundle of collectives in one program


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


def bundle(cache, mesh_of, mc: MeshCase, primitive: str, cases, body_for, tag):
    """Runs body_for(case) on every case in one compiled program, once per session.

    Returns (inputs, outputs), dicts keyed by case id, of shape (n, ...): rank i's
    input and what rank i ended with.
    """

    def build():
        mesh = mesh_of(mc.spec, mc.count)
        inputs = {c.id: make_input(mc.n, c, primitive) for c in cases}
        return inputs, run_bundle(mesh, mc.axis, {c.id: body_for(c) for c in cases}, inputs)

    return cache.get((primitive, mc, tag, tuple(c.id for c in cases)), build)


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


def lax_twin(cache, mesh_of, mc, primitive, cases) -> dict:
    """The same inputs through lax.psum / pmean / psum_scatter / all_gather."""

    def body_for(case):
        if primitive == "allreduce":
            return lambda x: (lax.pmean if case.op == "mean" else lax.psum)(x, mc.axis)
        if primitive == "reduce_scatter":
            return lambda x: (lax.psum_scatter(x, mc.axis, scatter_dimension=0, tiled=True)
                              / (mc.n if case.op == "mean" else 1)).astype(x.dtype)
        return lambda x: lax.all_gather(x, mc.axis, axis=0, tiled=True)

    return bundle(cache, mesh_of, mc, primitive, cases, body_for, "lax")[1]


def check_sum(got, x, want, bound, twin, dtype, what):
    """Against float64 within the bound, and against the lax twin within twice it."""
    assert_close_to_sum(got, want, bound, dtype, f"{what} vs float64")
    assert_close_to_sum(twin, want, bound, dtype, f"lax twin of {what} vs float64")
    assert_close_to_sum(got, twin.astype(np.float64), 2 * bound, dtype, f"{what} vs lax twin")


# ---------------------------------------------------------------------------------------
# allreduce


def flat_variants():
    """(id, algorithm, options(n)) for every non-hierarchical allreduce algorithm."""
    out = []
    for alg in C.ALGORITHMS:
        if alg == "hierarchical":
            continue
        if alg == "ps":  # one server, a middle number, every rank a server
            out += [("ps-S1", alg, lambda n: {"num_servers": 1}),
                    ("ps-Smid", alg, lambda n: {"num_servers": (n + 1) // 2}),
                    ("ps-Sn", alg, lambda n: {"num_servers": n})]
        else:
            out.append((alg, alg, lambda n: {}))
    return out


FLAT_VARIANTS = flat_variants()
HIERARCHICAL = ("hierarchical", "hierarchical", lambda n: {})


def check_allreduce(cache, mesh_of, mc, variant, case, cases_fn=allreduce_cases, twin=True):
    name, algorithm, options = variant
    opts = options(mc.n)
    cases = mesh_cases(mc, cases_fn)

    def body_for(c):
        def body(x):
            assert x.shape == c.shape  # the local shape, inside the shard_map body
            return C.allreduce(x, mc.axis, algorithm=algorithm, op=c.op, **opts)

        return body

    inputs, outputs = bundle(cache, mesh_of, mc, "allreduce", cases, body_for,
                             (algorithm, tuple(sorted(opts.items()))))
    dtype, x = DTYPES[case.dtype], inputs[case.id]
    want = np.broadcast_to(reduce_ref(x, case.op), x.shape)
    bound = np.broadcast_to(sum_bound(x, dtype, case.op), x.shape)
    what = f"{name} n={mc.n} {case.id}"
    if not twin:
        assert_close_to_sum(outputs[case.id], want, bound, dtype, f"{what} vs float64")
        return
    twin = lax_twin(cache, mesh_of, mc, "allreduce", cases)[case.id]
    check_sum(outputs[case.id], x, want, bound, twin, dtype, what)


@pytest.mark.parametrize("mc, case", params(FLAT_MESHES, allreduce_cases))
@pytest.mark.parametrize("variant", FLAT_VARIANTS, ids=lambda v: v[0])
def test_allreduce(cache, mesh_of, variant, mc, case):
    check_allreduce(cache, mesh_of, mc, variant, case)


@pytest.mark.parametrize("mc, case", params(HIER_MESHES, allreduce_cases))
def test_hierarchical_allreduce(cache, mesh_of, mc, case):
    check_allreduce(cache, mesh_of, mc, HIERARCHICAL, case)


def outer_cases(n):
    return [Case((7,)), Case((3, 5), "bf16", "mean")]


@pytest.mark.parametrize("mc, case", params(HIER_MESHES[1:2], outer_cases))
@pytest.mark.parametrize("outer", [a for a in C.ALGORITHMS if a not in ("ring", "hierarchical")])
def test_hierarchical_outer_algorithm(cache, mesh_of, outer, mc, case):
    variant = (f"hierarchical/{outer}", "hierarchical", lambda n: {"outer_algorithm": outer})
    check_allreduce(cache, mesh_of, mc, variant, case, outer_cases)


def big_case(n):  # the large odd size: every chunk boundary is ragged
    return [Case((1000003,))]


@pytest.mark.parametrize("mc, case", params([FLAT_MESHES[2], FLAT_MESHES[7]], big_case))
@pytest.mark.parametrize("variant", [v for v in FLAT_VARIANTS if v[0] in ("ring", "butterfly")],
                         ids=lambda v: v[0])
def test_allreduce_large_odd_size(cache, mesh_of, variant, mc, case):
    check_allreduce(cache, mesh_of, mc, variant, case, big_case, twin=False)


# A tuple of axes in another order than the mesh's, e.g. ("data", "node") on a
# node x data mesh. This JAX's ppermute numbers the ranks of a tuple of axes in mesh
# order whatever order the tuple gives, while lax.axis_index follows the tuple; a sum
# does not depend on the order, so allreduce puts the tuple in mesh order itself.
@pytest.mark.parametrize("mc, case", params([MeshCase("node=2,data=4", 8, ("data", "node"))],
                                            one_case))
@pytest.mark.parametrize("variant", FLAT_VARIANTS, ids=lambda v: v[0])
def test_flat_over_axes_out_of_mesh_order(cache, mesh_of, variant, mc, case):
    check_allreduce(cache, mesh_of, mc, variant, case, one_case)


# ---------------------------------------------------------------------------------------
# gradients


def grad_of(mesh, axis, reduce, op):
    """x -> d/dx sum(w * y * y), y = reduce(x) on every rank: the cotangent 2 w y differs
    per rank and per element, so a transpose that routes it wrongly shows."""

    def loss(x, w):
        y = jax.shard_map(lambda b: reduce(b[0], axis, op)[None], mesh=mesh,
                          in_specs=P(axis), out_specs=P(axis))(x)
        return jnp.sum(w * y * y)

    return jax.jit(jax.grad(loss))


GRAD_CASES = [
    *((v, FLAT_MESHES[n - 1], op) for v in FLAT_VARIANTS for n, op in
      [(5, "sum"), (8, "mean")]),
    *((HIERARCHICAL, HIER_MESHES[i], op) for i in (0, 5) for op in ("sum", "mean")),
]


@pytest.mark.parametrize("variant, mc, op", GRAD_CASES,
                         ids=[f"{v[0]}-{mc.id}-{op}" for v, mc, op in GRAD_CASES])
def test_allreduce_gradient_matches_psum(cache, mesh_of, variant, mc, op):
    name, algorithm, options = variant
    mesh, n = mesh_of(mc.spec, mc.count), mc.n
    opts = options(n)
    # Small integers: with op="sum" every value the forward and backward passes make
    # is an integer below 2^24, so every order of summation is exact in float32 and
    # the gradients must agree bit for bit.
    rng = np.random.default_rng(n)
    x = rng.integers(-8, 9, (n, 6)).astype(np.float32)
    w = rng.integers(-4, 5, (n, 6)).astype(np.float32)
    sharding = jax.sharding.NamedSharding(mesh, P(mc.axis))
    xs, ws = jax.device_put(x, sharding), jax.device_put(w, sharding)

    def ours(b, axis, op):
        return C.allreduce(b, axis, algorithm=algorithm, op=op, **opts)

    def twin(b, axis, op):
        return (lax.pmean if op == "mean" else lax.psum)(b, axis)

    got = np.asarray(grad_of(mesh, mc.axis, ours, op)(xs, ws))
    want = cache.get(("grad-twin", mc, op),
                     lambda: np.asarray(grad_of(mesh, mc.axis, twin, op)(xs, ws)))
    # By hand: y = s (or s/n) on every rank, s = sum_r x_r; dL/dx_r = sum_r' 2 w_r' y (/n).
    y = reduce_ref(x, op)
    exact = np.broadcast_to(reduce_ref(2 * w * y, op), x.shape)
    if op == "sum":
        bound = np.zeros(x.shape)
    else:
        # Along any path: y = s/n rounded (1), w*y rounded (1; doubling is exact), the
        # 1/n of the transpose (1) and n-1 additions: gamma_{n+2} * sum_r |2 w_r y| / n.
        u = float(np.finfo(np.float32).eps) / 2
        gamma = (n + 2) * u / (1 - (n + 2) * u)
        bound = np.broadcast_to(gamma * np.abs(2 * w * y).sum(0) / n, x.shape)
    check_sum(got, x, exact, bound, want, np.dtype(np.float32), f"{name} gradient")


# ---------------------------------------------------------------------------------------
# reduce_scatter


def check_reduce_scatter(cache, mesh_of, mc, algorithm, case):
    n, cases = mc.n, mesh_cases(mc, reduce_scatter_cases)

    def body_for(c):
        def body(x):
            assert x.shape == c.local_shape(n)
            return C.reduce_scatter(x, mc.axis, algorithm=algorithm, op=c.op)

        return body

    inputs, outputs = bundle(cache, mesh_of, mc, "reduce_scatter", cases, body_for, algorithm)
    dtype, x = DTYPES[case.dtype], inputs[case.id]  # x: (n ranks, n * m, ...)
    # rank r ends with rows r*m:(r+1)*m of the sum over ranks
    want = reduce_ref(x, case.op).reshape(n, *case.shape)
    bound = sum_bound(x, dtype, case.op).reshape(want.shape)
    twin = lax_twin(cache, mesh_of, mc, "reduce_scatter", cases)[case.id]
    check_sum(outputs[case.id], x, want, bound, twin, dtype,
              f"{algorithm} reduce_scatter n={n} {case.id}")


@pytest.mark.parametrize("mc, case", params(FLAT_MESHES, reduce_scatter_cases))
@pytest.mark.parametrize("algorithm", [a for a in C.REDUCE_SCATTER_ALGORITHMS
                                       if a != "hierarchical"])
def test_reduce_scatter(cache, mesh_of, algorithm, mc, case):
    check_reduce_scatter(cache, mesh_of, mc, algorithm, case)


@pytest.mark.parametrize("mc, case", params(HIER_MESHES, reduce_scatter_cases))
def test_hierarchical_reduce_scatter(cache, mesh_of, mc, case):
    check_reduce_scatter(cache, mesh_of, mc, "hierarchical", case)


# ---------------------------------------------------------------------------------------
# all_gather and broadcast: data movement only, so bit-exact


def check_all_gather(cache, mesh_of, mc, algorithm, case, cases_fn=all_gather_cases):
    n, cases = mc.n, mesh_cases(mc, cases_fn)

    def body_for(c):
        def body(x):
            assert x.shape == c.shape
            return C.all_gather(x, mc.axis, algorithm=algorithm)

        return body

    inputs, outputs = bundle(cache, mesh_of, mc, "all_gather", cases, body_for, algorithm)
    x, got = inputs[case.id], outputs[case.id]
    # every rank ends with all blocks in rank order (a scalar gathers to shape (n,))
    gathered = x.reshape(-1, *x.shape[2:])
    want = np.broadcast_to(gathered, (n, *gathered.shape))
    assert got.dtype == x.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    assert np.array_equal(got, want), f"{algorithm} all_gather n={n} {case.id} differs from numpy"
    if case.shape:  # lax.all_gather(tiled=True) takes no scalars
        twin = lax_twin(cache, mesh_of, mc, "all_gather", cases)[case.id]
        assert np.array_equal(got, twin), f"{algorithm} all_gather differs from lax.all_gather"


@pytest.mark.parametrize("mc, case", params(FLAT_MESHES, all_gather_cases))
@pytest.mark.parametrize("algorithm", [a for a in C.ALL_GATHER_ALGORITHMS
                                       if a != "hierarchical"])
def test_all_gather(cache, mesh_of, algorithm, mc, case):
    check_all_gather(cache, mesh_of, mc, algorithm, case)


@pytest.mark.parametrize("mc, case", params(HIER_MESHES, all_gather_cases))
def test_hierarchical_all_gather(cache, mesh_of, mc, case):
    check_all_gather(cache, mesh_of, mc, "hierarchical", case)


# all_gather is tiled on dimension 0, so a scalar has nothing to tile: every algorithm
# refuses it with the same ValueError (lax.all_gather(tiled=True) refuses it too).
SCALAR_GATHER = [
    pytest.param(alg, mc, id=f"{alg}-{mc.id}")
    for alg, meshes in [(a, FLAT_MESHES[:3]) for a in C.ALL_GATHER_ALGORITHMS
                        if a != "hierarchical"] + [("hierarchical", HIER_MESHES[-2:])]
    for mc in meshes
]


@pytest.mark.parametrize("algorithm, mc", SCALAR_GATHER)
def test_all_gather_scalar_is_refused(mesh_of, algorithm, mc):
    mesh = mesh_of(mc.spec, mc.count)
    with pytest.raises(ValueError, match="scalar"):
        jax.eval_shape(jax.shard_map(lambda b: C.all_gather(b[0], mc.axis, algorithm=algorithm)[None],
                                     mesh=mesh, in_specs=P(mc.axis), out_specs=P(mc.axis)),
                       jax.ShapeDtypeStruct((mc.n,), jnp.float32))


@pytest.mark.parametrize("mc, case", params(FLAT_MESHES, broadcast_cases))
@pytest.mark.parametrize("algorithm", C.BROADCAST_ALGORITHMS)
def test_broadcast(cache, mesh_of, algorithm, mc, case):
    cases = mesh_cases(mc, broadcast_cases)

    def body_for(c):
        return lambda x: C.broadcast(x, mc.axis, root=c.root, algorithm=algorithm)

    inputs, outputs = bundle(cache, mesh_of, mc, "broadcast", cases, body_for, algorithm)
    x, got = inputs[case.id], outputs[case.id]
    assert got.dtype == x.dtype
    assert np.array_equal(got, np.broadcast_to(x[case.root], x.shape)), (
        f"{algorithm} broadcast n={mc.n} {case.id}")


# ---------------------------------------------------------------------------------------
# errors a user can cause (trace time only: nothing is compiled)


def trace(mesh, body, local_shape=(8,), axis="data"):
    n = int(np.prod([mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis)]))
    fn = jax.shard_map(lambda b: body(b[0])[None], mesh=mesh, in_specs=P(axis),
                       out_specs=P(axis))
    return jax.eval_shape(fn, jax.ShapeDtypeStruct((n, *local_shape), jnp.float32))


@pytest.fixture(scope="module")
def mesh4(mesh_of):
    return mesh_of("data=4", 4)


@pytest.fixture(scope="module")
def mesh2x2(mesh_of):
    return mesh_of("node=2,data=2", 4)


@pytest.mark.parametrize(
    "call, choices",
    [
        (lambda x: C.allreduce(x, "data", algorithm="nccl"), C.ALGORITHMS),
        (lambda x: C.reduce_scatter(x, "data", algorithm="nccl"), C.REDUCE_SCATTER_ALGORITHMS),
        (lambda x: C.all_gather(x, "data", algorithm="nccl"), C.ALL_GATHER_ALGORITHMS),
        (lambda x: C.broadcast(x, "data", algorithm="nccl"), C.BROADCAST_ALGORITHMS),
        (lambda x: C.reduce_scatter(x, "data", algorithm="tree"), C.REDUCE_SCATTER_ALGORITHMS),
        (lambda x: C.broadcast(x, "data", algorithm="butterfly"), C.BROADCAST_ALGORITHMS),
    ],
    ids=["allreduce", "reduce_scatter", "all_gather", "broadcast", "rs-tree", "bcast-butterfly"],
)
def test_unknown_algorithm_names_the_choices(mesh4, call, choices):
    with pytest.raises(ValueError) as info:
        trace(mesh4, call)
    msg = str(info.value)
    assert "nccl" in msg or "tree" in msg or "butterfly" in msg
    for name in choices:
        assert name in msg, f"{name!r} missing from: {msg}"


INDIVISIBLE = [
    pytest.param(alg, shape, id=f"{alg}-{'x'.join(map(str, shape)) or 'scalar'}")
    for alg in C.REDUCE_SCATTER_ALGORITHMS if alg != "hierarchical"
    for shape in [(6,), (3, 2), ()]
]


@pytest.mark.parametrize("algorithm, local_shape", INDIVISIBLE)
def test_reduce_scatter_indivisible_dim0(mesh4, algorithm, local_shape):
    with pytest.raises(ValueError, match="divisible|divide"):
        trace(mesh4, lambda x: C.reduce_scatter(x, "data", algorithm=algorithm), local_shape)


def test_hierarchical_reduce_scatter_indivisible_dim0(mesh2x2):
    with pytest.raises(ValueError, match="divisible"):
        trace(mesh2x2, lambda x: C.reduce_scatter(x, ("node", "data"), algorithm="hierarchical"),
              (6,), ("node", "data"))


@pytest.mark.parametrize("root", [-1, 4, 7])
@pytest.mark.parametrize("algorithm", C.BROADCAST_ALGORITHMS)
def test_broadcast_bad_root(mesh4, algorithm, root):
    with pytest.raises(ValueError, match=rf"root {root}\b.*\b4\b"):
        trace(mesh4, lambda x: C.broadcast(x, "data", root=root, algorithm=algorithm))


@pytest.mark.parametrize("algorithm", C.BROADCAST_ALGORITHMS)
def test_broadcast_bad_root_on_one_rank(mesh_of, algorithm):
    with pytest.raises(ValueError, match="root 1"):
        trace(mesh_of("data=1", 1), lambda x: C.broadcast(x, "data", root=1, algorithm=algorithm))


@pytest.mark.parametrize("op", ["max", "avg", "SUM"])
@pytest.mark.parametrize("algorithm", C.ALGORITHMS)
def test_allreduce_bad_op(mesh2x2, algorithm, op):
    axis = ("node", "data") if algorithm == "hierarchical" else "data"
    with pytest.raises(ValueError, match=f"{op!r}"):
        trace(mesh2x2, lambda x: C.allreduce(x, axis, algorithm=algorithm, op=op), (8,), axis)


@pytest.mark.parametrize("algorithm", C.REDUCE_SCATTER_ALGORITHMS)
def test_reduce_scatter_bad_op(mesh2x2, algorithm):
    axis = ("node", "data") if algorithm == "hierarchical" else "data"
    with pytest.raises(ValueError, match="'max'"):
        trace(mesh2x2, lambda x: C.reduce_scatter(x, axis, algorithm=algorithm, op="max"),
              (8,), axis)


@pytest.mark.parametrize("servers", [0, 5, -1])
def test_ps_bad_num_servers(mesh4, servers):
    with pytest.raises(ValueError, match=f"num_servers={servers}"):
        trace(mesh4, lambda x: C.allreduce(x, "data", algorithm="ps", num_servers=servers))


@pytest.mark.parametrize("primitive", [C.allreduce, C.reduce_scatter, C.all_gather])
@pytest.mark.parametrize("axis", ["data", ("node", "data", "data")], ids=["one", "three"])
def test_hierarchical_needs_two_axes(mesh2x2, primitive, axis):
    with pytest.raises(ValueError, match=r"\(outer, inner\)"):
        trace(mesh2x2, lambda x: primitive(x, axis, algorithm="hierarchical"))
