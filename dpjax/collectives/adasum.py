"""Adasum: adaptive summation of gradients over a butterfly (Horovod's `op=hvd.Adasum`).

Maleki et al., "Scaling Distributed Training with Adaptive Summation" (MLSys 2021).
Two gradients combine as

    Adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so orthogonal gradients add, equal ones average, and anything between interpolates;
a zero vector leaves the other unchanged. n gradients combine pairwise along a
binary tree: ranks at distance 1 first, then pairs of pairs at distance 2, and so on
(Horovod's "vector halving, distance doubling": close ranks, on fast links, first).

Steps, for n = p = 2^k ranks (`butterfly.halving_rows` with ascending distances):

  1. for d = 1, 2, ..., p/2: a rank keeps half of its current segment and swaps the
     other half with rank r ^ d. It then holds the same half of both subtrees'
     combined vectors, A (ranks whose bit d is clear) and B. Every rank of the 2d-rank
     block computes its part of A.B, |A|^2 and |B|^2; a recursive-doubling sum over
     the block (distances 1, ..., d) gives the whole dot products, identical bit for
     bit on every rank of the block; then half = cA * A + cB * B.
  2. a recursive-doubling all-gather (`butterfly.doubling_rows`) of the p segments.

Any other n = p + e folds in first (as `butterfly` does, with Adasum instead of +):
extra rank p+i hands its vector to rank i, which combines the two locally (whole
vectors: no dot products to exchange), and rank i hands the result back at the end.
Horovod runs Adasum on CPU for powers of two only; the fold-in is this module's.

`segments`: the sizes of the tensors packed into a flat buffer (tensor fusion). Each
tensor gets its own coefficients, as Horovod computes them per tensor of a fused
buffer (and the paper per layer); the dot products travel as 3 numbers per tensor.
Dot products and the combination are computed in float32 (float64 for float64).

Per device, N the bytes of the vector, T tensors, n = p = 2^k, w = 4 (8 for float64):

    halving     k steps,             (p-1)/p * N bytes
    dots        k(k+1)/2 steps,      3 T w bytes each
    doubling    k steps,             (p-1)/p * N bytes
    in all      2k + k(k+1)/2 steps, 2(p-1)/p * N + 3 T w k(k+1)/2 bytes

plus, for n = p + e, 2 steps and N bytes more on rank i < e (the fold-in, as in the
butterfly). Against the butterfly's sum: the same bytes (up to 12 T bytes per dot
step) and k(k+1)/2 more, tiny, steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dpjax.collectives.ranks import as_chunks, axis_size, index, permute
from dpjax.collectives import butterfly
from dpjax.collectives.butterfly import doubling_rows, fold, halving_rows, pow2_below, unfold
from dpjax.collectives.cost import Schedule, ceil_log2, no_model
from dpjax.collectives.registry import Algorithm, register


def _acc_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _bitrev(k: int, bits: int) -> int:
    return int(format(k, f"0{bits}b")[::-1], 2) if bits else 0


class _Segments:
    """Which tensor each element of the padded (p, c) rows belongs to (static)."""

    def __init__(self, sizes, total: int, p: int, c: int):
        self.T = len(sizes)
        ids = np.repeat(np.arange(self.T), sizes)
        self.ids = np.pad(ids, (0, p * c - total), constant_values=self.T).reshape(p, c)

    def sums(self, v, ids):
        """v -> per-tensor sums (T,) (padding, id T, dropped); ids: v's tensor ids."""
        if self.T == 1:
            return jnp.sum(v)[None]
        return jax.ops.segment_sum(v.reshape(-1), ids.reshape(-1), num_segments=self.T + 1)[:self.T]

    def spread(self, coef, ids):
        """Per-tensor coefficients (T,) -> one per element of ids (a scalar for one tensor)."""
        if self.T == 1:
            return coef[0]
        return jnp.concatenate([coef, jnp.ones((1,), coef.dtype)])[ids]


def _coefficients(dots):
    """dots (3, T) = [a.b, |a|^2, |b|^2] -> (ca, cb), 1 where a norm is zero."""
    ab, aa, bb = dots

    def coef(nn):
        return jnp.where(nn > 0, 1 - ab / (2 * jnp.where(nn > 0, nn, 1)), 1)

    return coef(aa), coef(bb)


