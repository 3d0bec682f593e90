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

from dpjax.horovod.collectives import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from dpjax.horovod.compression import Compression
from dpjax.horovod.optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from dpjax.horovod.ranks import (
    ProcessSet,
    add_process_set,
    global_process_set,
    init,
    local_rank,
    local_size,
    rank,
    size,
)

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "Max", "Min", "ProcessSet", "Product", "Sum",
    "add_process_set", "allgather", "allreduce", "alltoall", "broadcast", "broadcast_optimizer_state",
    "broadcast_parameters", "global_process_set", "grouped_allgather", "grouped_allreduce",
    "grouped_reducescatter", "init", "local_rank", "local_size", "rank", "reducescatter", "size",
]
