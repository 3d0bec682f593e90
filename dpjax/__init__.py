"""dpjax: sharded training on JAX/XLA with explicit, readable collectives."""

from dpjax import collectives
from dpjax.data_parallel import (
    DistributedOptimizer,
    allreduce_gradients,
    broadcast_params,
    shard_batch,
    shard_step,
)
from dpjax.distributed import local_rank, process_count, process_index
from dpjax.errors import UserError
from dpjax.replicas import ReplicationError
from dpjax.rng import device_key
from dpjax.mesh import data_axes, dp_size, make_mesh, parse_mesh_spec, simulate_cpu_devices
from dpjax import sharding_rules, updates
from dpjax.updates import delayed_gradients
from dpjax.step import Exchange, make_update_step
from dpjax import horovod

__all__ = [
    "DistributedOptimizer",
    "Exchange",
    "ReplicationError",
    "UserError",
    "allreduce_gradients",
    "broadcast_params",
    "collectives",
    "data_axes",
    "delayed_gradients",
    "device_key",
    "dp_size",
    "horovod",
    "local_rank",
    "make_mesh",
    "make_update_step",
    "parse_mesh_spec",
    "process_count",
    "process_index",
    "sharding_rules",
    "shard_batch",
    "shard_step",
    "simulate_cpu_devices",
    "updates",
]
__version__ = "0.1.0"
