"""Horovod's ranks and process sets on a dpjax mesh: `init`, `size`, `rank`,
`local_size`, `local_rank`, `ProcessSet`.

Horovod's ranks are the devices along the mesh's data axes (`node`, `data`): inside a
dpjax step (`dpjax.shard_step(fn, mesh)` or `jax.shard_map(fn, mesh=mesh, ...)`) these
answer for devices; outside a step for processes, as Horovod's do for its workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
from jax import lax

from dpjax import distributed
from dpjax.collectives.ranks import Subgroups, axis_size, index
from dpjax.mesh import bound, data_axes


@dataclass(frozen=True)
class ProcessSet:
    """A subset of the ranks; `ranks=None` is every rank (`global_process_set`)."""

    ranks: tuple[int, ...] | None = None

    def __init__(self, ranks=None):
        object.__setattr__(self, "ranks", None if ranks is None else tuple(int(r) for r in ranks))


global_process_set = ProcessSet()


def add_process_set(ranks) -> ProcessSet:
    """Horovod registers process sets with its runtime; here a set is just its ranks."""
    return ProcessSet(ranks)


def world_axis(axis_name, what: str):
    """The data axes of the mesh being traced: Horovod's one world of ranks."""
    if axis_name is not None:
        return axis_name
    axes = data_axes(jax.sharding.get_abstract_mesh())
    if not axes:
        raise ValueError(f"hvd.{what} called outside a dpjax step (no mesh with data axes): call it inside "
                         f"jax.shard_map(..., mesh=mesh) or dpjax.shard_step(fn, mesh), or pass axis_name=")
    return axes[0] if len(axes) == 1 else axes


def _inside(axis_name) -> bool:
    """Whether the call is inside a step (its data axes bound); False outside any mesh."""
    try:
        return bound(world_axis(axis_name, "rank"))
    except ValueError:  # no mesh with data axes
        return False


def init():
    """Starts jax.distributed when launched as one of several processes (dpjax.launch,
    Open MPI, MPICH and other PMI launchers, SLURM, or a cluster JAX detects: see
    `dpjax.distributed.launchers`); a single process needs nothing."""
    distributed.initialize()


def size(axis_name=None, *, mesh=None):
    """Ranks along the data axes inside a step, or of `mesh`; else processes.

    Outside a step a Horovod script uses rank() and size() to pick the process that
    logs or to split files between data loaders: those count processes (each process
    feeds its own devices' rows). The data-parallel ranks of a mesh, e.g. to scale the
    learning rate, are `size(mesh=mesh)`."""
    if mesh is not None:
        return math.prod(mesh.shape[a] for a in data_axes(mesh))
    return axis_size(world_axis(axis_name, "size")) if _inside(axis_name) else jax.process_count()


def rank(axis_name=None):
    """This device's rank along the data axes inside a step (traced); the process outside."""
    return lax.axis_index(world_axis(axis_name, "rank")) if _inside(axis_name) else jax.process_index()


def local_size(axis_name=None):
    """Ranks of the innermost data axis (a host's devices) inside a step; 1 outside."""
    if not _inside(axis_name):
        return 1
    axis = world_axis(axis_name, "local_size")
    return axis_size(axis if isinstance(axis, str) else axis[-1])


def local_rank(axis_name=None):
    """Rank along the innermost data axis inside a step; the process's local rank outside."""
    if not _inside(axis_name):
        return distributed.local_rank()
    axis = world_axis(axis_name, "local_rank")
    return lax.axis_index(axis if isinstance(axis, str) else axis[-1])


def set_groups(process_set: ProcessSet, n: int, partition: bool):
    """dpjax groups for a process set (None: every rank). For the collectives that change
    shapes, the ranks outside the set form sets of its size among themselves."""
    if process_set.ranks is None:
        return None
    if not partition:
        return [list(process_set.ranks)]
    k, rest = len(process_set.ranks), [r for r in range(n) if r not in process_set.ranks]
    if not k or len(rest) % k:
        raise ValueError(f"process set {list(process_set.ranks)}: the other {len(rest)} of {n} ranks must form "
                         f"sets of its size {k} (every rank returns an array of one shape)")
    return [list(process_set.ranks)] + [rest[i:i + k] for i in range(0, len(rest), k)]


def set_position(axis, groups):
    """This rank's index within its set (its rank when there are no sets)."""
    return lax.axis_index(axis) if groups is None else index(Subgroups(axis, tuple(map(tuple, groups))))
