"""The Llama's forward pass over a KV cache: a prompt once (prefill), then a token a step.

Each layer keeps the keys and values of every position so far, L x B x O x Y x K (O: the
longest sequence, Y: the K/V heads: a grouped-query model caches H/Y times less than
one with a K/V head per query head); a step computes the new token's Q, K and V only,
writes K and V at its position and attends over the cache up to it. The arithmetic is
the model's own (`Llama.project`, `Llama.mlp`, `Llama.head`): with the cache the logits
equal the full forward's (tests/test_generate.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from dpjax.models.llama import rms_norm


def empty(model, B: int, length: int, dtype=jnp.float32) -> dict:
    """A cache for B sequences of up to `length` tokens."""
    c = model.config
    shape = (c.n_layers, B, length, c.n_kv_heads, c.d_model // c.n_heads)
    return {"k_LxBxOxYxK": jnp.zeros(shape, dtype), "v_LxBxOxYxK": jnp.zeros(shape, dtype)}


def forward(model, params, tokens_BxT, start, cache):
    """(logits B x T x V of tokens at positions start .. start+T-1, the cache with their
    keys and values written). Attention sees the cache up to each token's own position."""
    c = model.config
    B, T = tokens_BxT.shape
    length = cache["k_LxBxOxYxK"].shape[2]
    positions_BxT = jnp.broadcast_to(start + jnp.arange(T), (B, T))
    x_BxTxD = model.embed(params, tokens_BxT)

    def layer(x_BxTxD, xs):
        blk, k_BxOxYxK, v_BxOxYxK = xs
        h_BxTxD = rms_norm(x_BxTxD, blk["attn_norm"]["scale_LsxD"], c.norm_eps)
        q_BxTxHxK, k_BxTxYxK, v_BxTxYxK = model.project(blk["attn"], h_BxTxD, positions_BxT)
        k_BxOxYxK = lax.dynamic_update_slice(k_BxOxYxK, k_BxTxYxK.astype(k_BxOxYxK.dtype), (0, start, 0, 0))
        v_BxOxYxK = lax.dynamic_update_slice(v_BxOxYxK, v_BxTxYxK.astype(v_BxOxYxK.dtype), (0, start, 0, 0))
        group = c.n_heads // c.n_kv_heads
        k_BxOxHxK, v_BxOxHxK = (jnp.repeat(a, group, axis=2) for a in (k_BxOxYxK, v_BxOxYxK))
        s_BxHxTxO = jnp.einsum("bthk,bohk->bhto", q_BxTxHxK, k_BxOxHxK).astype(jnp.float32) / math.sqrt(
            q_BxTxHxK.shape[-1])
        visible_TxO = jnp.arange(length)[None, :] <= (start + jnp.arange(T))[:, None]
        s_BxHxTxO = jnp.where(visible_TxO, s_BxHxTxO, jnp.finfo(jnp.float32).min)
        p_BxHxTxO = jax.nn.softmax(s_BxHxTxO, axis=-1).astype(v_BxOxHxK.dtype)
        o_BxTxHxK = jnp.einsum("bhto,bohk->bthk", p_BxHxTxO, v_BxOxHxK)
        x_BxTxD = x_BxTxD + jnp.einsum("bthk,hkd->btd", o_BxTxHxK, blk["attn"]["wo_LsxHmxKxD"])
        x_BxTxD = x_BxTxD + model.mlp(blk, x_BxTxD)
        return x_BxTxD, (k_BxOxYxK, v_BxOxYxK)

    x_BxTxD, (k, v) = lax.scan(layer, x_BxTxD, (params[model.LAYERS], cache["k_LxBxOxYxK"], cache["v_LxBxOxYxK"]))
    return model.head(params, x_BxTxD), {"k_LxBxOxYxK": k, "v_LxBxOxYxK": v}
