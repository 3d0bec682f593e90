"""Binomial-tree reduce and broadcast, and the tree allreduce built from them.

The classic latency-optimal pattern (e.g. MPICH's binomial reduce/bcast; Thakur,
Rabenseifner & Gropp, IJHPCA 2005). In the reduce, at distance d = 1, 2, 4, ... a
rank whose offset from the root is an odd multiple of d sends its partial sum d
ranks towards the root; the broadcast runs the same tree backwards. Every message
carries the whole vector, so the tree suits small messages: few steps, many bytes.

Per device, N the bytes of the vector, n ranks, k = ceil(log2 n):

    reduce      k steps; each non-root rank sends N once
    broadcast   k steps; the root sends N at every step: k * N bytes
    allreduce  2k steps; the root sends k * N bytes (the busiest device)
"""

from __future__ import annotations

import jax.numpy as jnp

from dpjax.collectives.ranks import axis_size, index, permute
from dpjax.collectives.cost import Schedule, ceil_log2, no_model
from dpjax.collectives.ops import combine
from dpjax.collectives.registry import Algorithm, register


def reduce(x, axis_name, n: int, root: int = 0, op: str = "sum"):
    """Reduction over ranks, valid on `root` only (other ranks hold partial results).

    A rank that receives nothing at a step gets zeros from the ppermute; only the
    receivers' values are ever read again, so each step combines only where a partner
    sent (for "sum" adding zeros is exact, so no select is needed)."""
    d, add = 1, combine(op)
    rel = (index(axis_name) - root) % n
    while d < n:
        pairs = [((root + a) % n, (root + a - d) % n) for a in range(n) if a % (2 * d) == d]
        got = add(x, permute(x, axis_name, pairs))
        receiver = (rel % (2 * d) == 0) & (rel + d < n)
        x = got if op in ("sum", "mean") else jnp.where(receiver, got, x)
        d *= 2
    return x


def broadcast(x, axis_name, *, root: int = 0):
    """Every rank ends with root's x, over a binomial tree."""
    n = axis_size(axis_name)
    rel = (index(axis_name) - root) % n
    d = 1 << max(0, (n - 1).bit_length() - 1)
    while d >= 1 and n > 1:
        pairs = [((root + a) % n, (root + a + d) % n) for a in range(0, n - d, 2 * d)]
        got = permute(x, axis_name, pairs)
        x = jnp.where(rel % (2 * d) == d, got, x)
        d //= 2
    return x


def allreduce(x, axis_name, *, op: str = "sum"):
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast."""
    n = axis_size(axis_name)
    if n == 1:
        return x
    return broadcast(reduce(x, axis_name, n, op=op), axis_name, root=0)


def cost(primitive: str, n: int, nelems: int, itemsize: int) -> Schedule:
    k, N = ceil_log2(n), nelems * itemsize
    if primitive == "allreduce":
        return Schedule(2 * k, k * N)
    if primitive == "broadcast":
        return Schedule(k, k * N)
    raise no_model(primitive, "tree")


register(Algorithm("tree", cost, allreduce=allreduce, broadcast=broadcast))
