"""Explicit collective algorithms, dispatched by name. Call these inside `jax.shard_map`.

Every algorithm except the `"psum"` baseline is written as point-to-point
`lax.ppermute` steps plus local arithmetic, so the schedule a gradient follows across
the machines is there to read. Each matches `lax.psum` / `lax.psum_scatter` /
`lax.all_gather` (tiled, dimension 0) for any shape, float dtype and axis size >= 1.
`axis_name` may be a tuple of axes; `"hierarchical"` requires exactly `(outer, inner)`,
the others treat a tuple as one flattened axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dpjax.collectives import butterfly, hierarchical, ps, ring, tree
from dpjax.collectives._common import axis_size, finish, split_dim0

ALGORITHMS = ("psum", "ring", "butterfly", "tree", "ps", "hierarchical")
REDUCE_SCATTER_ALGORITHMS = ("psum", "ring", "butterfly", "hierarchical")
ALL_GATHER_ALGORITHMS = ("psum", "ring", "butterfly", "hierarchical")
BROADCAST_ALGORITHMS = ("psum", "tree", "ring")

__all__ = [
    "ALGORITHMS",
    "ALL_GATHER_ALGORITHMS",
    "BROADCAST_ALGORITHMS",
    "REDUCE_SCATTER_ALGORITHMS",
    "all_gather",
    "allreduce",
    "broadcast",
    "check_algorithm",
    "reduce_scatter",
]


def check_algorithm(algorithm: str, known=ALGORITHMS, what: str = "allreduce") -> str:
    if algorithm not in known:
        raise ValueError(f"unknown {what} algorithm {algorithm!r}; choose one of {', '.join(known)}")
    return algorithm


def _mesh_ordered(axis_name, what: str, reorder: bool):
    """A tuple of axes in the mesh's order. ppermute numbers the ranks of a tuple of
    axes in mesh order while lax.axis_index follows the tuple's order, so a schedule
    over an out-of-order tuple would send to the wrong ranks. A sum does not care
    about the order (`reorder`); a scatter, gather or root does, so it must be given
    in mesh order."""
    if not isinstance(axis_name, (tuple, list)):
        return axis_name
    names = jax.sharding.get_abstract_mesh().axis_names
    if any(a not in names for a in axis_name):
        return tuple(axis_name)  # not inside a mesh context: let lax report it
    ordered = tuple(sorted(axis_name, key=names.index))
    if ordered != tuple(axis_name) and not reorder:
        raise ValueError(f"{what} over axes {tuple(axis_name)}: give them in the mesh's order {ordered}")
    return ordered


def _psum_allreduce(x, axis_name, *, op="sum"):
    return finish(lax.psum(x, axis_name), op, axis_size(axis_name))


_ALLREDUCE = {
    "psum": _psum_allreduce,
    "ring": ring.allreduce,
    "butterfly": butterfly.allreduce,
    "tree": tree.allreduce,
    "ps": ps.allreduce,
    "hierarchical": hierarchical.allreduce,
}


def allreduce(x, axis_name, *, algorithm: str = "ring", op: str = "sum", **options):
    """Sum (op="sum") or average (op="mean") of `x` over `axis_name`, on every rank.

    options: `num_servers` for "ps"; `outer_algorithm` for "hierarchical".
    """
    finish(x, op, 1)  # validates `op` before any communication is traced
    check_algorithm(algorithm)
    if algorithm != "hierarchical":
        axis_name = _mesh_ordered(axis_name, "allreduce", reorder=True)
    return _ALLREDUCE[algorithm](x, axis_name, op=op, **options)


def reduce_scatter(x, axis_name, *, algorithm: str = "ring", op: str = "sum"):
    """Like `lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)`."""
    check_algorithm(algorithm, REDUCE_SCATTER_ALGORITHMS, "reduce_scatter")
    n = axis_size(axis_name)
    split_dim0(x, n, "reduce_scatter")  # the same ValueError for every algorithm
    if algorithm != "hierarchical":
        axis_name = _mesh_ordered(axis_name, "reduce_scatter", reorder=False)
    if algorithm == "psum":
        return finish(lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True), op, n)
    mod = {"ring": ring, "butterfly": butterfly, "hierarchical": hierarchical}[algorithm]
    return mod.reduce_scatter(x, axis_name, op=op)


def all_gather(x, axis_name, *, algorithm: str = "ring"):
    """Like `lax.all_gather(x, axis_name, axis=0, tiled=True)`."""
    check_algorithm(algorithm, ALL_GATHER_ALGORITHMS, "all_gather")
    if jnp.ndim(x) == 0:
        raise ValueError("all_gather is tiled on dimension 0 and needs an array with one; got a scalar "
                         "(reshape it to (1,))")
    if algorithm != "hierarchical":
        axis_name = _mesh_ordered(axis_name, "all_gather", reorder=False)
    if algorithm == "psum":
        return lax.all_gather(x, axis_name, axis=0, tiled=True)
    mod = {"ring": ring, "butterfly": butterfly, "hierarchical": hierarchical}[algorithm]
    return mod.all_gather(x, axis_name)


def broadcast(x, axis_name, *, root: int = 0, algorithm: str = "tree"):
    """Every rank along `axis_name` ends with the value `root` holds."""
    check_algorithm(algorithm, BROADCAST_ALGORITHMS, "broadcast")
    axis_name = _mesh_ordered(axis_name, "broadcast", reorder=False)
    if algorithm == "psum":
        n = axis_size(axis_name)
        if not 0 <= root < n:
            raise ValueError(f"broadcast root {root} is outside the axis of size {n}")
        mine = lax.axis_index(axis_name) == root
        return lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axis_name)
    return {"tree": tree, "ring": ring}[algorithm].broadcast(x, axis_name, root=root)
