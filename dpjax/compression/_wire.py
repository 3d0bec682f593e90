"""Byte-level helpers for the messages of the methods with error feedback: one uint8
message per rank, so each point-to-point step carries exactly the method's bytes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

BITS = np.asarray([1, 2, 4, 8, 16, 32, 64, 128], np.uint8)  # numpy: importing dpjax must not start JAX


def to_bytes(x):
    """x (any 4-byte or 1-byte dtype) as a flat uint8 array of its bytes."""
    if x.dtype.itemsize == 1:
        return lax.bitcast_convert_type(x.reshape(-1), jnp.uint8)
    return lax.bitcast_convert_type(x.reshape(-1), jnp.uint8).reshape(-1)


def from_bytes(u8, dtype, count: int):
    """The first `count` values of dtype stored in the flat uint8 array `u8`."""
    size = jnp.dtype(dtype).itemsize
    if size == 1:
        return lax.bitcast_convert_type(u8[:count], dtype)
    return lax.bitcast_convert_type(u8[:count * size].reshape(count, size), dtype)


def pack_bits(b):
    """A flat bool array -> ceil(d/8) bytes, 8 flags a byte (the first in the low bit)."""
    d = b.shape[0]
    pad = -d % 8
    b = jnp.pad(b, (0, pad)).reshape(-1, 8).astype(jnp.uint8)
    return jnp.sum(b * BITS, axis=1, dtype=jnp.uint8)


def unpack_bits(u8, d: int):
    """Inverse of `pack_bits`: the first d flags."""
    return ((u8[:, None] & BITS) != 0).reshape(-1)[:d]
