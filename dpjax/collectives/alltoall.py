"""All-to-all: rank i sends block j of its input to rank j (expert parallelism's exchange).

Tiled on dimension 0 like `lax.all_to_all(x, axis, 0, 0, tiled=True)`: the local input
(n*m, ...) is n blocks of m rows; block j goes to rank j, and the output's block i is
what rank i sent here. Two schedules (Thakur, Rabenseifner & Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 2005, section 3.4):

pairwise   at step j = 1 .. n-1 every rank sends block (r + j) mod n to rank r + j
           and receives block r from rank r - j: each block travels once, directly.
bruck      Bruck et al., "Efficient algorithms for all-to-all communications in
           multiport message-passing systems" (IEEE TPDS 1997): rotate the blocks so
           that position j holds the block for rank r + j; at step k = 0 .. ceil(log2 n)-1
           send every position whose bit k is set to rank r + 2^k (a block moves by the
           bits of its distance, so it arrives after at most log2 n hops); finally
           position j holds the block from rank r - j. Fewer steps, more bytes: for
           small messages, where the per-step latency dominates.

Per device, B the bytes of one block (N = n B the whole local input):

    pairwise   n-1 steps,            (n-1) B = (n-1)/n * N bytes sent
    bruck      ceil(log2 n) steps,   B * sum_k #{j < n : bit k of j set} bytes
               (n a power of two: log2(n) * n/2 * B = log2(n)/2 * N)

Both are sequences of `ppermute`s, so JAX differentiates them: the transpose of an
all-to-all is the all-to-all of the cotangents, as for `lax.all_to_all` (and as
Horovod's alltoall gradient is).
"""

from __future__ import annotations

import jax.numpy as jnp

from dpjax.collectives.ranks import axis_size, index, permute, row, shift_perm, split_dim0
from dpjax.collectives.cost import Schedule, ceil_log2, no_model
from dpjax.collectives.registry import Algorithm, register
from dpjax.collectives.ring import rows_in_rank_order


def _blocks(x, axis_name):
    """(n, the input as n blocks, this rank) for a tiled all-to-all."""
    n = axis_size(axis_name)
    return n, split_dim0(x, n, "all_to_all"), index(axis_name)


def pairwise(x, axis_name):
    n, blocks, r = _blocks(x, axis_name)
    if n == 1:
        return x
    got = [row(blocks, r)]  # got[j]: the block rank r - j sent to me
    for j in range(1, n):
        got.append(permute(row(blocks, (r + j) % n), axis_name, shift_perm(n, j)))
    # output block i came from rank i, which is j = r - i steps round
    table = [[(i - s) % n for s in range(n)] for i in range(n)]
    return rows_in_rank_order([g[None] for g in got], table, r).reshape(x.shape)


def bruck(x, axis_name):
    n, blocks, r = _blocks(x, axis_name)
    if n == 1:
        return x
    # position j holds the block for rank r + j
    rotate = [[(i + j) % n for j in range(n)] for i in range(n)]
    pos = rows_in_rank_order([blocks], rotate, r)
    k = 1
    while k < n:
        # the positions with bit k set: runs [k, 2k), [3k, 4k), ... (static slices)
        runs = [(a, min(a + k, n)) for a in range(k, n, 2 * k)]
        got = permute(jnp.concatenate([pos[a:b] for a, b in runs]), axis_name, shift_perm(n, k))
        pieces, at, used = [], 0, 0
        for a, b in runs:
            pieces += [pos[at:a], got[used:used + b - a]]
            at, used = b, used + b - a
        pos = jnp.concatenate(pieces + [pos[at:]])
        k *= 2
    # position j now holds the block from rank r - j; output block i is position r - i
    back = [[(i - s) % n for s in range(n)] for i in range(n)]
    return rows_in_rank_order([pos], back, r).reshape(x.shape)


def pairwise_cost(primitive: str, n: int, nelems: int, itemsize: int) -> Schedule:
    if primitive != "all_to_all":
        raise no_model(primitive, "pairwise")
    block = nelems // n * itemsize
    return Schedule(n - 1, (n - 1) * block)


def bruck_cost(primitive: str, n: int, nelems: int, itemsize: int) -> Schedule:
    """Step k sends every block whose position has bit k set."""
    if primitive != "all_to_all":
        raise no_model(primitive, "bruck")
    block, bits = nelems // n * itemsize, range(ceil_log2(n))
    return Schedule(len(bits), block * sum(1 for k in bits for j in range(n) if j >> k & 1))


register(Algorithm("pairwise", pairwise_cost, all_to_all=pairwise))
register(Algorithm("bruck", bruck_cost, all_to_all=bruck))
