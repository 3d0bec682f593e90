"""Horovod's API on dpjax: code written for Horovod ports by changing its import.

    import dpjax.horovod as hvd        # was: import horovod.torch as hvd

Horovod's ranks are the devices along the mesh's data axes (`node`, `data`), so every
collective here is called inside a dpjax step (`dpjax.shard_step(fn, mesh)` or
`jax.shard_map(fn, mesh=mesh, ...)`), where each rank holds its own tensor; outside a
step `rank()` / `size()` answer for processes, as Horovod's do for its workers. The
names and arguments are Horovod's (Sergeev & Del Balso, "Horovod: fast and easy
distributed deep learning in TensorFlow", 2018; horovod/torch/mpi_ops.py):
`allreduce(tensor, op=Sum|Average|Min|Max|Product|Adasum, prescale_factor=,
postscale_factor=, process_set=)`, `grouped_allreduce`, `allgather`,
`grouped_allgather`, `broadcast(tensor, root_rank)`, `alltoall`, `reducescatter`,
`grouped_reducescatter`, `DistributedOptimizer`, `broadcast_parameters`,
`broadcast_optimizer_state`, `ProcessSet`, `Compression`, `init`, `size`, `rank`,
`local_size`, `local_rank`. Each is a thin wrapper over `dpjax.collectives`; the extra
keywords `axis_name=` and `algorithm=` choose the axes and the explicit algorithm.

Differences a port meets: results are returned (JAX arrays are immutable; Horovod's
in-place `broadcast_` and the async handles have no counterpart); every rank's
tensor has one shape, so `reducescatter` of rows the ranks do not divide evenly
returns Horovod's split padded with zero rows to the largest piece, `allgather` of
pieces of different sizes takes `sizes=[rows of each rank]` with each rank's piece
padded to the largest, and `alltoall` takes no uneven `splits`; ranks outside a
process set keep their own tensor (allreduce, broadcast) or exchange among themselves
(the collectives that change shapes: the set's complement must split into sets of
the same size).

Gradients follow Horovod's, so ported code trains as it did (inside a step whose
autodiff leaves gradients local, `check_vma=False`, as `dpjax.shard_step` builds;
elsewhere differentiating them is an error): the gradient of
`allreduce` is the same allreduce of the gradients (for Min, Max and Product that is
Horovod's rule, not the derivative, which `dpjax.collectives` computes); of
`allgather`, the average of the gradients over ranks, cut to this rank's piece (JAX:
their sum); of `broadcast`, that average on the root and zero elsewhere (JAX: the sum
on the root); of `reducescatter`, the all-gather of the gradients times the size for
Sum (JAX: not scaled) and times the prescale and postscale factors; `alltoall`'s is
the all-to-all of the gradients, as in JAX.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax import lax

from dpjax import collectives as C
from dpjax import data_parallel, distributed
from dpjax.collectives import uneven
from dpjax.collectives._common import Subgroups, axis_size, index
from dpjax.mesh import data_axes

Sum, Average, Min, Max, Product, Adasum = "sum", "mean", "min", "max", "product", "adasum"


class Compression:
    """Horovod's Compression.none / fp16 (and bf16): the dtype floats travel in."""

    none = None
    fp16 = "fp16"
    bf16 = "bf16"


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


# ---------------------------------------------------------------------------------------
# ranks


def _axis(axis_name, what: str):
    """The data axes of the mesh being traced: Horovod's one world of ranks."""
    if axis_name is not None:
        return axis_name
    axes = data_axes(jax.sharding.get_abstract_mesh())
    if not axes:
        raise ValueError(f"hvd.{what} called outside a dpjax step (no mesh with data axes): call it inside "
                         f"jax.shard_map(..., mesh=mesh) or dpjax.shard_step(fn, mesh), or pass axis_name=")
    return axes[0] if len(axes) == 1 else axes


def _inside(axis_name) -> bool:
    try:
        axis_size(_axis(axis_name, "rank"))
        return True
    except ValueError:
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
    return axis_size(_axis(axis_name, "size")) if _inside(axis_name) else jax.process_count()


def rank(axis_name=None):
    """This device's rank along the data axes inside a step (traced); the process outside."""
    return lax.axis_index(_axis(axis_name, "rank")) if _inside(axis_name) else jax.process_index()


def local_size(axis_name=None):
    """Ranks of the innermost data axis (a host's devices) inside a step; 1 outside."""
    if not _inside(axis_name):
        return 1
    axis = _axis(axis_name, "local_size")
    return axis_size(axis if isinstance(axis, str) else axis[-1])