def _combine(a, b, ca, cb, dtype):
    acc = _acc_dtype(dtype)
    return (ca * a.astype(acc) + cb * b.astype(acc)).astype(dtype)


def _partial_dots(a, b, seg, ids):
    acc = _acc_dtype(a.dtype)
    a, b = a.astype(acc), b.astype(acc)
    return jnp.stack([seg.sums(a * b, ids), seg.sums(a * a, ids), seg.sums(b * b, ids)])


def _block_sum(v, axis_name, p: int, d: int):
    """Recursive-doubling sum of v over the 2d ranks that share r // (2d)."""
    e = 1
    while e <= d:
        v = v + permute(v, axis_name, [(i, i ^ e) for i in range(p)])
        e *= 2
    return v


def allreduce(x, axis_name, *, op: str = "adasum", segments=None):
    """Adasum of every rank's `x` (any shape; `segments` for a flat fused buffer)."""
    n = axis_size(axis_name)
    sizes = (x.size,) if segments is None else tuple(int(s) for s in segments)
    if sum(sizes) != x.size or (segments is not None and x.ndim != 1):
        raise ValueError(f"adasum segments {sizes} must add up to the size of a flat buffer, got shape {x.shape}")
    if n == 1:
        return x
    p = pow2_below(n)
    k = p.bit_length() - 1
    whole = _Segments(sizes, x.size, 1, x.size)

    def local(a, b):  # fold-in: both whole vectors on one rank
        ids = whole.ids[0]
        a, b = a.reshape(-1), b.reshape(-1)
        ca, cb = _coefficients(_partial_dots(a, b, whole, ids))
        return _combine(a, b, whole.spread(ca, ids), whole.spread(cb, ids), x.dtype).reshape(x.shape)

    rows, undo = as_chunks(fold(x, axis_name, n, p, local), p)
    seg = _Segments(sizes, x.size, p, rows.shape[1])
    r = index(axis_name)

    def level(keep, got, d):
        # The tensor ids of the rows kept after the steps at distances <= d.
        offset = sum(((r >> j) & 1) * (p >> (j + 1)) for j in range(d.bit_length()))
        ids = None if seg.T == 1 else lax.dynamic_slice_in_dim(jnp.asarray(seg.ids), offset, keep.shape[0], 0)
        # A is the subtree whose bit d is clear; my own half (`keep`) is B's if mine is set.
        mine_is_b = (r & d) > 0
        ab, kk, gg = _partial_dots(keep, got, seg, ids)
        dots = jnp.stack([ab, jnp.where(mine_is_b, gg, kk), jnp.where(mine_is_b, kk, gg)])
        ca, cb = _coefficients(_block_sum(dots, axis_name, p, d))
        c_keep, c_got = jnp.where(mine_is_b, cb, ca), jnp.where(mine_is_b, ca, cb)
        return _combine(keep, got, seg.spread(c_keep, ids), seg.spread(c_got, ids), x.dtype)

    mine = halving_rows(rows, axis_name, p, level, ascending=True)  # row bitrev(r)
    full = doubling_rows(mine, axis_name, p, owner=lambda s: _bitrev(s, k))
    return unfold(undo(full), axis_name, n, p)


def cost(primitive: str, n: int, nelems: int, itemsize: int, tensors: int = 1) -> Schedule:
    """The table above: the butterfly's halving and doubling, plus k(k+1)/2 steps that sum
    3 dot products per tensor (float32, float64 for float64 input) over each block."""
    if primitive != "allreduce":
        raise no_model(primitive, "adasum")
    if n == 1:
        return Schedule(0, 0)
    halving_doubling = butterfly.cost("allreduce", n, nelems, itemsize)
    k = ceil_log2(pow2_below(n))
    dot_steps = k * (k + 1) // 2
    return Schedule(halving_doubling.steps + dot_steps,
                    halving_doubling.bytes + dot_steps * 3 * tensors * max(4, itemsize))


# Reached through op="adasum" (with algorithm="butterfly"), not as an algorithm= of its
# own: registered for its cost formula only, so it implements no primitive by name.
register(Algorithm("adasum", cost))
