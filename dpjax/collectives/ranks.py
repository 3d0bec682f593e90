"""How a collective addresses its ranks, and the chunking every algorithm shares (inside `shard_map`).

Public to the packages above (compression, compute, tasks, horovod, models): they size and
number their ranks with the same `axis_size` / `index` the algorithms use, and so inherit its
one-line error outside a mesh context and its `Subgroups` view.

An algorithm addresses its ranks only through `axis_size`, `index` and `permute`. Over
a mesh axis (or a tuple of axes) they are `lax.axis_size`, `lax.axis_index` and
`lax.ppermute`. Over a `Subgroups` view (process sets: `groups=` in the public calls)
they number the ranks inside each group and map every point-to-point pair onto the
members of every group at once, so each algorithm runs within groups unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax

from dpjax import links, scopes
from dpjax.mesh import bound


@dataclass(frozen=True)
class Subgroups:
    """Disjoint groups of one size k along `axis`: `members[g][i]` is rank i of group g.

    Ranks in no group compute along (as rank 0 of no group: they send nothing and
    receive zeros) and their result is discarded by the caller (`groups.run`)."""

    axis: object
    members: tuple[tuple[int, ...], ...]


def _unbound(axis_name, what: str) -> ValueError:
    return ValueError(
        f"{what} over axis {axis_name!r} called outside a mesh context (the axis name is unbound): "
        f"call it inside jax.shard_map(..., mesh=mesh) or dpjax.shard_step(fn, mesh)")


def axis_size(axis_name, what: str = "a collective") -> int:
    """Static size of a mesh axis (or the product of a tuple of axes, or a group's size).

    Outside a mesh context JAX would raise `NameError: unbound axis name` from deep
    inside the first collective; this names the axis and what to wrap the call in."""
    if isinstance(axis_name, Subgroups):
        return len(axis_name.members[0])
    if not bound(axis_name):
        raise _unbound(axis_name, what)
    return int(lax.axis_size(axis_name))


def index(axis_name):
    """This rank's index along the axis (within its group for a `Subgroups` view)."""
    if isinstance(axis_name, Subgroups):
        where = [0] * axis_size(axis_name.axis)
        for g in axis_name.members:
            for i, r in enumerate(g):
                where[r] = i
        return jnp.asarray(where, jnp.int32)[lax.axis_index(axis_name.axis)]
    return lax.axis_index(axis_name)


def permute(x, axis_name, pairs):
    """`lax.ppermute` with (source, target) pairs numbered along the axis (within each group).

    Every point-to-point step of every algorithm passes here, so this is also where an
    emulated slow link (`dpjax.links`) learns which steps cross it and what they carry,
    and where each step gets its name in the compiled program (`dpjax.scopes`: the
    step's place in the schedule and its bytes, for `dpjax.timeline`)."""
    if isinstance(axis_name, Subgroups):
        pairs = [(g[s], g[t]) for g in axis_name.members for s, t in pairs]
        axis_name = axis_name.axis
    nbytes = x.size * x.dtype.itemsize
    links.account(axis_name, pairs, nbytes)
    with scopes.p2p_step(nbytes):
        return lax.ppermute(x, axis_name, pairs)


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


def split_dim0(x, n: int, what: str, hint: str = ""):
    """(n*m, ...) -> (n, m, ...) with the tiled semantics of lax.psum_scatter."""
    if x.ndim == 0 or x.shape[0] % n:
        raise ValueError(f"{what}: dimension 0 of shape {x.shape} must be divisible by the axis size {n}{hint}")
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])


def row(rows, index):
    """rows[index] for a traced index, without materialising anything else."""
    return lax.dynamic_index_in_dim(rows, index, 0, keepdims=False)
