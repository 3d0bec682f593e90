"""Per-device random streams inside a data-parallel step.

A key passed into a step is replicated: every device holds the same one, so every
device draws the same numbers, and dropout applies the same mask to row i of every
device's slice of the batch (a correlated mask, not the independent one that one
device with the whole batch would draw). `device_key(key)` is the key folded with
the device's index along the mesh's data axes (`jax.random.fold_in`, as big_vision
and MaxText derive per-host keys): one independent stream per data-parallel rank,
reproducible from the seed. The ranks of the `model` axis that share a batch shard
share the stream too, since a tensor-parallel layer must apply one mask to an
activation they all hold whole (Megatron-LM keeps such a "model-parallel" RNG state).

Outside a mesh (plain single-device code) there is one stream, and the key comes back
unchanged, so the same model code runs in both.

`dpjax.shard_step` applies this to every `nnx.Rngs` stream of the modules it is given
(`fold_rng_keys`), and restores the stored keys afterwards so that the modules' state
stays replicated: draws advance each stream's counter, which is the same everywhere.
"""

from __future__ import annotations

import jax
from jax import lax

from dpjax.mesh import NOT_DATA, bound


def bound_data_axes() -> tuple:
    """The data axes of the mesh the code is running under (inside `shard_map`), size > 1."""
    names = jax.sharding.get_abstract_mesh().axis_names
    return tuple(a for a in names if a not in NOT_DATA and bound(a) and lax.axis_size(a) > 1)


def device_index():
    """This device's rank over the data axes (row-major over them, outermost first); 0 outside a mesh."""
    axes = bound_data_axes()
    return lax.axis_index(axes if len(axes) > 1 else axes[0]) if axes else 0


def device_key(key):
    """`key` folded with this device's data-parallel rank (see the module docstring);
    unchanged outside a mesh. Works for typed keys and raw uint32 keys alike."""
    return jax.random.fold_in(key, device_index()) if bound_data_axes() else key


def fold_rng_keys(values, is_key):
    """values with device_key applied where is_key[i] (the nnx.RngKey leaves)."""
    return [device_key(v) if k else v for v, k in zip(values, is_key)]
