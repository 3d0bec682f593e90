"""Adasum (op="adasum") against a numpy reference of Maleki et al.'s pairwise rule.

The reference combines the ranks' vectors along the same binary tree (ranks 2j and
2j+1 first, then pairs of pairs; for n = p + e ranks, rank p+i is first combined into
rank i), in float64, each tensor of a fused buffer on its own, with

    Adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

Tolerance: a running error bound (Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., section 3.3) carried along the tree, to first order in the unit
roundoff u of float32, in which dpjax computes the dot products and the combination.
A dot product of m terms in any order (the butterfly splits it over ranks and sums the
parts) is within gamma_m * sum |a_i b_i| (Higham eq. 3.5), plus what the inputs' own
errors ea, eb contribute; the coefficient c = 1 - D / (2 N) then carries
(dD + 2 |D / 2N| dN) / (2N) from D and N and one rounding for each of its division and
subtraction; c_a a + c_b b adds gamma_2 of its terms, and storing the result in the
input dtype (bfloat16) one more rounding of that dtype. The float64 reference's own
rounding (2^-53) is nothing next to it. Orthogonal vectors (disjoint supports) have
a.b = 0 exactly, so Adasum is their exact sum; equal vectors have coefficients 1/2
exactly, so Adasum returns them unchanged: both are checked bit for bit.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax import collectives as C
from collectives_harness import run_bundle

U32 = 2.0 ** -24


def gamma(k: int, u: float = U32) -> float:
    return k * u / (1 - k * u)


def pair(a, ea, b, eb, store_u: float):
    """Adasum of one tensor's a and b (float64) and the running bound of the result."""
    m = a.size
    D, Na, Nb = a @ b, a @ a, b @ b
    dD = gamma(m) * np.abs(a) @ np.abs(b) + ea @ np.abs(b) + np.abs(a) @ eb
    dNa, dNb = gamma(m) * Na + 2 * np.abs(a) @ ea, gamma(m) * Nb + 2 * np.abs(b) @ eb

    def coef(N, dN):
        if N == 0:
            return 1.0, 0.0
        r = D / (2 * N)
        return 1 - r, (dD + 2 * abs(r) * dN) / (2 * N) + U32 * abs(r) + U32 * abs(1 - r)

    (ca, dca), (cb, dcb) = coef(Na, dNa), coef(Nb, dNb)
    out = ca * a + cb * b
    err = (abs(ca) * ea + abs(cb) * eb + dca * np.abs(a) + dcb * np.abs(b)
           + gamma(2) * (np.abs(ca * a) + np.abs(cb * b)) + store_u * np.abs(out))
    return out, err


