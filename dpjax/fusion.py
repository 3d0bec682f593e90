"""Tensor fusion: pack many small gradients into a few large buffers (Horovod).

A collective pays a fixed latency per step, so allreducing hundreds of small
gradient tensors one by one is latency-bound. Horovod's tensor fusion (Sergeev & Del
Balso, 2018, section 4) packs tensors into buffers of at most `HOROVOD_FUSION_THRESHOLD`
bytes (64 MiB by default) and allreduces each buffer once. Here the plan is static
(shapes are known when the step is traced), so packing is a concatenation XLA fuses.

Pure functions: `plan_buckets` decides, `pack` / `unpack` move data; pack then
unpack is the identity. Leaves are grouped by dtype (a buffer has one dtype) and
kept in tree order within a group; a leaf larger than the cap gets a bucket alone.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Bucket:
    dtype: np.dtype
    leaves: tuple[int, ...]  # indices into the flattened tree
    sizes: tuple[int, ...]  # elements of each leaf

    @property
    def nbytes(self) -> int:
        return sum(self.sizes) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class FusionPlan:
    treedef: object
    shapes: tuple[tuple[int, ...], ...]
    buckets: tuple[Bucket, ...]


# Which leaves of the parameter tree differ across the model / stage axes (a tensor-parallel
# or pipeline shard) and which are the same there (replicated), while dpjax's step is
# traced. A compression that decides per bucket (top-k's selection, int8's block scales)
# must not mix the two: a replicated tensor would be compressed differently on each model
# rank beside a different shard, and its copies would drift apart.
_CLASSES: contextvars.ContextVar = contextvars.ContextVar("dpjax_leaf_classes", default=None)


@contextlib.contextmanager
def leaf_classes(classes):
    """While tracing inside, trees shaped like `classes` (a pytree of strings, one a leaf:
    the mesh axes it is split over beyond the data axes) bucket by key."""
    token = _CLASSES.set(classes)
    try:
        yield
    finally:
        _CLASSES.reset(token)


def classes_of(tree):
    """The keys of `tree`'s leaves under `leaf_classes`, None outside or for another tree."""
    classes = _CLASSES.get()
    if classes is None:
        return None
    keys, treedef = jax.tree.flatten(classes)
    return tuple(keys) if treedef == jax.tree.structure(tree) else None


def plan_buckets(tree, cap_bytes: float, classes=None) -> FusionPlan:
    """Groups the leaves of `tree` (arrays or ShapeDtypeStructs) into buckets of <= cap_bytes,
    one dtype and one of `classes` (a key a leaf, `classes_of`) a bucket.

    cap_bytes <= 0 disables fusion: one bucket per leaf.
    """
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple(tuple(np.shape(x)) for x in leaves)
    by_dtype: dict = {}
    for i, x in enumerate(leaves):
        by_dtype.setdefault((np.dtype(x.dtype), classes[i] if classes else None), []).append(i)
    buckets = []
    for (dtype, _), idxs in by_dtype.items():
        item = dtype.itemsize
        cur: list[int] = []
        cur_bytes = 0
        for i in idxs:
            nbytes = int(np.prod(shapes[i], dtype=np.int64)) * item
            if cur and (cap_bytes <= 0 or cur_bytes + nbytes > cap_bytes):
                buckets.append(cur)
                cur, cur_bytes = [], 0
            cur.append(i)
            cur_bytes += nbytes
        if cur:
            buckets.append(cur)
    return FusionPlan(
        treedef,
        shapes,
        tuple(
            Bucket(
                np.dtype(leaves[b[0]].dtype),
                tuple(b),
                tuple(int(np.prod(shapes[i], dtype=np.int64)) for i in b),
            )
            for b in buckets
        ),
    )


def pack(plan: FusionPlan, tree) -> list[jax.Array]:
    """One flat buffer per bucket."""
    leaves = jax.tree.leaves(tree)
    return [jnp.concatenate([leaves[i].reshape(-1) for i in b.leaves]) for b in plan.buckets]


def unpack(plan: FusionPlan, buffers) -> object:
    """Inverse of `pack`: the tree with every leaf back in its shape."""
    leaves: list = [None] * len(plan.shapes)
    for b, buf in zip(plan.buckets, buffers):
        offsets = np.cumsum((0,) + b.sizes)
        for i, start, stop in zip(b.leaves, offsets[:-1], offsets[1:]):
            leaves[i] = buf[int(start):int(stop)].reshape(plan.shapes[i])
    return jax.tree.unflatten(plan.treedef, leaves)
