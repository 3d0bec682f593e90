"""Sums and weighted means over the whole global batch, from inside a data-parallel step.

Inside `shard_step` (or `dpjax.jit`) each device holds its own rows. A loss normalised by a
count, `sum(loss * w) / sum(w)` (tokens that are not padding, flax's lm1b), then divides by
this device's count, and averaging the devices' gradients (what `DistributedOptimizer` does)
gives the mean of per-device means: another objective than one device's whenever the devices'
counts differ. `weighted_mean(x, w)` is the global batch's, `sum(x * w) / sum(w)` over every
device's rows, the same value on every device; `global_sum(x)` is the sum of `x` over the
data-parallel devices (a count, a metric's total).

Gradients follow dpjax's convention that each device's gradient is averaged over the data
axes afterwards: the backward of `global_sum` sums the cotangents over the data axes
(for the replicated loss above, n times each device's own), so that the average of the
devices' gradients is the gradient of the global value. A `jax.lax.psum` under shard_map
with check_vma=False transposes the same way; this states it rather than relying on it.

Outside a mesh (one device, plain `jax.jit`) both are the plain formulas: `global_sum` is the
identity, so the same loss code runs on one device and in the step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dpjax.wrap.rng import bound_data_axes


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _psum(x, axes):
    return lax.psum(x, axes)


def _psum_fwd(x, axes):
    return lax.psum(x, axes), None


def _psum_bwd(axes, _, g):
    return (lax.psum(g, axes),)  # each device's share of the global value's gradient, before the average


_psum.defvjp(_psum_fwd, _psum_bwd)


def global_sum(x):
    """x (a pytree) summed over the data-parallel devices of the step it runs in; x itself
    outside one. Every device gets the same value.

    Given a function (`@dpjax.global_sum` on a `def`, or `f, g = map(dpjax.global_sum, (f, g))`
    for several at once), the function whose results are summed so: the form for a script's
    helpers that return sums over the batch (flax lm1b's `compute_weighted_cross_entropy`
    returns `loss.sum(), normalizing_factor`), changed where they are defined rather than at
    each call."""
    if callable(x):
        fn = x

        @functools.wraps(fn)
        def summed(*args, **kwargs):
            return global_sum(fn(*args, **kwargs))

        return summed
    axes = bound_data_axes()
    if not axes:
        return x
    return jax.tree.map(lambda v: _psum(v, axes), x)


def weighted_mean(x, weights):
    """sum(x * weights) / sum(weights) over the global batch (every device's rows), weights
    broadcast to x's shape (a weight per row is a weight for each of its elements), the same on
    every device: a token-weighted loss as one device computes it. Differentiable in x (see the
    module docstring for how its gradient meets the average over the devices)."""
    x = jnp.asarray(x)
    weights = jnp.broadcast_to(jnp.asarray(weights, x.dtype), x.shape)  # a weight per element of x
    return global_sum(jnp.sum(x * weights)) / global_sum(jnp.sum(weights))
