"""Every collective algorithm against lax.psum / psum_scatter / all_gather and float64 numpy.

The meshes, cases, programs and tolerances (why each bound is what any correct
implementation must meet) are in collectives_harness.py; here, the tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax import collectives as C

from collectives_harness import (DTYPES, FLAT_MESHES, FLAT_VARIANTS, HIER_MESHES, HIER_ONE_AXIS,
                                 HIERARCHICAL, Case, MeshCase, allreduce_cases, all_gather_cases,
                                 assert_close_to_sum, broadcast_cases, check_sum, lax_twin, one_case, params,
                                 program, reduce_ref, reduce_scatter_cases, sum_bound)
from conftest import flat_algorithms




def check_allreduce(cache, mesh_of, mc, variant, case, cases_fn=None, twin=True):
    inputs, outputs = program(cache, mesh_of, mc, variant, cases_fn)
    key = f"allreduce/{case.id}"
    dtype, x = DTYPES[case.dtype], inputs[key]
    want = np.broadcast_to(reduce_ref(x, case.op), x.shape)
    bound = np.broadcast_to(sum_bound(x, dtype, case.op), x.shape)
    what = f"{variant[0]} n={mc.n} {case.id}"
    if not twin:
        assert_close_to_sum(outputs[key], want, bound, dtype, f"{what} vs float64")
        return
    check_sum(outputs[key], x, want, bound, lax_twin(cache, mesh_of, mc, "allreduce", case, cases_fn),
              dtype, what)


@pytest.mark.parametrize("mc, case", params(FLAT_MESHES, allreduce_cases))
@pytest.mark.parametrize("variant", FLAT_VARIANTS, ids=lambda v: v[0])
def test_allreduce(cache, mesh_of, variant, mc, case):
    check_allreduce(cache, mesh_of, mc, variant, case)


@pytest.mark.parametrize("mc, case", params(HIER_MESHES + HIER_ONE_AXIS, allreduce_cases))
def test_hierarchical_allreduce(cache, mesh_of, mc, case):
    check_allreduce(cache, mesh_of, mc, HIERARCHICAL, case)


def outer_cases(n):
    return [Case((7,)), Case((3, 5), "bf16", "mean")]


@pytest.mark.parametrize("mc, case", params(HIER_MESHES[1:2], outer_cases))
@pytest.mark.parametrize("outer", [a for a in flat_algorithms(C.ALGORITHMS) if a != "ring"])
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
    n = mc.n
    inputs, outputs = program(cache, mesh_of, mc, (algorithm, algorithm, lambda n: {}))
    key = f"reduce_scatter/{case.id}"
    dtype, x = DTYPES[case.dtype], inputs[key]  # x: (n ranks, n * m, ...)
    # rank r ends with rows r*m:(r+1)*m of the sum over ranks
    want = reduce_ref(x, case.op).reshape(n, *case.shape)
    bound = sum_bound(x, dtype, case.op).reshape(want.shape)
    twin = lax_twin(cache, mesh_of, mc, "reduce_scatter", case)
    check_sum(outputs[key], x, want, bound, twin, dtype, f"{algorithm} reduce_scatter n={n} {case.id}")


@pytest.mark.parametrize("mc, case", params(FLAT_MESHES, reduce_scatter_cases))
@pytest.mark.parametrize("algorithm", flat_algorithms(C.REDUCE_SCATTER_ALGORITHMS))
def test_reduce_scatter(cache, mesh_of, algorithm, mc, case):
    check_reduce_scatter(cache, mesh_of, mc, algorithm, case)


@pytest.mark.parametrize("mc, case", params(HIER_MESHES + HIER_ONE_AXIS, reduce_scatter_cases))
def test_hierarchical_reduce_scatter(cache, mesh_of, mc, case):
    check_reduce_scatter(cache, mesh_of, mc, "hierarchical", case)


# ---------------------------------------------------------------------------------------
# all_gather and broadcast: data movement only, so bit-exact


def check_all_gather(cache, mesh_of, mc, algorithm, case):
    n = mc.n
    inputs, outputs = program(cache, mesh_of, mc, (algorithm, algorithm, lambda n: {}))
    key = f"all_gather/{case.id}"
    x, got = inputs[key], outputs[key]
    # every rank ends with all blocks in rank order (a scalar gathers to shape (n,))
    gathered = x.reshape(-1, *x.shape[2:])
    want = np.broadcast_to(gathered, (n, *gathered.shape))
    assert got.dtype == x.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    assert np.array_equal(got, want), f"{algorithm} all_gather n={n} {case.id} differs from numpy"
    twin = lax_twin(cache, mesh_of, mc, "all_gather", case)
    assert np.array_equal(got, twin), f"{algorithm} all_gather differs from lax.all_gather"


@pytest.mark.parametrize("mc, case", params(FLAT_MESHES, all_gather_cases))
@pytest.mark.parametrize("algorithm", flat_algorithms(C.ALL_GATHER_ALGORITHMS))
def test_all_gather(cache, mesh_of, algorithm, mc, case):
    check_all_gather(cache, mesh_of, mc, algorithm, case)


@pytest.mark.parametrize("mc, case", params(HIER_MESHES + HIER_ONE_AXIS, all_gather_cases))
def test_hierarchical_all_gather(cache, mesh_of, mc, case):
    check_all_gather(cache, mesh_of, mc, "hierarchical", case)


# all_gather is tiled on dimension 0, so a scalar has nothing to tile: every algorithm
# refuses it with the same ValueError (lax.all_gather(tiled=True) refuses it too).
SCALAR_GATHER = [
    pytest.param(alg, mc, id=f"{alg}-{mc.id}")
    for alg, meshes in [(a, FLAT_MESHES[:3]) for a in flat_algorithms(C.ALL_GATHER_ALGORITHMS)]
    + [("hierarchical", HIER_MESHES[-2:])]
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
    inputs, outputs = program(cache, mesh_of, mc, (algorithm, algorithm, lambda n: {}))
    x, got = inputs[f"broadcast/{case.id}"], outputs[f"broadcast/{case.id}"]
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
    for alg in flat_algorithms(C.REDUCE_SCATTER_ALGORITHMS)
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


@pytest.mark.parametrize("op", ["maximum", "avg", "SUM"])
@pytest.mark.parametrize("algorithm", C.ALGORITHMS)
def test_allreduce_bad_op(mesh2x2, algorithm, op):
    axis = ("node", "data") if algorithm == "hierarchical" else "data"
    with pytest.raises(ValueError, match=f"{op!r}"):
        trace(mesh2x2, lambda x: C.allreduce(x, axis, algorithm=algorithm, op=op), (8,), axis)


@pytest.mark.parametrize("algorithm", C.REDUCE_SCATTER_ALGORITHMS)
def test_reduce_scatter_bad_op(mesh2x2, algorithm):
    axis = ("node", "data") if algorithm == "hierarchical" else "data"
    with pytest.raises(ValueError, match="'average'"):
        trace(mesh2x2, lambda x: C.reduce_scatter(x, axis, algorithm=algorithm, op="average"),
              (8,), axis)


@pytest.mark.parametrize("servers", [0, 5, -1])
def test_ps_bad_num_servers(mesh4, servers):
    with pytest.raises(ValueError, match=f"num_servers={servers}"):
        trace(mesh4, lambda x: C.allreduce(x, "data", algorithm="ps", num_servers=servers))


@pytest.mark.parametrize("primitive", [C.allreduce, C.reduce_scatter, C.all_gather])
def test_hierarchical_takes_one_or_two_axes(mesh2x2, primitive):
    with pytest.raises(ValueError, match=r"\(outer, inner\) or one axis name"):
        trace(mesh2x2, lambda x: primitive(x, ("node", "data", "data"), algorithm="hierarchical"))


# Outside shard_map the axis name is unbound: one line naming the axis and the wrapper,
# not JAX's NameError from inside the first ppermute.
OUTSIDE = [
    *(pytest.param(lambda x, a=a: C.allreduce(x, "data", algorithm=a), id=f"allreduce-{a}")
      for a in C.ALGORITHMS),
    pytest.param(lambda x: C.reduce_scatter(x, "data"), id="reduce_scatter"),
    pytest.param(lambda x: C.all_gather(x, "data", algorithm="butterfly"), id="all_gather"),
    pytest.param(lambda x: C.broadcast(x, "data", root=1), id="broadcast"),
    pytest.param(lambda x: C.all_to_all(x, "data", algorithm="bruck"), id="all_to_all"),
    pytest.param(lambda x: C.grouped_allreduce([x, x], "data"), id="grouped_allreduce"),
    pytest.param(lambda x: dpjax.allreduce_gradients({"w": x}, "data"), id="allreduce_gradients"),
    pytest.param(lambda x: dpjax.DistributedOptimizer(optax.sgd(0.1)).update(
        {"w": x}, dpjax.DistributedOptimizer(optax.sgd(0.1)).init({"w": x}), {"w": x}), id="optimizer-update"),
    pytest.param(lambda x: dpjax.broadcast_params({"w": x}, "data"), id="broadcast_params"),
]


@pytest.mark.parametrize("call", OUTSIDE)
def test_outside_a_mesh_context_says_what_to_wrap(call):
    with pytest.raises(ValueError) as info:
        call(jnp.ones(8))
    msg = str(info.value)
    assert "'data'" in msg and "jax.shard_map(..., mesh=mesh)" in msg and "dpjax.shard_step(fn, mesh)" in msg
    assert "\n" not in msg
