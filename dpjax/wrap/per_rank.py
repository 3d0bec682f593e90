"""State that differs from rank to rank, carried through `dpjax.shard_step`.

`DistributedOptimizer(..., compression="powersgd:4")` keeps each rank's error buffer in
`DistributedState.compression.error` (`dpjax.compression.feedback`): what this rank's
last compressed exchange dropped, which differs between ranks by design. Everything
else `shard_step` carries is replicated or split by its sharding metadata, so the buffer
needs a layout of its own: outside the step it is one array with a leading axis of one
slot a rank, `(ranks, *shape)`, split over the data axes (a checkpoint saves every
rank's buffer); inside, each device sees its own slot as `shape`, the layout the
optimizer was written for. `tx.init` runs outside any mesh and makes one zero buffer:
the first call spreads it into the slots (all zero alike).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.mesh import as_axes, data_axes

FIELDS = ("compression", "error")  # where a DistributedState keeps the per-rank part


class DistributedState(NamedTuple):
    """`DistributedOptimizer`'s state (`dpjax.data_parallel`), here beside the code that
    finds its per-rank part, which `shard_step` (`dpjax.wrap.arguments`, `dpjax.wrap.program`) imports."""

    inner: Any  # the inner optax state
    passes: jax.Array  # backward passes accumulated so far (mod backward_passes_per_step)
    accumulated: Any  # sum of local gradients since the last exchange (or ())
    compression: object = ()  # this rank's error feedback (dpjax.compression.feedback.State), or ()


def _is_state(x) -> bool:
    return isinstance(x, DistributedState)


def nnx_prefixes(graph) -> list[tuple]:
    """The state paths (plain keys) under which NNX objects keep per-rank buffers, from
    their graph's (path, node) pairs (`nnx.iter_graph`)."""
    return [tuple(path) + FIELDS for path, node in graph if _is_state(node)]


def tree_prefixes(tree) -> list[tuple]:
    """The same for a pytree argument (a Linen TrainState's opt_state, a bare state)."""
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_state)[0]
    return [tuple(_key(k) for k in path) + FIELDS for path, node in found if _is_state(node)]


def under(keys: tuple, prefixes) -> bool:
    return any(keys[:len(p)] == p for p in prefixes)


def _key(k):
    return getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))


def keys_of(path) -> tuple:
    """Plain keys of a jax key path (DictKey, SequenceKey, GetAttrKey alike)."""
    return tuple(_key(k) for k in path)


def spec(own: P, mesh) -> P:
    """A slot a rank on the leading axis, split over the data axes; the buffer's own
    dimensions keep the spec of the parameter it mirrors."""
    return P(data_axes(mesh), *own)


def ranks(mesh) -> int:
    return math.prod(mesh.shape[a] for a in data_axes(mesh))


def spread(x, mesh, layout: P):
    """`x` in the slot layout: as it is when it is there already (it came back from an
    earlier call, or from a checkpoint restored like it); else one buffer copied into
    every slot."""
    n = ranks(mesh)
    sharding = getattr(x, "sharding", None)
    if (isinstance(sharding, NamedSharding) and sharding.mesh.shape == mesh.shape and x.ndim >= 1
            and x.shape[0] == n and as_axes(_entry(sharding.spec)) == as_axes(_entry(layout))):
        return x
    return jnp.broadcast_to(jnp.asarray(x)[None], (n, *jnp.shape(x)))


def _entry(spec):
    """The spec's entry for the leading dimension (None when it names none)."""
    return tuple(spec)[0] if len(spec) else None


def local(x):
    """Inside the step: this device's slot, shaped as the optimizer made it."""
    assert x.shape[0] == 1, f"per-rank slot {x.shape}: one slot a device"
    return x[0]


def slot(x):
    return x[None]
