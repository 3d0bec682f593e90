"""Process sets (groups=), uneven pieces (sizes=) and grouped collectives against numpy.

Horovod's test_torch.py checks these with process sets of unequal size (even and odd
ranks, a set of one), `reducescatter` of a first dimension the size does not divide,
`allgather` of per-rank sizes that differ, and `grouped_allreduce / allgather /
reducescatter` of lists of tensors. Here all of them run in one compiled program on 8
devices. Small integer-valued inputs keep every sum exact in every dtype used (float32,
bfloat16 and the float16 wire all hold integers up to 256 exactly), so every check is
bit for bit but one: a mean over a set of 3 ranks, which XLA's CPU backend computes as
the sum times the float32 reciprocal of 3, two roundings (gamma_2 = 2u / (1 - 2u)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dpjax import collectives as C
from dpjax.collectives import registry
from dpjax.collectives.uneven import default_sizes
from dpjax.compression import summable  # the collectives take a resolved wire method
from collectives_harness import run_bundle

N = 8
UNEQUAL = [[0, 2, 4], [1, 3], [5, 6, 7]]  # three sizes, every rank in a set
PARTIAL = [[6, 1], [0, 3, 5]]  # ranks 2, 4 and 7 in none: each a set of its own
HALVES = [[0, 2, 4, 6], [1, 3, 5, 7]]  # one size, for the collectives that change shapes
SIZES = [3, 0, 2, 1, 2, 1, 1, 2]  # rows per rank; rank 1 owns none
WITHIN_SETS = [a for a in C.ALGORITHMS if registry.get(a).groups]  # the allreduces that take groups=
TENSORS = [((3, 2), jnp.float32), ((5,), jnp.int32), ((2, 2, 2), jnp.bfloat16), ((8,), jnp.float32)]


def groups_of(r: int, groups) -> list[int]:
    return next((g for g in groups if r in g), [r])


def split(v):
    """One flat float row -> the TENSORS (integer values: every dtype holds them exactly)."""
    out, at = [], 0
    for shape, dtype in TENSORS:
        size = int(np.prod(shape))
        out.append(v[at:at + size].reshape(shape).astype(dtype))
        at += size
    return out


def flat(tensors, shapes=None):
    """The TENSORS (or tensors of `shapes`) back into one float row, checking at trace time
    that the grouped collective kept every dtype (and made the expected shapes)."""
    want = [(shape, np.dtype(d)) for shape, d in TENSORS] if shapes is None else shapes
    assert [(t.shape, t.dtype) for t in tensors] == want, [(t.shape, t.dtype) for t in tensors]
    return jnp.concatenate([t.astype(jnp.float32).reshape(-1) for t in tensors])


def scatter_inputs(v):
    """The tensors of the grouped reduce-scatter: first dimensions that 8 divides."""
    return [v[24:32], v[:16].reshape(8, 2)]


BODIES = {
    **{f"allreduce-{alg}": (lambda v, alg=alg: C.allreduce(v, "data", algorithm=alg, groups=UNEQUAL))
       for alg in WITHIN_SETS},
    "allreduce-mean": lambda v: C.allreduce(v, "data", algorithm="butterfly", op="mean", groups=UNEQUAL),
    "allreduce-max-int": lambda v: C.allreduce(v.astype(jnp.int32), "data", op="max", groups=UNEQUAL),
    "allreduce-partial": lambda v: C.allreduce(v, "data", algorithm="tree", groups=PARTIAL),
    "broadcast-tree": lambda v: C.broadcast(v, "data", root=1, algorithm="tree", groups=UNEQUAL),
    "broadcast-ring": lambda v: C.broadcast(v, "data", root=0, algorithm="ring", groups=PARTIAL),
    "reduce_scatter-groups": lambda v: C.reduce_scatter(v, "data", algorithm="butterfly", groups=HALVES),
    "all_gather-groups": lambda v: C.all_gather(v[:2], "data", algorithm="ring", groups=HALVES),
    "all_to_all-groups": lambda v: C.all_to_all(v, "data", algorithm="bruck", groups=HALVES),
    **{f"reduce_scatter-sizes-{alg}": (lambda v, alg=alg: C.reduce_scatter(v[:12], "data", algorithm=alg,
                                                                          sizes=SIZES))
       for alg in ("ring", "butterfly", "psum")},
    **{f"all_gather-sizes-{alg}": (lambda v, alg=alg: C.all_gather(v[:3], "data", algorithm=alg, sizes=SIZES))
       for alg in ("butterfly", "hierarchical")},
    "grouped_allreduce": lambda v: flat(C.grouped_allreduce(split(v), "data", op="mean", fusion_mb=16 / 2**20,
                                                            compression=summable("fp16"))),
    "grouped_all_gather": lambda v: flat(C.grouped_all_gather(split(v), "data", algorithm="butterfly"),
                                         [((N * s[0], *s[1:]), np.dtype(d)) for s, d in TENSORS]),
    "grouped_reduce_scatter": lambda v: flat(C.grouped_reduce_scatter(scatter_inputs(v), "data", fusion_mb=0),
                                             [((1,), np.dtype(np.float32)), ((1, 2), np.dtype(np.float32))]),
}


@pytest.fixture(scope="module")
def results(cache, mesh_of):
    def build():
        rng = np.random.default_rng(15)
        x = rng.integers(-20, 21, (N, 32)).astype(np.float32)  # every rank a different row
        inputs = {k: x for k in BODIES}
        return x, run_bundle(mesh_of(f"data={N}", N), "data", BODIES, inputs)

    return cache.get(("process-sets", N), build)


@pytest.mark.parametrize("alg", WITHIN_SETS)
def test_allreduce_within_sets_of_unequal_size(results, alg):
    x, out = results
    want = np.stack([x[groups_of(r, UNEQUAL)].sum(0) for r in range(N)])
    np.testing.assert_array_equal(out[f"allreduce-{alg}"], want)


def test_mean_and_max_divide_by_and_stay_in_each_rank_set(results):
    x, out = results
    for r in range(N):
        g = groups_of(r, UNEQUAL)
        mean = x[g].astype(np.float64).sum(0) / len(g)  # the exact sum; then 1/k and a product
        u = 2.0**-24
        np.testing.assert_allclose(out["allreduce-mean"][r], mean, rtol=2 * u / (1 - 2 * u), atol=0)
        np.testing.assert_array_equal(out["allreduce-max-int"][r], x[g].max(0).astype(np.int32))
    assert out["allreduce-max-int"].dtype == np.int32


def test_a_rank_in_no_set_is_a_set_of_its_own(results):
    x, out = results
    np.testing.assert_array_equal(out["allreduce-partial"], np.stack([x[groups_of(r, PARTIAL)].sum(0)
                                                                      for r in range(N)]))
    for r in (2, 4, 7):
        np.testing.assert_array_equal(out["allreduce-partial"][r], x[r])


def test_broadcast_root_is_a_position_in_each_set(results):
    x, out = results
    for r in range(N):
        np.testing.assert_array_equal(out["broadcast-tree"][r], x[groups_of(r, UNEQUAL)[1]])
        np.testing.assert_array_equal(out["broadcast-ring"][r], x[groups_of(r, PARTIAL)[0]])


def test_scatter_gather_and_all_to_all_within_sets(results):
    x, out = results
    for r in range(N):
        g = groups_of(r, HALVES)
        i = g.index(r)
        np.testing.assert_array_equal(out["reduce_scatter-groups"][r], x[g].sum(0).reshape(4, 8)[i])
        np.testing.assert_array_equal(out["all_gather-groups"][r], x[g][:, :2].reshape(-1))
        blocks = x[g].reshape(4, 4, 8)  # [sender position, receiver position, ...]
        np.testing.assert_array_equal(out["all_to_all-groups"][r], blocks[:, i].reshape(-1))


def test_uneven_pieces(results):
    x, out = results
    total, start = x[:, :12].sum(0), np.cumsum([0] + SIZES)
    gathered = np.concatenate([x[r, :s] for r, s in enumerate(SIZES)])
    for r in range(N):
        for alg in ("ring", "butterfly", "psum"):
            got = out[f"reduce_scatter-sizes-{alg}"][r]
            assert got.shape == (max(SIZES),)  # every rank one shape: its rows, then zeros
            np.testing.assert_array_equal(got[:SIZES[r]], total[start[r]:start[r + 1]], err_msg=alg)
            np.testing.assert_array_equal(got[SIZES[r]:], 0, err_msg=alg)
        for alg in ("butterfly", "hierarchical"):
            np.testing.assert_array_equal(out[f"all_gather-sizes-{alg}"][r], gathered, err_msg=alg)
    assert default_sizes(11, 4) == [3, 3, 3, 2] and default_sizes(8, 8) == [1] * 8  # Horovod's split


def test_grouped_collectives(results):
    x, out = results
    per_rank = [split(np.asarray(x[r])) for r in range(N)]  # numpy views of each rank's TENSORS
    mean = [np.mean([np.asarray(t[i], np.float64) for t in per_rank], 0) for i in range(len(TENSORS))]
    got = split(out["grouped_allreduce"][0])
    for (shape, dtype), g, m in zip(TENSORS, got, mean):
        if dtype == jnp.int32:  # integers: not compressed, a mean that rounds toward zero
            np.testing.assert_array_equal(g, np.trunc(m))
        else:  # fp16 on the wire holds the integer sum exactly, and / 8 is exact
            np.testing.assert_array_equal(np.asarray(g, np.float64), m)
    gathered = out["grouped_all_gather"][0]
    want = np.concatenate([np.concatenate([t[i] for t in per_rank]).astype(np.float32).reshape(-1)
                           for i in range(len(TENSORS))])
    np.testing.assert_array_equal(gathered, want)
    sums = [sum(scatter_inputs(x[q])[i] for q in range(N)) for i in range(2)]
    for r in range(N):  # rank r: row r of each tensor's sum
        np.testing.assert_array_equal(out["grouped_reduce_scatter"][r],
                                      np.concatenate([s[r:r + 1].reshape(-1) for s in sums]))


@pytest.mark.parametrize("call, match", [
    (lambda v: C.allreduce(v, "data", groups=[[0, 1], [1, 2]]), r"rank 1 is in two groups"),
    (lambda v: C.allreduce(v, "data", groups=[[0, 9]]), r"rank 9 of group \[0, 9\] is outside the axis of size 8"),
    (lambda v: C.allreduce(v, "data", groups=[[0], []]), r"empty group"),
    (lambda v: C.allreduce(v, "data", groups=[[0, 1.5]]), r"groups must be lists of integer ranks"),
    (lambda v: C.allreduce(v, "data", algorithm="psum", groups=HALVES), r"'psum' takes no groups"),
    (lambda v: C.reduce_scatter(v, "data", groups=UNEQUAL), r"must all have one size and cover every rank"),
    (lambda v: C.all_gather(v, "data", groups=[[0, 1, 2, 3]]), r"must all have one size and cover every rank"),
    (lambda v: C.broadcast(v, "data", root=2, groups=UNEQUAL), r"root 2 is outside the smallest group, of size 2"),
    (lambda v: C.reduce_scatter(v, "data", sizes=[1] * 7), r"sizes \[1, 1, 1, 1, 1, 1, 1\] must give a row count"),
    (lambda v: C.reduce_scatter(v, "data", sizes=[4] * 8), r"must equal sum\(sizes\) = 32"),
    (lambda v: C.all_gather(v, "data", sizes=[1] * 8), r"must equal max\(sizes\) = 1"),
    (lambda v: C.reduce_scatter(v[:12], "data"), r"divisible by the axis size 8 \(or give sizes="),
    (lambda v: C.grouped_reduce_scatter([v[:12]], "data"), r"divisible by the axis size 8"),
], ids=["overlap", "outside", "empty", "not-int", "psum", "rs-unequal", "ag-partial", "root", "sizes-len",
        "sizes-sum", "gather-rows", "indivisible", "grouped-indivisible"])
def test_what_does_not_fit_is_one_clear_error(mesh_of, call, match):
    fn = jax.shard_map(lambda b: call(b[0])[None], mesh=mesh_of(f"data={N}", N), in_specs=P("data"),
                       out_specs=P("data"))
    with pytest.raises(ValueError, match=match) as info:
        jax.eval_shape(fn, jax.ShapeDtypeStruct((N, 16), jnp.float32))
    assert "\n" not in str(info.value)
