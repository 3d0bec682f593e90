"""What the NNX and Linen parallel layers share: whether their mesh axis is bound here,
and the `Parallel` they hand to `dpjax.compute.tensor_parallel`."""

from __future__ import annotations

import jax
from jax import lax

from dpjax import mesh
from dpjax.compute.tensor_parallel import DENSE, Parallel


def bound(axis) -> bool:
    """Whether the code runs inside a shard_map over `axis` (each device holds its block
    of the layer's weights); elsewhere the weights are whole and the layer is dense."""
    return mesh.bound(axis) and lax.axis_size(axis) > 1


def axis_size(axis) -> int:
    return lax.axis_size(axis) if bound(axis) else 1


def parallel(axis, algorithm: str) -> Parallel:
    return Parallel(model_axis=axis, algorithm=algorithm) if bound(axis) else DENSE


def mesh_is_set() -> bool:
    """Whether a mesh is set (`jax.set_mesh`): flax then shards each annotated Variable
    as it is created (under jit, each device computes only its block)."""
    return bool(jax.sharding.get_abstract_mesh().axis_names)


def local(n: int, axis, what: str) -> int:
    """n split over `axis` here (n itself outside a shard_map over it)."""
    size = axis_size(axis)
    assert n % size == 0, f"{what}: {n} does not split over the {size} devices of {axis!r}"
    return n // size
