"""powersgd:R: rank-R PowerSGD with warm start and error feedback.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019 (torch's `powerSGD_hook`). Each gradient tensor
is viewed as a matrix M (a, b) (`matrix_view`: leading dimensions against the rest, the cut
nearest to square); with the previous step's Q (b, R):

    P = mean_i(M_i Q)          one allreduce (every tensor's P fused into buckets)
    P = orthonormal(P)         (QR; the same on every rank: P is)
    Q = mean_i(M_i^T P)        the second allreduce
    approx = P Q^T             = P P^T mean_i(M_i): linear in M, so P and Q sum on a ring
    err_i = M_i - approx       (error feedback), Q kept for the next step (warm start)

A tensor is sent exactly (in one more fused allreduce) when it is 1-D, not floating, or
its factors would not be at least MIN_RATE = 2 times smaller: 2 (a + b) R > a b (torch's
min_compression_rate; a stack of per-layer vectors, (layers, d), is sent exactly). Q starts from a normal draw with a
fixed key, the same on every rank. At full rank (R = min(a, b)) P spans M's columns and
the exchange returns the exact mean (the math is in `factor_mean`; such a tensor is sent
exactly anyway, being no smaller).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dpjax.collectives import grouped
from dpjax.compression.feedback import allreduce_bytes
from dpjax.compression.registry import Method, register
from dpjax.fusion import plan_buckets
from dpjax.mesh import spec_axes

MIN_RATE = 2  # torch's min_compression_rate: smaller savings are not worth the two extra exchanges


def matrix_view(shape) -> tuple[int, int]:
    """The matrix view (a, b) of a tensor: its leading dimensions against the rest, cut
    where a + b is smallest (torch's hook views (dim 0, rest); dpjax's layer-stacked
    weights put the layer count first, which would leave almost nothing to compress)."""
    cuts = [(math.prod(shape[:k]), math.prod(shape[k:])) for k in range(1, len(shape))]
    return min(cuts, key=sum)


def compressed(shape, dtype, rank: int) -> bool:
    """Whether a tensor of this shape travels as rank-R factors."""
    if len(shape) < 2 or not jnp.issubdtype(dtype, jnp.floating):
        return False
    a, b = matrix_view(shape)
    return (a + b) * rank * MIN_RATE <= a * b


def init(params, spec):
    """Q of every tensor, (1, b, R) for a compressed one and an unused (1, 1, R) otherwise
    (a real Q has b > 1; orbax saves no empty arrays), so the tree has the parameters'
    structure whatever the shapes. The leading 1 is this device's slot on the axes that
    split the parameter (`state_specs`)."""
    R = spec.number

    def one(i, x):
        b = matrix_view(x.shape)[1] if compressed(x.shape, x.dtype, R) else 1
        key = jax.random.fold_in(jax.random.key(0), i)
        return jax.random.normal(key, (1, b, R), jnp.float32)

    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, [one(i, x) for i, x in enumerate(leaves)])


def state_specs(param_specs, spec):
    """Each Q on the axes its parameter is split over (tensor parallelism: each shard its own Q)."""
    def one(s):
        axes = spec_axes(s)
        return P(axes or None, None, None)

    return jax.tree.map(one, param_specs, is_leaf=lambda x: isinstance(x, P))


def factor_mean(Ms, Qs, mean):
    """PowerSGD's two exchanges for matrices Ms with warm-start Qs; `mean(list)` is the
    allreduce mean. Returns (approximations of mean(M), new Qs)."""
    Ps = mean([m @ q for m, q in zip(Ms, Qs)])
    Ps = [jnp.linalg.qr(p)[0] for p in Ps]
    Qs = mean([m.T @ p for m, p in zip(Ms, Ps)])
    return [p @ q.T for p, q in zip(Ps, Qs)], Qs


def exchange(tree, Qs, axis_name, spec, t, allreduce):
    R = spec.number
    leaves, treedef = jax.tree.flatten(tree)
    qs = treedef.flatten_up_to(Qs)
    mean = lambda xs: grouped.mean(xs, axis_name, **allreduce)  # noqa: E731
    low = [i for i, x in enumerate(leaves) if compressed(x.shape, x.dtype, R)]
    rest = [i for i in range(len(leaves)) if i not in low]
    out, resid, new_q = list(leaves), [jnp.zeros_like(x) for x in leaves], list(qs)
    if rest:
        for i, m in zip(rest, mean([leaves[i] for i in rest])):
            out[i] = m
    if low:
        Ms = [leaves[i].reshape(matrix_view(leaves[i].shape)) for i in low]
        for i, m in zip(low, Ms):
            assert qs[i].shape == (1, m.shape[1], R), (qs[i].shape, m.shape, R)
        approx, Q = factor_mean(Ms, [qs[i][0].astype(m.dtype) for i, m in zip(low, Ms)], mean)
        for i, m, a, q in zip(low, Ms, approx, Q):
            out[i] = a.reshape(leaves[i].shape).astype(leaves[i].dtype)
            resid[i] = (m - a).reshape(leaves[i].shape).astype(leaves[i].dtype)
            new_q[i] = q[None].astype(qs[i].dtype)
    return jax.tree.unflatten(treedef, out), jax.tree.unflatten(treedef, resid), jax.tree.unflatten(treedef, new_q)


def wire_bytes(shapes, n, spec, allreduce):
    """Three fused allreduces: the exact tensors, every P (a R), every Q (b R)."""
    R = spec.number
    low = [s for s in shapes if compressed(s, jnp.float32, R)]
    parts = ([s for s in shapes if not compressed(s, jnp.float32, R)], [(matrix_view(s)[0], R) for s in low],
             [(matrix_view(s)[1], R) for s in low])
    total = 0
    for part in parts:
        plan = plan_buckets([jax.ShapeDtypeStruct(s, jnp.float32) for s in part],
                            allreduce.get("fusion_mb", 64) * 2**20)
        total += sum(allreduce_bytes(sum(b.sizes), n, allreduce) for b in plan.buckets)
    return total


register(Method("powersgd", None, None, lambda dt: jnp.issubdtype(dt, jnp.floating), jnp.dtype(jnp.float32),
                linear=False, exchange=exchange, init=init, state_specs=state_specs, wire_bytes=wire_bytes,
                number="the rank R",
                nonlinear="its two stages (P, then Q from the orthogonalised sum of P) span whole matrices, not "
                "one shard"))
