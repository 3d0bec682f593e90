"""The hierarchical per-shard form of a compressed exchange between sites.

With `--workers node --compress-axes node` the workers are sites of k devices, and each
worker's gradient is already the exact mean over its own devices (`dpjax.step`'s
allreduce inside the worker: a reduce-scatter and an all-gather on the fast link).
Every device of a site then holds the same tensor; sending it whole from each of them
would put k copies on the slow link. The per-shard form (the hierarchical allreduce's
shape, with the compression on its outer phase only):

    inside the site   device i of the k keeps the i-th shard of every tensor (a slice:
                      the site's exact mean is already there)
    across sites      the compressed exchange (error feedback, or the allreduce of a
                      cast) of that shard only, between the devices with the same i:
                      k times fewer bytes per device across the link
    inside the site   an exact all-gather of the k shards (one fused buffer per dtype)

A tensor's shard: its matrix view (the cut nearest to square, as PowerSGD views it; a
vector as it is) turned so that the longer side comes first, padded with zero rows to
a multiple of k, rows i r .. (i+1) r. PowerSGD then factors each row block (a rank-R
approximation per block, a Q per block); the other methods see only the shard's values.
The error buffers and PowerSGD's Q mirror the shards: per device, with a leading slot
on every mesh axis but the workers' (`Shards.slot`), so checkpoints hold each device's.

FSDP is per shard already (each device exchanges its own shard of the gradient), so the
plan gives no `Shards` there. `dpjax.compression.exchange.Exchange.mean` runs the form
(split, the exchange across, join); this module cuts, joins and lays out the state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dpjax.collectives import all_gather
from dpjax.compression import feedback, powersgd
from dpjax.mesh import axis_arg
from dpjax.wrap import per_rank


@dataclass(frozen=True)
class Shards:
    """Where the per-shard form cuts: `axes`, the data axes inside a worker (mesh order),
    `size` devices along them; `slot`, every mesh axis but the workers' (a device's state
    differs along each)."""
    axes: tuple
    size: int
    slot: tuple

    @property
    def axis(self):
        return axis_arg(self.axes)


def _view(shape) -> tuple[tuple, bool]:
    """(the 2-D (or 1-D) view with the longer side first, whether it is the transpose)."""
    if len(shape) < 2:
        return (math.prod(shape),), False
    a, b = powersgd.matrix_view(shape)
    return ((a, b), False) if a >= b else ((b, a), True)


def shard_shape(shape, k: int) -> tuple:
    """The shape of one device's shard of a tensor of `shape`, cut k ways."""
    view, _ = _view(tuple(shape))
    return (-(-view[0] // k), *view[1:])


def split(x, k: int, i):
    """Device i's shard of x (i traced: the device's index inside the site)."""
    view, turned = _view(x.shape)
    m = x.reshape(view[::-1]).T if turned else x.reshape(view)
    rows = -(-view[0] // k)
    m = jnp.pad(m, [(0, rows * k - view[0])] + [(0, 0)] * (m.ndim - 1))
    return lax.dynamic_slice_in_dim(m, i * rows, rows, 0)


def _unsplit(blocks_J, shape):
    """The tensor of `shape` from its k shards stacked (k, rows, ...)."""
    view, turned = _view(tuple(shape))
    m = blocks_J.reshape(-1, *blocks_J.shape[2:])[:view[0]]
    return (m.T if turned else m).reshape(shape)


def join(shards, like, sh: Shards):
    """Every tensor of `like` from the site's shards of it (`shards`, this device's): one
    exact all-gather over `sh.axes` per dtype, inside the site."""
    leaves, treedef = jax.tree.flatten(shards)
    shapes = [x.shape for x in jax.tree.leaves(like)]
    out = [None] * len(leaves)
    for dtype in dict.fromkeys(x.dtype for x in leaves):
        ids = [j for j, x in enumerate(leaves) if x.dtype == dtype]
        buf = jnp.concatenate([jnp.ravel(leaves[j]) for j in ids])
        got_JxN = all_gather(buf, sh.axis, algorithm="ring").reshape(sh.size, buf.shape[0])
        at = 0
        for j in ids:
            n = leaves[j].size
            out[j] = _unsplit(got_JxN[:, at:at + n].reshape(sh.size, *leaves[j].shape), shapes[j])
            at += n
    return jax.tree.unflatten(treedef, out)


def _index(sh: Shards):
    assert lax.axis_size(sh.axis) == sh.size, (sh.axes, sh.size)  # the plan's k is this mesh's
    return lax.axis_index(sh.axis)


def split_tree(tree, sh: Shards):
    i = _index(sh)
    out = jax.tree.map(lambda x: split(x, sh.size, i), tree)
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(out)):
        assert s.shape == shard_shape(x.shape, sh.size), (x.shape, s.shape, sh.size)
    return out


def _slotted(tree):
    return jax.tree.map(per_rank.slot, tree)


def _unslotted(tree):
    return jax.tree.map(per_rank.local, tree)


def init(compression, params, sh: Shards):
    """`feedback.init` for the shards of `params` (run inside or outside the shard_map:
    only the shapes are read), each error buffer and method state with its slot."""
    zeros = jax.tree.map(lambda x: jnp.zeros(shard_shape(x.shape, sh.size), x.dtype), params)
    st = feedback.init(compression, zeros)
    return st._replace(error=_slotted(st.error), method=_slotted(st.method))


def specs(compression, param_specs, sh: Shards):
    """Every error buffer and method state leaf on its slot (`Shards.slot`)."""
    st = feedback.specs(compression, param_specs)
    on_slot = lambda tree: jax.tree.map(lambda _: P(sh.slot or None), tree,  # noqa: E731
                                        is_leaf=lambda x: isinstance(x, P))
    return st._replace(error=on_slot(st.error), method=on_slot(st.method))


def unslot(state, pieces):
    """A device's state of the per-shard exchange as `feedback` takes it (its slot
    dropped), checked against this device's shards `pieces`; () stays ()."""
    if not state:  # a stateless exchange (a cast)
        return state
    st = state._replace(error=_unslotted(state.error), method=_unslotted(state.method))
    for e, s in zip(jax.tree.leaves(st.error), jax.tree.leaves(pieces)):
        assert e.shape == s.shape, (e.shape, s.shape)  # the error buffer mirrors this device's shard
    return st


def slot(state):
    """`unslot`'s inverse: the state back on its slot (`Shards.slot`)."""
    return state if not state else state._replace(error=_slotted(state.error), method=_slotted(state.method))
