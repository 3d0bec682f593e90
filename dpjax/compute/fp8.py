"""The fp8 matmul of `--dtype fp8`: both operands scaled per tensor into float8, multiplied
with float32 accumulation, the product scaled back.

Micikevicius et al., "FP8 formats for deep learning" (2022): e4m3 (3 mantissa bits, up to
448) for the forward operands, e5m2 (2 mantissa bits, up to 57344: the range gradients
need) for the gradient that enters the backward pass; the recipe of NVIDIA's Transformer
Engine and torchao's Float8Linear. For `y = x . w` (any two-operand contraction, written as
an einsum spec "A,B->C"):

    forward   s_x = 448 / amax|x|, s_w = 448 / amax|w|        (float32, per tensor)
              y = dot(e4m3(x s_x), e4m3(w s_w)) / (s_x s_w)   (dot: float32 accumulation)
    backward  s_g = 57344 / amax|g|
              dx = dot(e5m2(g s_g), e4m3(w s_w)) / (s_g s_w)  ("C,B->A")
              dw = dot(e4m3(x s_x), e5m2(g s_g)) / (s_x s_g)  ("A,C->B")

where e4m3(v) rounds v to the nearest float8_e4m3fn after saturating it to +-448 (e5m2:
+-57344). Quantisation is a straight-through estimator: its gradient is taken as the
identity, as every fp8 recipe does. The forward's fp8 operands are the backward's
residuals (a byte each, not the compute dtype's two).

Scaling is *current* (the amax of the tensor at each call, what torchao's Float8Linear
defaults to), not *delayed* (Transformer Engine's amax history from earlier steps): it
is stateless, so nothing is carried through the stack's lax.scan, across pipeline ticks
or between steps, and there is no scale state to reduce: a replica's scale depends only
on the tensor it multiplies, and a tensor whole on several devices (a weight, or an
activation under tensor parallelism) has the same amax on each. A block split over an
axis (a column- or row-parallel weight) is scaled by its own amax: each partial product
is scaled back before the model axis sums it, so finer scales change the rounding, never
the sum. Its price is one max-reduction over each operand per matmul (a memory pass;
cheap beside the dot at transformer widths); delayed scaling saves that pass and pays in
state, and in overflow (saturation) whenever a tensor's amax jumps past its history.

The dot itself is `lax.dot_general` on float8 operands with `preferred_element_type`
float32: XLA rewrites it to an fp8 GEMM where the hardware has one (Hopper, Ada) and
emulates it elsewhere (CPU), so the arithmetic is the same everywhere the suite runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2  # forward operands; gradients


def largest(fmt) -> float:
    """The largest finite value of the float8 format `fmt` (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(fmt).max)


def scale_of(x, fmt):
    """The per-tensor scale that maps amax|x| to `fmt`'s largest value (float32, no gradient);
    1 for an all-zero tensor."""
    amax = jnp.max(jnp.abs(lax.stop_gradient(x))).astype(jnp.float32)
    return jnp.where(amax > 0, jnp.float32(largest(fmt)) / amax, jnp.float32(1))


def quantise(x, fmt):
    """(x * scale rounded to `fmt`, saturated; 1 / scale): x is e4m3(x s) / s up to rounding."""
    s = scale_of(x, fmt)
    top = largest(fmt)
    return jnp.clip(x.astype(jnp.float32) * s, -top, top).astype(fmt), 1 / s


def _parse(spec: str) -> tuple[str, str, str]:
    ins, out = spec.replace(" ", "").split("->")
    a, b = ins.split(",")
    if "." in spec or len(set(a)) < len(a) or len(set(b)) < len(b) or not set(out) <= set(a) | set(b):
        raise ValueError(f"fp8 einsum {spec!r}: two operands, explicit letters, none repeated in one operand")
    if set(a) - set(b) - set(out) or set(b) - set(a) - set(out):
        raise ValueError(f"fp8 einsum {spec!r}: every letter of an operand must be in the other or the output "
                         f"(the backward's contractions are the forward's with an operand and the output swapped)")
    return a, b, out


def dot(spec: str, a, b):
    """einsum(spec, a, b) as one `lax.dot_general` accumulating in float32 (a, b float8),
    then the output's letters put in `spec`'s order."""
    sa, sb, out = _parse(spec)
    batch = [c for c in sa if c in sb and c in out]
    contract = [c for c in sa if c in sb and c not in out]
    dims = (([sa.index(c) for c in contract], [sb.index(c) for c in contract]),
            ([sa.index(c) for c in batch], [sb.index(c) for c in batch]))
    y = lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    have = batch + [c for c in sa if c not in sb] + [c for c in sb if c not in sa]  # dot_general's order
    return jnp.transpose(y, [have.index(c) for c in out])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _einsum(spec, x, w, out_dtype):
    return _forward(spec, x, w, out_dtype)[0]


def _forward(spec, x, w, out_dtype):
    xq, x_inv = quantise(x, E4M3)
    wq, w_inv = quantise(w, E4M3)
    y = (dot(spec, xq, wq) * (x_inv * w_inv)).astype(out_dtype)
    # the dtypes of x and w ride along as empty arrays (a residual must be an array)
    return y, (xq, wq, x_inv, w_inv, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _backward(spec, out_dtype, res, g):
    xq, wq, x_inv, w_inv, x_like, w_like = res
    a, b, out = _parse(spec)
    gq, g_inv = quantise(g, E5M2)
    dx = dot(f"{out},{b}->{a}", gq, wq) * (g_inv * w_inv)
    dw = dot(f"{a},{out}->{b}", xq, gq) * (x_inv * g_inv)
    return dx.astype(x_like.dtype), dw.astype(w_like.dtype)


_einsum.defvjp(_forward, _backward)


def einsum(spec: str, x, w):
    """`jnp.einsum(spec, x, w)` computed in fp8 with per-tensor current scaling (the module's
    docstring), in `x` and `w`'s result dtype; its gradient through e5m2."""
    _parse(spec)
    return _einsum(spec, x, w, jnp.result_type(x, w))


def matmul(x, w_DxF):
    """`x @ w_DxF` in fp8 for an x of any rank (its last dimension contracted): one tensor."""
    assert w_DxF.ndim == 2 and x.shape[-1] == w_DxF.shape[0], (x.shape, w_DxF.shape)
    y_NxF = einsum("nd,df->nf", x.reshape(-1, x.shape[-1]), w_DxF)
    return y_NxF.reshape(*x.shape[:-1], w_DxF.shape[1])
