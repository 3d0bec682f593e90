"""dpjax: sharded training on JAX/XLA with explicit, readable collectives.

Shape names. An array's name ends in its shape, one letter per dimension, each letter
with one meaning across the package; a dimension split over mesh axes carries their
initials (`Bd`: the batch split over the data axes, `Fm`: F split over `model`, `Ls`:
the layers split over `stage`). Outside a shard_map the name is the global array,
inside it this device's block, and every shard_map body asserts its local shapes.

    B  sequences in a batch (or in one micro-batch, beside M)
    T  tokens in a sequence (T1: one more, the targets' shift; T2: the keys', where a mask or
       a block pairs queries with other positions)
    D  model width (d_model)
    F  MLP width (gpt's d_ff, mlp's d_hidden)
    H  attention heads
    K  width of one head
    Y  key/value heads (grouped-query attention: H/Y query heads share one)
    O  positions a generation's KV cache holds (its longest sequence)
    V  vocabulary
    E  embedding width (mlp)
    C  the mlp's input window (context x E)
    A  accumulated micro-batches (--backward-passes)
    M  pipeline micro-batches (--microbatches)
    L  layers of a stack (or of one chunk, beside G)
    S  pipeline stages
    G  chunks of a stage's layers (virtual stages)
    W  workers of an update rule
    R  slots of a rule's history (delayed:T keeps T, async:TAU keeps TAU + 1)
    P  a parameter's own shape (any rank)
    N  elements of a flat buffer (a fusion bucket, a rank's row, a quantised block; a
       mixture's tokens, an expert's slots)
    I  ranks along an axis (a row each)
    J  shards of a tensor (compression's per-shard form)
    Q  values a sparse compression picks (top-k's and random-k's k)
    Z  blocks of a quantised buffer (one scale each)
    U  uint32 words of a block's bits (the replica check's fingerprint)
    X  experts of a mixture (E in the papers; dpjax.models.moe)

Axis initials, lower case after a letter: d data, m model, n node, s stage, c context, e expert.
tests/test_shape_letters.py reads this table and the package's names.

Scalars are words, not letters: `delay` (delayed:T), `tau` (async:TAU), `period`
(sparse:P), `virtual_stages` (V in the papers' bubble formulas).
"""

import importlib
import importlib.abc
import importlib.util
import os
import sys

from dpjax import interrupt

interrupt.while_starting()  # `python -m dpjax.<tool>`: a Ctrl-C while this package imports is one line, status 130


def _models_beside_the_package():
    """`dpjax.models` is the repository's top-level `models/` folder (DESIGN.md's layout). A
    regular install holds it inside the package (pyproject's package-dir copies it into the
    wheel's dpjax/models/). A clone run without an install (`python -m dpjax.train` in its
    root) has no dpjax/models/, and neither has an editable install whose root is on sys.path:
    a `dpjax/` folder found on sys.path hides setuptools' package-dir mapping. Then the one
    name `dpjax.models` is mapped to the `models/` beside this package, nothing else (the
    clone's tests/ and experiments/ stay outside it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    top = os.path.join(os.path.dirname(here), "models")
    if os.path.isdir(os.path.join(here, "models")) or not os.path.isfile(os.path.join(top, "__init__.py")):
        return

    class ModelsFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != "dpjax.models":
                return None
            return importlib.util.spec_from_file_location(fullname, os.path.join(top, "__init__.py"),
                                                          submodule_search_locations=[top])

    if not any(type(f).__name__ == "ModelsFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, ModelsFinder())


_models_beside_the_package()

if interrupt.computes():  # not in `python -m dpjax.agent`'s process: it imports no JAX (interrupt.computes)
    from dpjax import collectives
    from dpjax.data_parallel import (DistributedOptimizer, allreduce_gradients, broadcast_params, process_rows,
                                     shard_batch)
    from dpjax.wrap.wrapper import shard_step
    from dpjax.wrap.jit import jit
    from dpjax.wrap.global_batch import global_sum, weighted_mean
    from dpjax.distributed import local_rank, process_count, process_index
    from dpjax.errors import UserError
    from dpjax.wrap.replicas import ReplicationError
    from dpjax.wrap.rng import device_key
    from dpjax.mesh import data_axes, dp_size, make_mesh, parse_mesh_spec
    from dpjax.collectives.cpu_runtime import cpu_guards, simulate_cpu_devices
    from dpjax import sharding_rules, updates
    from dpjax.compute import attention, stack
    from dpjax.compute.policy import Policy
    from dpjax.updates import delayed_gradients
    from dpjax.compression import Exchange  # re-exported from its one address
    from dpjax.step import make_update_step
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
    "cpu_guards",
    "data_axes",
    "delayed_gradients",
    "device_key",
    "dp_size",
    "global_sum",
    "horovod",
    "jit",
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
    "weighted_mean",
]
__version__ = "0.1.0"
interrupt.started()  # Ctrl-C is Python's KeyboardInterrupt again (the tool's own handling takes it)


def __getattr__(name: str):
    """`dpjax.nn` (the tensor-parallel flax layers) after a plain `import dpjax`, loaded
    when first used: `import dpjax` itself does not import flax."""
    if name == "nn":
        return importlib.import_module("dpjax.nn")
    raise AttributeError(f"module 'dpjax' has no attribute {name!r}")
