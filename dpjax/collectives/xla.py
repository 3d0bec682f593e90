"""XLA's own collectives, the baselines: "psum" (`lax.psum`, `psum_scatter`, `all_gather`,
and a broadcast as a masked psum) and "xla" (`lax.all_to_all`).

One op each in the compiled program, none over an axis of one device (a rank's value is
the result; XLA would keep the op, on a GPU a copy of the whole buffer: the gradient
exchange of a one-device run, psum by default there); how the bytes move is the backend's
choice (NCCL on GPUs, a rendezvous on CPU). The cost model and the emulated links
(`links.account_xla`) charge them as the bandwidth-optimal ring would send them,
padded in bytes as `cost.hlo_comm` counts them:

    allreduce, broadcast   one op, 2(n-1) * ceil(N/n) bytes   (0 on one rank: no op)
    reduce_scatter         one op, (n-1) * floor(N/n) bytes
    all_gather             one op, (n-1) * floor(N/n) bytes   (N: the gathered result)
    all_to_all ("xla")     one op, (n-1) blocks

They cannot address a subset of the axis, so they take no process sets (`groups=`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from dpjax import links
from dpjax.collectives.ranks import axis_size
from dpjax.collectives.cost import Schedule, no_model
from dpjax.collectives.registry import Algorithm, names, register


def _widened(x):
    """bool as uint8: lax.psum would turn bool into int32."""
    return x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x


def allreduce(x, axis_name, *, op: str = "sum"):
    if op == "product":
        raise ValueError("allreduce op='product' has no XLA baseline (lax has psum, pmin and pmax only); "
                         "choose an explicit algorithm such as 'ring'")
    wide = _widened(x)
    fn = {"min": lax.pmin, "max": lax.pmax}.get(op, lax.psum)
    n = axis_size(axis_name)
    links.account_xla(axis_name, 2 * (n - 1) * -(-wide.size * wide.dtype.itemsize // n))
    if n == 1:  # one rank: x itself (XLA would keep an all-reduce of the whole buffer: a copy on a GPU)
        return x
    return fn(wide, axis_name).astype(x.dtype)


def reduce_scatter(x, axis_name, *, op: str = "sum"):
    if op not in ("sum", "mean"):
        explicit = ", ".join(a for a in names("reduce_scatter") if a != "psum")
        raise ValueError(f"reduce_scatter op={op!r} has no XLA baseline (lax.psum_scatter only sums); "
                         f"choose one of {explicit}")
    n = axis_size(axis_name)
    links.account_xla(axis_name, (n - 1) * (x.size * x.dtype.itemsize // n))
    if n == 1:  # one rank holds the whole sum: x
        return x
    return lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)


def all_gather(x, axis_name):
    n = axis_size(axis_name)
    links.account_xla(axis_name, (n - 1) * x.size * x.dtype.itemsize)
    if n == 1:  # one rank: its block is the whole
        return x
    return lax.all_gather(x, axis_name, axis=0, tiled=True)


def broadcast(x, axis_name, *, root: int = 0):
    n = axis_size(axis_name)
    mine = lax.axis_index(axis_name) == root
    wide = _widened(x)
    links.account_xla(axis_name, 2 * (n - 1) * -(-wide.size * wide.dtype.itemsize // n))
    if n == 1:  # the root is the only rank
        return x
    return lax.psum(jnp.where(mine, wide, jnp.zeros_like(wide)), axis_name).astype(x.dtype)


def all_to_all(x, axis_name):
    n = axis_size(axis_name)
    links.account_xla(axis_name, (n - 1) * (x.size * x.dtype.itemsize // n))
    return lax.all_to_all(x, axis_name, 0, 0, tiled=True)


def psum_cost(primitive: str, n: int, nelems: int, itemsize: int) -> Schedule:
    N, ops = nelems * itemsize, int(n > 1)  # one rank: no op (see the functions above)
    if primitive in ("allreduce", "broadcast"):
        return Schedule(ops, 2 * (n - 1) * math.ceil(N / n))
    if primitive in ("reduce_scatter", "all_gather"):
        return Schedule(ops, (n - 1) * (N // n))
    raise no_model(primitive, "psum")


def all_to_all_cost(primitive: str, n: int, nelems: int, itemsize: int) -> Schedule:
    if primitive != "all_to_all":
        raise no_model(primitive, "xla")
    return Schedule(1, (n - 1) * (nelems // n * itemsize))  # each block sent once


register(Algorithm("psum", psum_cost, allreduce=allreduce, reduce_scatter=reduce_scatter, all_gather=all_gather,
                   broadcast=broadcast, groups=False))
register(Algorithm("xla", all_to_all_cost, all_to_all=all_to_all, groups=False))
