"""Causal self-attention of each head over the positions up to its own: the one switch
between kernels that every dpjax model and layer calls.

    naive  the scores written out, Q K^T / sqrt(K) (B x H x T x T), masked, softmax in
           float32, times V: the readable reference
    xla    `jax.nn.dot_product_attention(implementation="xla")`: the same math as JAX
           writes it
    cudnn  `jax.nn.dot_product_attention(implementation="cudnn")`: cuDNN's fused flash
           attention (Dao et al., "FlashAttention", NeurIPS 2022), which never holds the
           T x T scores (GPU, bfloat16 / float16, head width a multiple of 8 up to 256;
           `dpjax.compute.policy.cudnn_refusal` says why not)

Tensors are B x T x H x K (batch, time, heads, head width) in and out, the layout JAX's
kernel takes; under tensor parallelism H is this device's heads (`Hm`). The output is
named `attention` (`jax.ad_checkpoint.checkpoint_name`), so remat=dots keeps it: a fused
kernel is not a dot that the dots policy would save.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from dpjax.compute.policy import ATTENTION_NAME, ATTENTIONS


def naive(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK):
    """Softmax(Q K^T / sqrt(K) + causal mask) V with the scores written out; the mask's
    value is float32's most negative number and the softmax is taken in float32."""
    B, T, H, K = q_BxTxHxK.shape
    assert k_BxTxHxK.shape == v_BxTxHxK.shape == (B, T, H, K), (q_BxTxHxK.shape, k_BxTxHxK.shape, v_BxTxHxK.shape)
    s_BxHxTxT = jnp.einsum("bqhk,bthk->bhqt", q_BxTxHxK, k_BxTxHxK).astype(jnp.float32) / math.sqrt(K)
    s_BxHxTxT = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s_BxHxTxT, jnp.finfo(jnp.float32).min)
    p_BxHxTxT = jax.nn.softmax(s_BxHxTxT, axis=-1).astype(v_BxTxHxK.dtype)
    return jnp.einsum("bhqt,bthk->bqhk", p_BxHxTxT, v_BxTxHxK)


def causal(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, kernel: str = "naive"):
    """Causal attention with the named `kernel` (one of `ATTENTIONS`), its output named
    for remat."""
    if kernel not in ATTENTIONS:
        raise ValueError(f"attention kernel {kernel!r}: expected one of {', '.join(ATTENTIONS)}")
    if kernel == "naive":
        out = naive(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK)
    else:
        out = jax.nn.dot_product_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, is_causal=True, implementation=kernel)
    assert out.shape == q_BxTxHxK.shape, (out.shape, q_BxTxHxK.shape)
    return checkpoint_name(out, ATTENTION_NAME)


def kernel(name: str):
    """`causal` with its kernel fixed: a `core(q, k, v)` for `tensor_parallel.head_parallel_attention`."""
    def core(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK):
        return causal(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, name)
    return core
