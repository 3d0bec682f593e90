"""dpjax: sharded training on JAX/XLA with explicit, readable collectives.

Shape names. An array's name ends in its shape, one letter per dimension, each letter
with one meaning across the package; a dimension split over mesh axes carries their
initials (`Bd`: the batch split over the data axes, `Fm`: F split over `model`, `Ls`:
the layers split over `stage`). Outside a shard_map the name is the global array,
inside it this device's block, and every shard_map body asserts its local shapes.

    B  sequences in a batch          A  accumulated micro-batches (--backward-passes)
    T  tokens in a sequence (T1: +1) M  pipeline micro-batches (--microbatches)
    D  model width (d_model)         L  layers of a stack
    F  MLP width (d_ff)              S  pipeline stages
    H  attention heads               W  workers of an update rule
    K  width of one head             R  slots of an update rule's history (its delay)
    V  vocabulary                    P  a parameter's own shape (any rank)
    E  embedding width (mlp)         N  elements of a flattened buffer
    C  context window (mlp)          U  unique values (the replica check)

Scalars are words, not letters: `delay` (delayed:T), `tau` (async:TAU), `period`
(sparse:P), `virtual_stages` (V in the papers' bubble formulas).
"""

from dpjax import collectives
from dpjax.data_parallel import (
    DistributedOptimizer,
    allreduce_gradients,
    broadcast_params,
    process_rows,
    shard_batch,
)
from dpjax.wrapper import shard_step
from dpjax.distributed import local_rank, process_count, process_index
from dpjax.errors import UserError
from dpjax.replicas import ReplicationError
from dpjax.rng import device_key
from dpjax.mesh import data_axes, dp_size, make_mesh, parse_mesh_spec, simulate_cpu_devices
from dpjax import attention, sharding_rules, stack, updates
from dpjax.policy import Policy
from dpjax.updates import delayed_gradients
from dpjax.step import Exchange, make_update_step
from dpjax import horovod

__all__ = [
    "DistributedOptimizer",
    "Exchange",
    "Policy",
    "ReplicationError",
    "UserError",
    "allreduce_gradients",
    "attention",
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
    "process_rows",
    "sharding_rules",
    "shard_batch",
    "shard_step",
    "simulate_cpu_devices",
    "stack",
    "updates",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`dpjax.nn` (the tensor-parallel flax layers) after a plain `import dpjax`, loaded
    when first used: `import dpjax` itself does not import flax."""
    if name == "nn":
        import importlib

        return importlib.import_module("dpjax.nn")
    raise AttributeError(f"module 'dpjax' has no attribute {name!r}")
