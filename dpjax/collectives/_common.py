"""Helpers shared by the collective algorithms (called inside `shard_map`)."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax


def axis_size(axis_name) -> int:
    """Static size of a mesh axis (or the product of a tuple of axes)."""
    return int(lax.axis_size(axis_name))


def shift_perm(n: int, shift: int = 1) -> list[tuple[int, int]]:
    """Every rank sends to rank + shift (mod n): one step of a ring."""
    return [(i, (i + shift) % n) for i in range(n)]


def as_chunks(x, n: int):
    """Flattens `x` into (n, c) rows, zero-padding the tail; returns (rows, undo)."""
    size, shape = x.size, x.shape
    c = max(1, math.ceil(size / n))
    flat = x.reshape(-1)
    if c * n != size:
        flat = jnp.pad(flat, (0, c * n - size))

    def undo(rows):
        return rows.reshape(-1)[:size].reshape(shape)

    return flat.reshape(n, c), undo


def split_dim0(x, n: int, what: str):
    """(n*m, ...) -> (n, m, ...) with the tiled semantics of lax.psum_scatter."""
    if x.ndim == 0 or x.shape[0] % n:
        raise ValueError(
            f"{what}: dimension 0 of shape {x.shape} must be divisible by the axis size {n}"
        )
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])


def row(rows, index):
    """rows[index] for a traced index, without materialising anything else."""
    return lax.dynamic_index_in_dim(rows, index, 0, keepdims=False)


def finish(x, op: str, n: int):
    if op == "sum":
        return x
    if op == "mean":
        return x / jnp.asarray(n, x.dtype)
    raise ValueError(f"unknown op {op!r}: use 'sum' or 'mean'")
