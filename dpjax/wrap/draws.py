"""Dropout inside `dpjax.jit` as `jax.jit` draws it: each device gets its rows of the mask one
device would draw for the whole batch.

Under `jax.jit` a draw is of the global array: `jax.random.bernoulli(key, p, (B, L, D))` draws
one mask for the batch's B rows, and GSPMD computes each device's block of it. Inside dpjax's
step the data axes are manual: each device holds B/n rows, the same key draws a (B/n, L, D)
mask, and every device applies the *same* mask to its own rows (not one device's draw; a
correlated mask). JAX's threefry generator in its partitionable form (`jax_threefry_partitionable`,
on by default) makes element i of a draw of a shape the hash of the key and i, the element's
index in the flattened shape. Device k of the data axes holds the global rows k*B/n ..
(k+1)*B/n - 1, whose flattened indices are its own indices plus k * (its block's size). So a
draw whose leading dimension is the batch's is the global draw's rows where the counters start
at k * size instead of 0: that is what `bernoulli` below draws. A draw of another shape gets a
stream of its own on every device (disjoint counters), as `dpjax.device_key` gives.

Only `jax.random.bernoulli` (flax's `nn.Dropout` and attention dropout call it by attribute)
in its default form (float32 probabilities, mode "low", a single threefry key, a shape given)
is drawn so, and only while `dpjax.jit` traces a step (`drawing()`, which puts it in JAX's
attribute and JAX's own back after the trace, as `dpjax.wrap.constraints` does for sharding
constraints). Anything else is JAX's own draw. `tests/test_lm1b_example.py` checks the mask
bit for bit against JAX's, on one device and split over 8.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

from dpjax.wrap.patch import Patch
from dpjax.wrap.rng import bound_data_axes, device_index
_ONE_F32 = np.array(1.0, np.float32).view(np.uint32)  # the exponent of 1.0: floats in [1, 2) from 23 random bits


def _key_words(key):
    """The two uint32 words of a single threefry key (typed or raw), else None."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        # the default's impl is made here, not at import: a key then would start JAX before simulate_cpu_devices
        default = jax.config.jax_default_prng_impl == "threefry2x32"
        if key.shape or not default or str(jax.random.key_impl(key)) != str(jax.random.key_impl(jax.random.key(0))):
            return None
        return jax.random.key_data(key)
    raw = jnp.asarray(key)
    ours = raw.dtype == jnp.uint32 and raw.shape == (2,) and jax.config.jax_default_prng_impl == "threefry2x32"
    return raw if ours else None


def global_bits(words, shape: tuple, start):
    """32 random bits per element of `shape` from the key `words`, element i being the bits of
    counter start + i of the partitionable threefry draw (JAX's own when start is 0)."""
    size = math.prod(shape)
    flat = sum(lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(math.prod(shape[d + 1:]))
               for d in range(len(shape))) if shape else jnp.zeros((), jnp.uint32)
    low = flat + jnp.asarray(start, jnp.uint32) * jnp.uint32(size)
    high = jnp.zeros(shape, jnp.uint32)
    bits1, bits2 = threefry2x32_p.bind(words[0], words[1], high, low)
    return bits1 ^ bits2


def bernoulli(key, p=0.5, shape=None, mode="low", **kwargs):
    """`jax.random.bernoulli`, drawn as the global batch's rows inside `dpjax.jit` (see the module docstring)."""
    axes = bound_data_axes() if _PATCH.active.get() else ()
    words = _key_words(key) if axes and shape is not None and mode == "low" and not kwargs else None
    n = math.prod(lax.axis_size(a) for a in axes) if axes else 1
    if (words is None or lax.dtype(p) != jnp.float32 or not jax.config.jax_threefry_partitionable
            or n * math.prod(shape) >= 2**32):
        return _PATCH.original(key, p, shape, mode, **kwargs)
    shape = tuple(shape)
    bits = global_bits(words, shape, device_index())
    floats = lax.bitcast_convert_type((bits >> jnp.uint32(9)) | jnp.uint32(_ONE_F32), jnp.float32) - 1.0
    return floats < lax.convert_element_type(p, jnp.float32)


_PATCH = Patch(jax.random, "bernoulli", bernoulli, default=False)


def drawing():
    """While the block runs (a step's trace), `jax.random.bernoulli` draws the global batch's rows."""
    return _PATCH.on(True)