def reference(x: np.ndarray, segments, store_u: float):
    """Adasum over axis 0 of x (n, size) along dpjax's tree, per segment; (want, bound)."""
    n = x.shape[0]
    p = 1 << (n.bit_length() - 1)
    cuts = np.cumsum((0, *segments))

    def combine(u, v):
        pieces = [pair(u[0][a:b], u[1][a:b], v[0][a:b], v[1][a:b], store_u) for a, b in zip(cuts, cuts[1:])]
        return np.concatenate([q[0] for q in pieces]), np.concatenate([q[1] for q in pieces])

    vs = [(x[r].astype(np.float64), np.zeros(x.shape[1])) for r in range(n)]
    level = [combine(vs[i], vs[p + i]) if i < n - p else vs[i] for i in range(p)]
    while len(level) > 1:
        level = [combine(level[2 * j], level[2 * j + 1]) for j in range(len(level) // 2)]
    return level[0]


SEGMENTED = (4, 1, 9, 3)  # a fused buffer of four tensors, one of them a single element


def cases(n: int):
    """(key, dtype, segments, kind): random float32 at every n, and one of bfloat16, a
    fused buffer, orthogonal and equal vectors, cycling with n (each at two sizes, one
    of them not a power of two)."""
    other = [("bf16", ml_dtypes.bfloat16, None, "random"), ("fused", np.float32, SEGMENTED, "random"),
             ("orthogonal", np.float32, None, "orthogonal"), ("equal", np.float32, None, "equal")]
    return [("f32", np.float32, None, "random"), other[n % 4]]


def make(n: int, dtype, segments, kind: str) -> np.ndarray:
    size = sum(segments) if segments else 13
    rng = np.random.default_rng(1000 * n + size)
    if kind == "orthogonal":  # rank r owns coordinates r, r+n, ...: disjoint supports, integers
        x = np.zeros((n, size))
        for r in range(n):
            x[r, r::n] = rng.integers(1, 9, len(range(r, size, n)))
        return x.astype(dtype)
    if kind == "equal":
        return np.broadcast_to(rng.standard_normal(size), (n, size)).astype(dtype)
    return rng.standard_normal((n, size)).astype(dtype)


@pytest.mark.parametrize("n", range(1, 9))
def test_adasum_against_the_pairwise_rule(cache, mesh_of, n):
    def build():
        bodies, inputs = {}, {}
        for key, dtype, segments, kind in cases(n):
            inputs[key] = make(n, dtype, segments, kind)
            bodies[key] = lambda v, s=segments: C.allreduce(v, "data", algorithm="butterfly", op="adasum",
                                                           segments=s)
        return inputs, run_bundle(mesh_of(f"data={n}", n), "data", bodies, inputs)

    inputs, outputs = cache.get(("adasum", n), build)
    for key, dtype, segments, kind in cases(n):
        x, got = inputs[key], outputs[key]
        assert got.dtype == x.dtype and got.shape == x.shape, key
        if kind == "orthogonal":
            np.testing.assert_array_equal(got, np.broadcast_to(x.sum(0), x.shape), err_msg=f"n={n} {key}")
            continue
        if kind == "equal":
            np.testing.assert_array_equal(got, x, err_msg=f"n={n} {key}")
            continue
        store_u = float(ml_dtypes.finfo(dtype).eps) / 2 if dtype != np.float32 else 0.0
        want, bound = reference(x, segments or (x.shape[1],), store_u)
        err = np.abs(got.astype(np.float64) - want)
        assert np.all(err <= bound), f"n={n} {key}: error {err.max():.3g}, bound {bound[np.argmax(err)]:.3g}"
        if n > 1:  # really Adasum (not the sum, not the mean), and per tensor when fused
            assert not np.allclose(got[0], x.sum(0), rtol=1e-2) and not np.allclose(got[0], x.mean(0), rtol=1e-2)
            if segments:
                assert not np.allclose(got[0], reference(x, (x.shape[1],), 0.0)[0], rtol=1e-3)


@pytest.mark.parametrize("k", [1, 2])
def test_distributed_optimizer_adasum_combines_the_updates(mesh_of, put, k):
    """Horovod's Adasum optimizer: each rank's SGD step on its own gradient, the updates
    combined by Adasum (per parameter), then applied on every rank alike."""
    n, mesh = 8, mesh_of("data=8", 8)
    rng = np.random.default_rng(7)
    grads = {"w": rng.standard_normal((n, 3, 4)).astype(np.float32),
             "b": rng.standard_normal((n, 5)).astype(np.float32)}
    params = {"w": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.float32)}
    tx = dpjax.DistributedOptimizer(optax.sgd(0.5), "data", algorithm="butterfly", op="adasum",
                                    backward_passes_per_step=k, fusion_mb=64)

    def step(g, state):
        g = jax.tree.map(lambda a: a[0], g)
        for _ in range(k):  # the same local gradient k times: the accumulated mean is g
            updates, state = tx.update(g, state, params)
        return jax.tree.map(lambda u: u[None], updates)

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"), check_vma=False))
    out = f({key: put(mesh, v) for key, v in grads.items()}, tx.init(params))
    for key, g in grads.items():
        u = (-0.5 * g).reshape(n, -1)
        want, bound = reference(u, (u.shape[1],), 0.0)
        got = np.asarray(out[key]).reshape(n, -1)
        assert np.all(np.abs(got - want) <= bound), key  # every rank, the same combined update


def test_adasum_needs_the_butterfly_and_floats(mesh_of):
    mesh = mesh_of("data=4", 4)

    def trace(body, dtype=np.float32):
        fn = jax.shard_map(lambda b: body(b[0])[None], mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        return jax.eval_shape(fn, jax.ShapeDtypeStruct((4, 6), dtype))

    with pytest.raises(ValueError, match="algorithm='butterfly'"):
        trace(lambda x: C.allreduce(x, "data", op="adasum"))
    with pytest.raises(ValueError, match="int32"):
        trace(lambda x: C.allreduce(x, "data", algorithm="butterfly", op="adasum"), np.int32)
    with pytest.raises(ValueError, match="segments"):
        trace(lambda x: C.allreduce(x, "data", algorithm="butterfly", op="adasum", segments=(2, 2)))
    with pytest.raises(ValueError, match="algorithm='butterfly'"):
        dpjax.DistributedOptimizer(optax.sgd(0.1), op="adasum")


def test_an_exchange_whose_options_name_adasum_reduces_with_it(mesh_of, put):
    """`Exchange(options={"op": "adasum"})` (how the rules and the Adasum experiment ask for it) reduces
    with Adasum, bit for bit the collective's; an explicit `op=` still wins."""
    from dpjax.compression import Exchange

    mesh = mesh_of("data=8", 8)
    x = np.random.default_rng(3).standard_normal((8, 6)).astype(np.float32)
    ex = Exchange(algorithm="butterfly", options={"op": "adasum"})

    def run(body):
        f = jax.jit(jax.shard_map(lambda v: body(v[0])[None], mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                  check_vma=False))
        return np.asarray(f(put(mesh, x)))

    got = run(lambda v: ex.allreduce({"g": v}, "data")["g"])
    np.testing.assert_array_equal(got, run(lambda v: C.allreduce(v, "data", algorithm="butterfly", op="adasum")))
    assert not np.allclose(got[0], x.mean(0), rtol=1e-3)
    np.testing.assert_allclose(run(lambda v: ex.allreduce({"g": v}, "data", op="mean")["g"])[0], x.mean(0),
                               rtol=1e-6)
