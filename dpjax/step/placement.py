"""The values a step's programs take, placed in their shardings without a device ever
holding the whole: the parameters (`init_params`, made by a jitted init in place), the
global batch (`put_batch`, each process reading only its devices' rows), a replicated
value's sharding (`replicated`); and a tree's size in bytes (`num_bytes`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.mesh import data_axes
from dpjax.sharding import Layout


def init_params(model, layout: Layout, key, policy=None, keep=None):
    """The model's parameters, created by a jitted init directly in their sharding: no
    device ever holds a whole sharded weight, and the values do not depend on the mesh
    (jax's partitionable threefry). policy: a `dpjax.compute.policy.Policy` whose param_dtype the
    master weights take (default: as the model makes them, float32); keep: a
    `dpjax.recovery.programs.Programs.keep` (the compiled init kept across restarts)."""
    store = (lambda p: p) if policy is None else policy.store
    init = jax.jit(lambda k: store(layout.store(model.init(k))), out_shardings=layout.shardings())
    return (init if keep is None else keep("init_params", init))(key)


def replicated(mesh):
    return NamedSharding(mesh, P())


def put_batch(stream, cursor: int, global_batch: int, mesh, passes: int | None = None, rows: int | None = None):
    """The global batch at `cursor` as one sharded array; each process reads only the rows
    its devices hold, each once (the devices along `model` that share a block get one
    read). passes=A: A consecutive batches stacked, A x B x T+1 (the train step's
    micro-batches). A stream whose batch is a dict of arrays (a task's: `dpjax.tasks`)
    gives a dict of sharded arrays, every leaf split by rows alike. rows: the rows a batch
    of `global_batch` examples fills when not one each (packed: `dpjax.data.sft.PackedStream`);
    the cursor still moves by examples."""
    R = global_batch if rows is None else rows
    axes = data_axes(mesh) or None
    lead: tuple[int, ...]
    read = {}  # block index -> rows read: the callback runs once per device, not per block

    def once(key, fn):
        if key not in read:
            read[key] = fn()
        return read[key]

    spec, lead = (P(axes), (R,)) if passes is None else (P(None, axes), (passes, R))

    def block(idx):
        if passes is None:
            return once(idx[0].indices(R), lambda: stream.batch(cursor, global_batch, rows=idx[0]))
        return once((idx[0].indices(passes), idx[1].indices(R)), lambda: _stacked(
            [stream.batch(cursor + k * global_batch, global_batch, rows=idx[1]) for k in range(passes)[idx[0]]]))

    sharding = NamedSharding(mesh, spec)
    shape = (*lead, stream.seq_len + 1)
    first = block(next(iter(sharding.addressable_devices_indices_map(shape).values())))
    if not isinstance(first, dict):
        return jax.make_array_from_callback(shape, sharding, block)

    def part(k):  # the callback of the leaf `k`
        return lambda idx: block(idx)[k]

    return {k: jax.make_array_from_callback((*lead, *v.shape[len(lead):]), sharding, part(k))
            for k, v in first.items()}


def _stacked(batches):
    if isinstance(batches[0], dict):
        return {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    return np.stack(batches)


def num_bytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
