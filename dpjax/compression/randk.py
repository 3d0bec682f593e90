"""randk:F: a random fraction F of each bucket's values, the same indices on every rank,
summed on the ring, with error feedback.

Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory" (NeurIPS 2018): the k = ceil(F d)
indices are drawn from a seed every rank shares (the exchange count), so the selected
values line up across ranks and the exchange is linear: an allreduce (the exchange's
algorithm) of k float32 values, not an all-gather. Values are sent unscaled (the error
buffer keeps the rest; scaling by d/k would be unbiased but blows up the variance).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dpjax.compression.feedback import allreduce_bytes, per_bucket, per_bucket_bytes
from dpjax.compression.registry import Method, register
from dpjax.compression.topk import count


def indices(key, d: int, k: int):
    """k distinct indices of 0..d-1 drawn from `key` (the k largest of d uniform draws)."""
    return lax.top_k(jax.random.uniform(key, (d,)), k)[1]


def _reduce(x, axis_name, spec, key, segments, allreduce):
    from dpjax.collectives import allreduce as one

    idx = indices(key, x.shape[0], count(x.shape[0], spec.number))
    opts = {k: v for k, v in allreduce.items() if k != "fusion_mb"}
    total = one(x[idx], axis_name, op="mean", **opts)
    return jnp.zeros_like(x).at[idx].set(total), x.at[idx].set(0)


def _bytes(d, n, spec, segments, allreduce):
    return allreduce_bytes(count(d, spec.number), n, allreduce)


register(Method("randk", None, None, lambda dt: jnp.issubdtype(dt, jnp.floating), jnp.dtype(jnp.float32),
                linear=True, exchange=per_bucket(_reduce), wire_bytes=per_bucket_bytes(_bytes),
                number="the fraction F", number_type=float, number_ok=lambda v: 0 < v <= 1,
                number_must="in (0, 1]"))