def local_rank(axis_name=None):
    """Rank along the innermost data axis inside a step; the process's local rank outside."""
    if not _inside(axis_name):
        return distributed.local_rank()
    axis = _axis(axis_name, "local_rank")
    return lax.axis_index(axis if isinstance(axis, str) else axis[-1])


def _groups(process_set: ProcessSet, n: int, partition: bool):
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


def _position(axis, groups):
    """This rank's index within its set (its rank when there are no sets)."""
    return lax.axis_index(axis) if groups is None else index(Subgroups(axis, tuple(map(tuple, groups))))


def _with_gradient(forward, backward, *args):
    """forward(*args), differentiated by `backward(cotangent) -> cotangents of args`.

    Horovod's rules reduce the gradients themselves, so they hold where autodiff leaves
    the gradients local: a shard_map with check_vma=False, as `dpjax.shard_step` builds
    (with varying-axes checking on, JAX reduces them on its own, and they would be
    reduced twice)."""
    checked = any(jax.typeof(leaf).manual_axis_type.varying for leaf in jax.tree.leaves(args))

    def bwd(_, g):
        if checked:
            raise ValueError("dpjax.horovod gradients need jax.shard_map(..., check_vma=False), as "
                             "dpjax.shard_step(fn, mesh) builds: with varying-axes checking on, JAX reduces the "
                             "gradients itself and Horovod's rules would reduce them twice")
        return backward(g)

    f = jax.custom_vjp(forward)
    f.defvjp(lambda *a: (forward(*a), None), bwd)
    return f(*args)


def _op(op, average):
    """Horovod's `average=` (deprecated) and `op=` (default Average)."""
    if average is not None:
        return Average if average else Sum
    return Average if op is None else op


# ---------------------------------------------------------------------------------------
# collectives


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set, *, axis_name=None, algorithm="ring"):
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor, postscale_factor,
                             process_set, axis_name=axis_name, algorithm=algorithm, fusion_mb=0)[0]


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set, *,
                      axis_name=None, algorithm="ring", fusion_mb=64):
    axis, op = _axis(axis_name, "allreduce"), _op(op, average)
    groups = _groups(process_set, axis_size(axis, "allreduce"), partition=False)

    def reduce(ts):
        return C.grouped_allreduce(list(ts), axis, op=op, compression=compression, fusion_mb=fusion_mb,
                                   algorithm="butterfly" if op == Adasum else algorithm, groups=groups,
                                   prescale_factor=prescale_factor, postscale_factor=postscale_factor)

    return _with_gradient(lambda ts: reduce(ts), lambda g: (reduce(g),), list(tensors))


def _gather_backward(g, axis, groups, sizes):
    """Horovod's allgather gradient: the average over ranks, cut to this rank's piece."""
    mean = C.allreduce(g, axis, op=Average, groups=groups)
    k = axis_size(axis) if groups is None else len(groups[0])
    blocks = mean if sizes is None else uneven.pad_blocks(mean, sizes)
    return lax.dynamic_index_in_dim(blocks.reshape(k, -1, *g.shape[1:]), _position(axis, groups), 0, False)


def allgather(tensor, name=None, process_set=global_process_set, *, axis_name=None, algorithm="ring",
              sizes=None):
    return grouped_allgather([tensor], name, process_set, axis_name=axis_name, algorithm=algorithm,
                             sizes=sizes, fusion_mb=0)[0]


def grouped_allgather(tensors, name=None, process_set=global_process_set, *, axis_name=None,
                      algorithm="ring", sizes=None, fusion_mb=64):
    axis = _axis(axis_name, "allgather")
    groups = _groups(process_set, axis_size(axis, "allgather"), partition=True)

    def gather(ts):
        if sizes is not None:
            return [C.all_gather(t, axis, algorithm=algorithm, sizes=sizes, groups=groups) for t in ts]
        return C.grouped_all_gather(list(ts), axis, algorithm=algorithm, groups=groups, fusion_mb=fusion_mb)

    return _with_gradient(gather, lambda g: ([_gather_backward(t, axis, groups, sizes) for t in g],),
                          list(tensors))


