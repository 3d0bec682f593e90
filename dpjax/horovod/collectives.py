"""Horovod's collectives on dpjax (horovod/torch/mpi_ops.py): `allreduce`,
`grouped_allreduce`, `allgather`, `grouped_allgather`, `broadcast`, `alltoall`,
`reducescatter`, `grouped_reducescatter`, each a thin wrapper over `dpjax.collectives`
with Horovod's arguments and Horovod's gradients (see `dpjax.horovod`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dpjax import collectives as C
from dpjax.collectives import uneven
from dpjax.collectives.ranks import axis_size
from dpjax.collectives.ops import on_wire
from dpjax.compression import Exchange
from dpjax.horovod.compression import Compression
from dpjax.horovod.ranks import global_process_set, set_groups, set_position, world_axis

Sum, Average, Min, Max, Product, Adasum = "sum", "mean", "min", "max", "product", "adasum"


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


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set, *, axis_name=None, algorithm="ring"):
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor, postscale_factor,
                             process_set, axis_name=axis_name, algorithm=algorithm, fusion_mb=0)[0]


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set, *,
                      axis_name=None, algorithm="ring", fusion_mb=64):
    axis, op = world_axis(axis_name, "allreduce"), _op(op, average)
    groups = set_groups(process_set, axis_size(axis, "allreduce"), partition=False)

    def reduce(ts):
        return C.grouped_allreduce(list(ts), axis, op=op, compression=Exchange(compression=compression).summed,
                                   fusion_mb=fusion_mb, algorithm="butterfly" if op == Adasum else algorithm,
                                   groups=groups, prescale_factor=prescale_factor, postscale_factor=postscale_factor)

    return _with_gradient(lambda ts: reduce(ts), lambda g: (reduce(g),), list(tensors))


def _gather_backward(g, axis, groups, sizes):
    """Horovod's allgather gradient: the average over ranks, cut to this rank's piece."""
    mean = C.allreduce(g, axis, op=Average, groups=groups)
    k = axis_size(axis) if groups is None else len(groups[0])
    blocks = mean if sizes is None else uneven.pad_blocks(mean, sizes)
    return lax.dynamic_index_in_dim(blocks.reshape(k, -1, *g.shape[1:]), set_position(axis, groups), 0, False)


def allgather(tensor, name=None, process_set=global_process_set, *, axis_name=None, algorithm="ring",
              sizes=None):
    return grouped_allgather([tensor], name, process_set, axis_name=axis_name, algorithm=algorithm,
                             sizes=sizes, fusion_mb=0)[0]


def grouped_allgather(tensors, name=None, process_set=global_process_set, *, axis_name=None,
                      algorithm="ring", sizes=None, fusion_mb=64):
    axis = world_axis(axis_name, "allgather")
    groups = set_groups(process_set, axis_size(axis, "allgather"), partition=True)

    def gather(ts):
        if sizes is not None:
            return [C.all_gather(t, axis, algorithm=algorithm, sizes=sizes, groups=groups) for t in ts]
        return C.grouped_all_gather(list(ts), axis, algorithm=algorithm, groups=groups, fusion_mb=fusion_mb)

    return _with_gradient(gather, lambda g: ([_gather_backward(t, axis, groups, sizes) for t in g],),
                          list(tensors))


def broadcast(tensor, root_rank, name=None, process_set=global_process_set, *, axis_name=None,
              algorithm="tree"):
    axis = world_axis(axis_name, "broadcast")
    groups = set_groups(process_set, axis_size(axis, "broadcast"), partition=False)
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
    axis = world_axis(axis_name, "alltoall")
    n = axis_size(axis, "alltoall")
    groups = set_groups(process_set, n, partition=True)
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
    axis = world_axis(axis_name, "reducescatter")
    groups = set_groups(process_set, axis_size(axis, "reducescatter"), partition=True)
    k = axis_size(axis) if groups is None else len(groups[0])
    tensors = list(tensors)
    split = [None if t.shape[0] % k == 0 else uneven.default_sizes(t.shape[0], k) for t in tensors]
    scale = (k if op == Sum else 1) * prescale_factor * postscale_factor

    def scatter(ts):
        kw = dict(op=op, algorithm=algorithm, groups=groups, prescale_factor=prescale_factor,
                  postscale_factor=postscale_factor)
        if any(s is not None for s in split) or compression is not None:
            method = Exchange(compression=compression).summed
            return [on_wire(method, t, lambda v, s=s: C.reduce_scatter(v, axis, sizes=s, **kw))
                    for t, s in zip(ts, split)]
        return C.grouped_reduce_scatter(ts, axis, fusion_mb=fusion_mb, **kw)

    def backward(g):  # Horovod: the gradients gathered, times n for Sum and the scale factors
        return ([C.all_gather(t * scale if scale != 1 else t, axis, algorithm=algorithm, groups=groups,
                              sizes=s) for t, s in zip(g, split)],)

    return _with_gradient(scatter, backward, tensors)
