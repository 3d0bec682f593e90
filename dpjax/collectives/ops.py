"""Reduction operators: what `op=` means in allreduce and reduce_scatter (Horovod's ops).

    sum, mean       every step of every explicit algorithm adds (`combine`)
    min, max        elementwise minimum / maximum at every step (bool: all / any)
    product         multiplies at every step (bool: all)
    adasum          Maleki et al.'s adaptive sum, its own butterfly (`adasum.py`)

Padded elements (the zero tail `as_chunks` adds) only ever combine with each other and
are cut off, so the padding value does not matter for any op.

mean is the sum divided by the number of ranks. Integers keep their dtype and are
divided exactly, rounding toward zero: Horovod multiplies the integer sum by the double
1/n and converts back, which truncates the same way (`ScaleBufferCPUImpl`), except where
that double product falls an ulp below an integer (n = 49, for one).

prescale_factor / postscale_factor, as Horovod applies them (gloo_operations.cc):
every rank's input is multiplied by the prescale before the reduction and the result by
the postscale after it; for mean the 1/n is folded into the postscale. Floats of at
least 32 bits are scaled in their own dtype; narrower floats and integers in float32
(float64 under jax_enable_x64), converted back once (integers truncated toward zero:
Horovod scales them in double, so beyond 2^24 float32 can differ).
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

REDUCE_OPS = ("sum", "mean", "min", "max", "product", "adasum")

_COMBINE = {"sum": jnp.add, "mean": jnp.add, "min": jnp.minimum, "max": jnp.maximum,
            "product": jnp.multiply}


def kind(dtype) -> str:
    """'bool', 'int' (signed or unsigned), 'float' or 'complex'."""
    if jnp.issubdtype(dtype, jnp.bool_):
        return "bool"
    if jnp.issubdtype(dtype, jnp.integer):
        return "int"
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return "complex"
    return "float"


def check(op: str, dtype, what: str, prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    """Raises a one-line ValueError for an op (or a scaling) the dtype does not support."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown op {op!r}: use one of {', '.join(REDUCE_OPS)}")
    k, name = kind(dtype), np.dtype(dtype).name
    if k == "bool" and op in ("sum", "mean"):
        raise ValueError(f"{what} op={op!r} of bool: use op='max' (any), 'min' or 'product' (all), "
                         f"or cast to an integer dtype first")
    if k == "complex" and op in ("min", "max"):
        raise ValueError(f"{what} op={op!r} of {name}: complex numbers have no order")
    if op == "adasum" and k != "float":
        raise ValueError(f"{what} op='adasum' of {name}: Adasum combines floating-point gradients only")
    if k == "bool" and (prescale_factor != 1 or postscale_factor != 1):
        raise ValueError(f"{what} of bool cannot be scaled (prescale_factor / postscale_factor must be 1)")


def combine(op: str):
    """The binary function each algorithm step applies: a + b, min, max or a * b."""
    return _COMBINE[op]


def scale(x, factor: float):
    """x * factor in x's dtype (see the module docstring for how each dtype rounds)."""
    if factor == 1:
        return x
    dtype = x.dtype
    if kind(dtype) in ("float", "complex") and jnp.finfo(dtype).bits >= 32:
        return x * jnp.asarray(factor, dtype)
    wide = jax.dtypes.canonicalize_dtype(jnp.float64)  # float32 unless x64 is on
    return (x.astype(wide) * jnp.asarray(factor, wide)).astype(dtype)


def finish(x, op: str, n: int, postscale_factor: float = 1.0):
    """The reduced value after the exchange: mean divides by n; then the postscale."""
    if op != "mean":
        return scale(x, postscale_factor)
    if postscale_factor != 1:
        return scale(x, postscale_factor / n)
    if kind(x.dtype) == "int":
        return lax.div(x, jnp.asarray(n, x.dtype))  # rounds toward zero, like C
    return x / jnp.asarray(n, x.dtype)


class Wire(Protocol):
    """A cast a value travels in (`dpjax.compression`'s casts: bf16, fp16, ...), as the
    collectives see it without importing compression."""

    def compresses(self, dtype) -> bool: ...

    def encode(self, x): ...

    def decode(self, y, like): ...


def on_wire(method: Wire | None, x, reduce):
    """reduce(x) with x encoded by the wire `method` on the way and decoded after (a
    `dpjax.compression` cast, resolved by the caller: collectives never import
    compression); reduce(x) as it is for no method, or a dtype the method leaves alone
    (integers and bools travel as they are). The one recipe the grouped allreduce,
    tensor parallelism's backward and Horovod's reduce-scatter share."""
    if method is None or not method.compresses(x.dtype):
        return reduce(x)
    return method.decode(reduce(method.encode(x)), x)
