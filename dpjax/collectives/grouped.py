"""Grouped collectives: many tensors in one call, fused into buckets (Horovod's grouped_*).

`allreduce`, `all_gather` and `reduce_scatter` take a list (any pytree) of tensors and
return the same structure. The tensors are packed into tensor-fusion buckets as the
`DistributedOptimizer` packs gradients (`dpjax.fusion`: one dtype per bucket, at most
`fusion_mb` MiB, tree order) and each bucket is exchanged once, with any algorithm:

    allreduce        the flat concatenation of the bucket's tensors
    all_gather       the same, then every rank's piece of each tensor cut out again
    reduce_scatter   row j of every tensor (its (n, -1) view) side by side, so that
                     rank j's share of the bucket is rank j's share of every tensor

Per device each bucket costs what one collective of its size costs (cost.schedule);
fusing T tensors saves (T - buckets) times the algorithm's steps.

compression: a resolved wire method (`dpjax.compression.summable("bf16")`, or None), which
its callers look up: collectives sit below compression and never import it. The buckets it compresses
(floating-point ones for the casts; integers and bools travel as they are, as Horovod's
`Compression.fp16` leaves them) travel encoded; the sum and any prescale happen on the
wire, the mean and the postscale after decoding (within process sets, `groups=`, each
rank's own set size divides on the wire). Only a linear method can be summed on the wire.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import scopes
from dpjax.collectives import calls
from dpjax.collectives.ranks import axis_size
from dpjax.collectives.ops import finish, on_wire
from dpjax.fusion import pack, plan_buckets, unpack


def allreduce(tensors, axis_name, *, op: str = "sum", fusion_mb: float = 64, compression=None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, **options):
    """`collectives.allreduce` of every tensor, one call per fusion bucket.

    op="adasum": each tensor of a bucket gets its own Adasum coefficients (`segments`)."""
    one = calls.allreduce
    n = axis_size(axis_name, "grouped allreduce")
    method = _wire_method(compression)
    plan = plan_buckets(tensors, fusion_mb * 2**20)
    out = []
    for i, (bucket, buf) in enumerate(zip(plan.buckets, pack(plan, tensors))):
        extra = {"segments": bucket.sizes} if op == "adasum" and len(bucket.sizes) > 1 else {}
        compress = method is not None and method.compresses(buf.dtype)
        split = compress and options.get("groups") is None  # finish in buf's dtype, after the wire
        with _bucket(plan, i):
            y = on_wire(method, buf, lambda v: one(v, axis_name, op="sum" if split and op == "mean" else op,
                                                   prescale_factor=prescale_factor,
                                                   postscale_factor=1.0 if split else postscale_factor,
                                                   **extra, **options))
            out.append(finish(y, op, n, postscale_factor) if split else y)
    return unpack(plan, out)


def mean(tensors, axis_name, **options):
    """The mean of every tensor over `axis_name`, as the gradient exchange takes it (the
    step's "exchange" phase, `dpjax.scopes`): what a compression method calls for its
    exact steps and its uncompressed tensors."""
    with scopes.phase("exchange"):
        return allreduce(tensors, axis_name, op="mean", **options)


def _wire_method(compression):
    """`compression` if it is a resolved wire method (encode / decode / compresses) or None."""
    if compression is None or all(hasattr(compression, a) for a in ("encode", "decode", "compresses")):
        return compression
    raise TypeError(f"grouped allreduce takes a resolved wire method, not {compression!r}: pass "
                    f"dpjax.compression.summable({compression!r})")


def _bucket(plan, i: int):
    """The named scope of bucket i (`dpjax.scopes`): a timeline shows the exchange per bucket."""
    b = plan.buckets[i]
    return scopes.scope("bucket", index=i, of=len(plan.buckets), tensors=len(b.sizes), bytes=b.nbytes)


def _pieces(plan, bucket):
    """(leaf index, shape, offset, size) of each tensor in a flat bucket."""
    offsets = np.cumsum((0,) + bucket.sizes)
    return [(i, plan.shapes[i], int(o), s) for i, o, s in zip(bucket.leaves, offsets[:-1], bucket.sizes)]


def _check_rows(plan, what: str, n: int | None = None):
    for shape in plan.shapes:
        if not shape or (n is not None and shape[0] % n):
            need = f"dimension 0 divisible by the axis size {n}" if n else "at least one dimension"
            raise ValueError(f"{what}: every tensor needs {need}; got shape {shape}")


def all_gather(tensors, axis_name, *, fusion_mb: float = 64, **options):
    """`collectives.all_gather` (tiled on dimension 0) of every tensor."""
    one = calls.all_gather
    n = axis_size(axis_name, "grouped all_gather")
    plan = plan_buckets(tensors, fusion_mb * 2**20)
    _check_rows(plan, "grouped all_gather")
    leaves = [None] * len(plan.shapes)
    for b, (bucket, buf) in enumerate(zip(plan.buckets, pack(plan, tensors))):
        with _bucket(plan, b):
            full = one(buf, axis_name, **options).reshape(n, -1)  # row r: rank r's bucket
        for i, shape, start, size in _pieces(plan, bucket):
            leaves[i] = full[:, start:start + size].reshape(n * shape[0], *shape[1:])
    return jax.tree.unflatten(plan.treedef, leaves)


def reduce_scatter(tensors, axis_name, *, op: str = "sum", fusion_mb: float = 64, **options):
    """`collectives.reduce_scatter` (tiled on dimension 0) of every tensor."""
    one = calls.reduce_scatter
    n = axis_size(axis_name, "grouped reduce_scatter")
    plan = plan_buckets(tensors, fusion_mb * 2**20)
    _check_rows(plan, "grouped reduce_scatter", n)
    flat = jax.tree.leaves(tensors)
    leaves = [None] * len(plan.shapes)
    for b, bucket in enumerate(plan.buckets):
        rows = jnp.concatenate([flat[i].reshape(n, -1) for i in bucket.leaves], axis=1)
        with _bucket(plan, b):
            mine = one(rows.reshape(-1), axis_name, op=op, **options)  # my row of every tensor
        for i, shape, start, size in _pieces(plan, bucket):
            leaves[i] = mine[start // n:(start + size) // n].reshape(shape[0] // n, *shape[1:])
    return jax.tree.unflatten(plan.treedef, leaves)
