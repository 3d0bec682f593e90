"""Hierarchical collectives over two axes (outer, inner): Horovod's hierarchical allreduce.

Inside a group of L fast-linked ranks (a host, the `data` axis) reduce-scatter; across
the G groups (the `node` axis, the slow links) allreduce only the 1/L slice each rank
owns; inside the group all-gather again. Sergeev & Del Balso, "Horovod" (2018), and
`HOROVOD_HIERARCHICAL_ALLREDUCE`; the same shape as NCCL's tree/ring split across nodes.

Per device, N the bytes of the vector, with ring phases:

    inside  2(L-1) steps, 2(L-1)/L * N bytes
    across  2(G-1) steps, 2(G-1)/G * N/L bytes   (ring; another algorithm by `outer_algorithm`)

so each rank's traffic across groups is 1/L of what a flat ring over the G groups
would send (and a flat ring over all G*L ranks sends 2(n-1)/n * N through its boundary ranks).

A single axis name (not a pair) is the one-level case: the inner level alone over
that axis (G = 1, no outer phase), i.e. the ring. A caller that exchanges over one
data axis at a time can keep `algorithm="hierarchical"` for every axis.
"""

from __future__ import annotations

import math

from dpjax.collectives import calls, ring
from dpjax.collectives.ranks import as_chunks, axis_size, split_dim0
from dpjax.collectives.cost import Schedule, no_model
from dpjax.collectives.registry import Algorithm, register


def _axes(axis_name):
    """(outer or None, inner)."""
    if isinstance(axis_name, str):
        return None, axis_name
    if not (isinstance(axis_name, (tuple, list)) and len(axis_name) == 2):
        raise ValueError(
            f"hierarchical collectives need axis_name=(outer, inner) or one axis name, got {axis_name!r}"
        )
    return tuple(axis_name)


def _sizes(axis_name):
    outer, inner = _axes(axis_name)
    return outer, inner, (1 if outer is None else axis_size(outer)), axis_size(inner)


def allreduce(x, axis_name, *, op: str = "sum", outer_algorithm: str = "ring"):
    outer, inner, G, L = _sizes(axis_name)
    rows, undo = as_chunks(x, L)
    mine = rows[0] if L == 1 else ring.reduce_scatter_rows(rows, inner, L, op)
    if G > 1:  # the public call finishes "mean" itself, so the outer level only combines
        mine = calls.allreduce(mine, outer, algorithm=outer_algorithm, op="sum" if op == "mean" else op)
    full = mine[None] if L == 1 else ring.all_gather_rows(mine, inner, L)
    return undo(full)


def reduce_scatter(x, axis_name, *, op: str = "sum"):
    """Tiled on dimension 0 over the linearised (outer, inner) index, like lax.psum_scatter."""
    outer, inner, G, L = _sizes(axis_name)
    rows = split_dim0(x, G * L, "reduce_scatter")
    # chunk (g, l) sits at row g*L + l; group rows by inner rank first.
    by_inner = rows.reshape(G, L, *rows.shape[1:]).swapaxes(0, 1)
    mine = by_inner[0] if L == 1 else ring.reduce_scatter_rows(by_inner, inner, L, op)  # (G, ...)
    return mine[0] if G == 1 else ring.reduce_scatter_rows(mine, outer, G, op)


def all_gather(x, axis_name):
    outer, inner, G, L = _sizes(axis_name)
    across = x[None] if G == 1 else ring.all_gather_rows(x, outer, G)  # (G, ...)
    full = across[None] if L == 1 else ring.all_gather_rows(across, inner, L)  # (L, G, ...)
    return full.swapaxes(0, 1).reshape(G * L * x.shape[0], *x.shape[1:])


def cost(primitive: str, n: int, nelems: int, itemsize: int, groups: int = 1) -> Schedule:
    """n: the inner size L, groups: G. The inner ring phases on the fast links (`steps`,
    `bytes`), the outer ring on 1/L of the vector on the slow ones (`outer_*`)."""
    if primitive not in ("allreduce", "reduce_scatter", "all_gather"):
        raise no_model(primitive, "hierarchical")
    L, G = n, groups
    c = math.ceil(nelems / L) if primitive == "allreduce" else nelems // (G * L) * G
    inner = ring.cost(primitive, L, c * L, itemsize)
    outer = ring.cost(primitive, G, c, itemsize)
    return Schedule(inner.steps, inner.bytes, outer.steps, outer.bytes)


# axis_name is (outer, inner) in that order, not one flattened axis; a process set
# numbers the ranks of one axis, so the two levels take none
register(Algorithm("hierarchical", cost, allreduce=allreduce, reduce_scatter=reduce_scatter, all_gather=all_gather,
                   groups=False, nested_axes=True))
