"""Butterfly collectives: recursive halving and recursive doubling (Rabenseifner).

Rabenseifner's allreduce ("Optimization of collective reduction operations", ICCS
2004; Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH", IJHPCA 2005) is a recursive-halving reduce-scatter followed by
a recursive-doubling all-gather. At step k a rank exchanges with the partner whose
rank differs in one bit, sending the half of its current segment it will not own.

Per device, N the bytes of the full vector, n = 2^k ranks:

    reduce_scatter   log2 n steps,   (n-1)/n * N bytes sent
    all_gather       log2 n steps,   (n-1)/n * N bytes sent
    allreduce      2 log2 n steps, 2(n-1)/n * N bytes sent

Any other n = p + e (p the largest power of two below n, e = n - p extra ranks)
uses the usual fold-in: extra rank p+i first hands its data to rank i, the p ranks
run the butterfly, and rank i hands the result back. Worst-case device, c = N/n:

    allreduce       2 + 2 log2 p steps,  N + 2(p-1)/p * N bytes  (rank i < e)
    reduce_scatter  2 + log2 p steps,    (2p-1) * c bytes        (rank i < e;
                    the p ranks own segments of two chunks, i and p+i, zero-padded)
    all_gather      2 + log2 p steps,    2(p-1) * c + N bytes    (rank i < e)
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from dpjax.collectives.ranks import as_chunks, axis_size, index, permute, split_dim0
from dpjax.collectives.cost import Schedule, ceil_log2, no_model
from dpjax.collectives.ops import combine
from dpjax.collectives.registry import Algorithm, register
from dpjax.collectives.ring import rows_in_rank_order


def pow2_below(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def fold(x, axis_name, n: int, p: int, add):
    """Extra rank p+i combines its x into rank i (`add`); the other ranks keep theirs
    (they receive zeros, which only a sum could absorb)."""
    if p == n:
        return x
    got = permute(x, axis_name, [(p + i, i) for i in range(n - p)])
    return jnp.where(index(axis_name) < n - p, add(x, got), x)


def unfold(x, axis_name, n: int, p: int):
    """Rank i (< n-p) hands its result to extra rank p+i."""
    if p == n:
        return x
    got = permute(x, axis_name, [(i, p + i) for i in range(n - p)])
    return jnp.where(index(axis_name) >= p, got, x)


def halving_rows(rows, axis_name, p: int, add, ascending: bool = False):
    """Recursive halving over ranks 0..p-1: rows (p, ...) -> one row reduced over ranks.

    At each step a rank keeps one half of its current rows, sends the other half to
    the partner at distance d and combines what arrives: `add(kept, received, d)`
    (received is the partner's copy of the kept half). Distances p/2, ..., 2, 1
    (Rabenseifner's order) leave rank r with row r. `ascending` (1, 2, ..., p/2,
    Horovod's "vector halving, distance doubling" for Adasum) leaves it with row
    bitrev(r): ranks close together combine first."""
    r = index(axis_name)
    cur = rows
    distances = [1 << k for k in range(p.bit_length() - 1)]
    for d in (distances if ascending else distances[::-1]):
        h = cur.shape[0] // 2
        upper = (r // d) % 2  # this rank keeps the upper half of its current rows
        keep = lax.dynamic_slice_in_dim(cur, upper * h, h, 0)
        send = lax.dynamic_slice_in_dim(cur, (1 - upper) * h, h, 0)
        cur = add(keep, permute(send, axis_name, [(i, i ^ d) for i in range(p)]), d)
    return cur[0]


def doubling_rows(mine, axis_name, p: int, owner=None):
    """Recursive doubling over ranks 0..p-1: this rank's row -> (p, ...) all rows in order.

    owner(k): the rank that holds row k (default k; `bitrev` after an ascending halving)."""
    r = index(axis_name)
    # Rows are held in "XOR order": position j holds the row of rank j ^ r. The partner
    # r ^ d holds rows (j ^ d) ^ r at its positions j < d, which are my positions j + d,
    # so every step appends what arrives at a static offset; only the last write is
    # rank-dependent. (A select between two orders at every step reads both
    # operands and copies the growing buffer once more.)
    cur, d = mine[None], 1
    while True:
        got = permute(cur, axis_name, [(i, i ^ d) for i in range(p)])
        d *= 2
        if d == p:
            break
        cur = jnp.concatenate([cur, got])
    owner = owner or (lambda k: k)
    order = [[owner(k) ^ i for k in range(p)] for i in range(p)]  # row k sits at owner(k) ^ r
    return rows_in_rank_order([cur, got], order, jnp.minimum(r, p - 1))


def _add(op):
    add = combine(op)
    return lambda keep, got, d: add(keep, got)


def allreduce(x, axis_name, *, op: str = "sum"):
    """Rabenseifner allreduce: recursive halving + recursive doubling, any axis size."""
    n = axis_size(axis_name)
    if n == 1:
        return x
    p = pow2_below(n)
    rows, undo = as_chunks(fold(x, axis_name, n, p, combine(op)), p)
    full = doubling_rows(halving_rows(rows, axis_name, p, _add(op)), axis_name, p)
    return unfold(undo(full), axis_name, n, p)


def reduce_scatter(x, axis_name, *, op: str = "sum"):
    """Recursive-halving reduce-scatter, tiled on dimension 0."""
    n = axis_size(axis_name)
    rows = split_dim0(x, n, "reduce_scatter")
    if n == 1:
        return rows[0]
    p = pow2_below(n)
    if p == n:
        return halving_rows(rows, axis_name, p, _add(op))
    rows = fold(rows, axis_name, n, p, combine(op))
    pad = jnp.zeros((2 * p - n, *rows.shape[1:]), rows.dtype)
    # Segment i holds chunks i and p+i (zeros past n): rank i reduces both, keeps
    # chunk i and hands chunk p+i to the extra rank p+i.
    segs = jnp.concatenate([rows, pad]).reshape(2, p, *rows.shape[1:]).swapaxes(0, 1)
    mine = halving_rows(segs, axis_name, p, _add(op))
    got = permute(mine[1], axis_name, [(i, p + i) for i in range(n - p)])
    return jnp.where(index(axis_name) >= p, got, mine[0])


def all_gather(x, axis_name):
    """Recursive-doubling all-gather, tiled on dimension 0."""
    n = axis_size(axis_name)
    if n == 1:
        return x
    p = pow2_below(n)
    if p == n:
        full = doubling_rows(x, axis_name, p)
    else:
        extra = permute(x, axis_name, [(p + i, i) for i in range(n - p)])
        segs = doubling_rows(jnp.stack([x, extra]), axis_name, p)  # (p, 2, ...)
        full = unfold(segs.swapaxes(0, 1).reshape(2 * p, *x.shape)[:n], axis_name, n, p)
    return full.reshape(n * x.shape[0], *x.shape[1:])


def cost(primitive: str, n: int, nelems: int, itemsize: int) -> Schedule:
    """The two tables above (n a power of two, or p + e with the fold-in), padding included."""
    if n == 1:
        return Schedule(0, 0)
    c, N = math.ceil(nelems / n) * itemsize, nelems * itemsize  # c: one chunk, padded
    p = pow2_below(n)
    k = ceil_log2(p)
    if p == n and primitive == "allreduce":
        return Schedule(2 * k, 2 * (n - 1) * c)
    if p == n and primitive in ("reduce_scatter", "all_gather"):
        return Schedule(k, (n - 1) * c)
    seg = math.ceil(nelems / p) * itemsize
    if primitive == "allreduce":
        return Schedule(2 + 2 * k, max(N, 2 * (p - 1) * seg + N))
    if primitive == "reduce_scatter":
        return Schedule(2 + k, max(N, (2 * p - 1) * c))
    if primitive == "all_gather":
        return Schedule(2 + k, 2 * (p - 1) * c + n * c)
    raise no_model(primitive, "butterfly")


register(Algorithm("butterfly", cost, allreduce=allreduce, reduce_scatter=reduce_scatter, all_gather=all_gather))
