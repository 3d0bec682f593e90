"""Casts: floating-point tensors travel in a narrower float (Horovod's `Compression.fp16`).

    bf16   bfloat16: float32's exponent range, 8 significant bits (relative error 2^-9)
    fp16   IEEE half: 11 significant bits (2^-12), but overflows past 65504 (Horovod's
           gradient_predivide_factor exists to keep the sum of fp16 gradients in range)

Half the bytes of float32 on the wire, for every algorithm. Integers and bools travel as
they are (as Horovod's fp16 compressor leaves them). A cast is linear up to rounding:
the allreduce sums the cast values on the wire, each partial sum rounded once to the
wire dtype, and the result is cast back to the tensor's own dtype; a mean is divided
after that, in the tensor's precision (`collectives.grouped`).
"""

from __future__ import annotations

import jax.numpy as jnp

from dpjax.compression.registry import Method, register


def _floating(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def cast(name: str, dtype) -> Method:
    """The method that sends floating-point tensors as `dtype`."""

    def encode(x):
        return x.astype(dtype) if _floating(x.dtype) else x

    def decode(wire, like):
        return wire.astype(like.dtype)

    return Method(name, encode, decode, _floating, jnp.dtype(dtype), linear=True)


register(cast("bf16", jnp.bfloat16))
register(cast("fp16", jnp.float16))
