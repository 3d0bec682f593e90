"""Uneven pieces: reduce-scatter and all-gather with per-rank row counts (Horovod's
uneven reducescatter and allgatherv), padded internally to the even collective.

`sizes=[s_0, ..., s_{n-1}]` (static): rank i owns rows s_0 + ... + s_{i-1} onward,
s_i of them, and m = max(sizes).

    reduce_scatter   input (sum(sizes), ...) on every rank; each rank's block is padded
                     to m rows, the (n*m, ...) even reduce-scatter runs, and rank i gets
                     (m, ...): its s_i reduced rows, then zeros (shard_map gives every
                     rank one output shape, so the padding stays; cut it with s_i)
    all_gather       input (m, ...) on every rank, the first s_i rows rank i's own (the
                     rest ignored); output (sum(sizes), ...), the same on every rank

Per device: what the even collective of n*m rows sends (cost.schedule of that size).
Horovod's default split when n does not divide the rows gives the first ranks one row
more (`default_sizes`).
"""

from __future__ import annotations

import operator

import jax.numpy as jnp


def default_sizes(rows: int, n: int) -> list[int]:
    """Horovod's split of `rows` over n ranks: the first rows % n ranks get one more."""
    return [rows // n + (i < rows % n) for i in range(n)]


def check_sizes(sizes, n: int, what: str) -> tuple[int, ...]:
    try:
        sizes = tuple(operator.index(s) for s in sizes)
    except TypeError:
        raise ValueError(f"{what}: sizes must be static integers (rows per rank), got {sizes!r}") from None
    if len(sizes) != n or min(sizes) < 0 or max(sizes) == 0:
        raise ValueError(f"{what}: sizes {list(sizes)} must give a row count >= 0 for each of the {n} ranks "
                         f"(not all zero)")
    return sizes


def pad_blocks(x, sizes):
    """(sum(sizes), ...) -> (n * m, ...): block i padded with zero rows to m."""
    if x.ndim == 0 or x.shape[0] != sum(sizes):
        raise ValueError(f"reduce_scatter: dimension 0 of shape {x.shape} must equal sum(sizes) = {sum(sizes)}")
    m, start, blocks = max(sizes), 0, []
    for s in sizes:
        blocks.append(jnp.pad(x[start:start + s], [(0, m - s)] + [(0, 0)] * (x.ndim - 1)))
        start += s
    return jnp.concatenate(blocks)


def cut_blocks(full, sizes):
    """(n * m, ...) of padded blocks -> (sum(sizes), ...): the first s_i rows of each."""
    m = max(sizes)
    return jnp.concatenate([full[i * m:i * m + s] for i, s in enumerate(sizes)])


def check_gather_input(x, sizes):
    if x.ndim == 0 or x.shape[0] != max(sizes):
        raise ValueError(f"all_gather: dimension 0 of shape {x.shape} must equal max(sizes) = {max(sizes)} "
                         f"(rank i's first sizes[i] rows are its own, the rest padding)")
