"""dpjax: sharded training on JAX/XLA with explicit, readable collectives."""

from dpjax import collectives
from dpjax.data_parallel import (
    DistributedOptimizer,
    allreduce_gradients,
    broadcast_params,
    shard_batch,
    shard_step,
)
from dpjax.distributed import local_rank, process_index, rank, size
from dpjax.mesh import data_axes, make_mesh, parse_mesh_spec, simulate_cpu_devices
from dpjax import updates
from dpjax.updates import delayed_gradients, make_update_step
from dpjax import horovod

__all__ = [
    "DistributedOptimizer",
    "allreduce_gradients",
    "broadcast_params",
    "collectives",
    "data_axes",
    "delayed_gradients",
    "horovod",
    "local_rank",
    "make_mesh",
    "make_update_step",
    "parse_mesh_spec",
    "process_index",
    "rank",
    "shard_batch",
    "shard_step",
    "simulate_cpu_devices",
    "size",
    "updates",
]
__version__ = "0.1.0"