def broadcast(tensor, root_rank, name=None, process_set=global_process_set, *, axis_name=None,
              algorithm="tree"):
    axis = _axis(axis_name, "broadcast")
    groups = _groups(process_set, axis_size(axis, "broadcast"), partition=False)
    if groups is not None and root_rank not in groups[0]:
        raise ValueError(f"broadcast root_rank {root_rank} is not in the process set {groups[0]}")
    root = root_rank if groups is None else groups[0].index(root_rank)

    def backward(g):  # Horovod: the average of the gradients on the root, zero elsewhere
        mean = C.allreduce(g, axis, op=Average, groups=groups)
        return (jnp.where(lax.axis_index(axis) == root_rank, mean, jnp.zeros_like(mean)),)

    return _with_gradient(lambda t: C.broadcast(t, axis, root=root, algorithm=algorithm, groups=groups),
                          backward, tensor)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set, *, axis_name=None,
             algorithm="pairwise"):
    axis = _axis(axis_name, "alltoall")
    n = axis_size(axis, "alltoall")
    groups = _groups(process_set, n, partition=True)
    if splits is not None and len(set(int(s) for s in splits)) > 1:
        raise ValueError(f"alltoall splits {list(splits)}: uneven splits give ranks outputs of different "
                         f"shapes; pad every piece to one size and pass splits=None")
    return C.all_to_all(tensor, axis, algorithm=algorithm, groups=groups)  # JAX's gradient is Horovod's


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0, *, axis_name=None, algorithm="ring"):
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor, postscale_factor,
                                 axis_name=axis_name, algorithm=algorithm, fusion_mb=0)[0]


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0, *,
                          axis_name=None, algorithm="ring", fusion_mb=64):
    axis = _axis(axis_name, "reducescatter")
    groups = _groups(process_set, axis_size(axis, "reducescatter"), partition=True)
    k = axis_size(axis) if groups is None else len(groups[0])
    tensors = list(tensors)
    split = [None if t.shape[0] % k == 0 else uneven.default_sizes(t.shape[0], k) for t in tensors]
    scale = (k if op == Sum else 1) * prescale_factor * postscale_factor

    def scatter(ts):
        kw = dict(op=op, algorithm=algorithm, groups=groups, prescale_factor=prescale_factor,
                  postscale_factor=postscale_factor)
        if any(s is not None for s in split) or compression is not None:
            return [C.reduce_scatter(_wire(t, compression), axis, sizes=s, **kw).astype(t.dtype)
                    for t, s in zip(ts, split)]
        return C.grouped_reduce_scatter(ts, axis, fusion_mb=fusion_mb, **kw)

    def backward(g):  # Horovod: the gradients gathered, times n for Sum and the scale factors
        return ([C.all_gather(t * scale if scale != 1 else t, axis, algorithm=algorithm, groups=groups,
                              sizes=s) for t, s in zip(g, split)],)

    return _with_gradient(scatter, backward, tensors)


def _wire(t, compression):
    wire = C.grouped.check_compression(compression)
    return t.astype(wire) if wire is not None and jnp.issubdtype(t.dtype, jnp.floating) else t


# ---------------------------------------------------------------------------------------
# training


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         process_set=global_process_set, *, axis_name=None, algorithm=None, fusion_mb=64):
    """Horovod's DistributedOptimizer on an optax optimizer (named_parameters is
    accepted and unused: JAX gradients are pytrees). op=Adasum combines each rank's
    update with Adasum (`dpjax.DistributedOptimizer`). The axes are the data axes of
    the mesh the update runs in."""
    algorithm = algorithm or ("butterfly" if op == Adasum else "ring")

    def build(axis, **groups):
        return data_parallel.DistributedOptimizer(optimizer, axis, algorithm=algorithm, fusion_mb=fusion_mb,
                                                  compression=compression, op=op,
                                                  backward_passes_per_step=backward_passes_per_step,
                                                  gradient_predivide_factor=gradient_predivide_factor, **groups)

    template = build("data")  # checks the arguments now; init does not depend on the axes

    def update(grads, state, params=None):
        axis = _axis(axis_name, "DistributedOptimizer")
        groups = _groups(process_set, axis_size(axis, "DistributedOptimizer"), partition=False)
        return build(axis, **({} if groups is None else {"groups": groups})).update(grads, state, params)

    return optax.GradientTransformation(template.init, update)


def broadcast_parameters(params, root_rank=0, *, axis_name=None, algorithm="tree"):
    """Every rank ends with root_rank's parameters (any pytree); returns them."""
    return data_parallel.broadcast_params(params, _axis(axis_name, "broadcast_parameters"), root=root_rank,
                                          algorithm=algorithm)


broadcast_optimizer_state = broadcast_parameters
