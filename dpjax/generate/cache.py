"""A decoder's forward pass over a KV cache: a prompt once (prefill), then a token a step.

Each layer keeps the keys and values of every position so far, L x B x O x Y x K (O: the
longest sequence, Y: the K/V heads: a grouped-query model caches H/Y times less than
one with a K/V head per query head); a step computes the new token's Q, K and V only,
writes K and V at its position and attends over the cache up to it (and, in a layer with
a sliding window, over the last `window` positions only). A model whose every layer has
the same window W (Mistral's: `Decoder.cache_window`) keeps W positions a layer instead, a
ring: position p in slot p mod W, written over once the window has passed it, so a long
generation holds W positions, not its length (HuggingFace's sliding-window cache, vLLM's).

The arithmetic is the model's own for any `Decoder` (the GPT, the Llama and the families
built on them): its `embed`, `layer` and `head`, run with a `Decoding` as the layer's
`segments`. That carries the step's positions (which rope, or a learned table, reads)
and the attention core the layer gets from `Decoder.attention`: instead of the training
kernel, `attend` here, which writes the layer's new K and V into its slice of the cache
and attends over it with the window the layer passes. With the cache the logits equal
the full forward's (tests/test_generate.py, tests/test_generate_cache.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from dpjax.compute.attention import allowed, soft_cap
from dpjax.models.base import Decoding

K_CACHE, V_CACHE = "k_LxBxOxYxK", "v_LxBxOxYxK"


def slots(model, length: int) -> int:
    """The positions a layer's cache holds for sequences of up to `length` tokens: all of
    them, or the ring's W (fewer when the sequence is shorter: nothing is then written over)."""
    return length if model.cache_window is None else min(length, model.cache_window)


def empty(model, B: int, length: int, dtype=jnp.float32) -> dict:
    """A cache for B sequences of up to `length` tokens."""
    shape = (model.config.n_layers, B, slots(model, length), model.kv_heads, model.head_dim)
    return {K_CACHE: jnp.zeros(shape, dtype), V_CACHE: jnp.zeros(shape, dtype)}


def attend(q_BxTxHxK, k_BxOxYxK, v_BxOxYxK, start, window=None, softcap: float | None = None, positions_O=None):
    """Queries at positions start .. start+T-1 over the cached keys at `positions_O`
    (default 0 .. O-1; negative: an empty place): each sees the keys at or before its own
    position (the later places of the cache are not written yet) and, with a window w,
    only the last w of them (p-w+1 .. p). Softmax(Q K^T / sqrt(K)) V,
    the scores in float32 and soft-capped by `softcap` before the mask, as
    `dpjax.compute.attention.naive`'s; K/V head y serves query heads y*H/Y .. (y+1)*H/Y-1.
    The window may be traced (an int32 scalar: Gemma's layer picks its own by its index
    inside the scan; the training kernels need it static, the mask here does not)."""
    B, T, H, K = q_BxTxHxK.shape
    O, Y = k_BxOxYxK.shape[1], k_BxOxYxK.shape[2]
    assert k_BxOxYxK.shape == v_BxOxYxK.shape == (B, O, Y, K) and H % Y == 0, (q_BxTxHxK.shape, k_BxOxYxK.shape)
    k_BxOxHxK, v_BxOxHxK = (jnp.repeat(a, H // Y, axis=2) for a in (k_BxOxYxK, v_BxOxYxK))
    s_BxHxTxO = soft_cap(jnp.einsum("bthk,bohk->bhto", q_BxTxHxK, k_BxOxHxK).astype(jnp.float32) / math.sqrt(K),
                         softcap)
    positions_O = jnp.arange(O) if positions_O is None else positions_O
    ok_1x1xTxO = allowed(start + jnp.arange(T), positions_O, window=window) & (positions_O >= 0)
    s_BxHxTxO = jnp.where(ok_1x1xTxO, s_BxHxTxO, jnp.finfo(jnp.float32).min)
    p_BxHxTxO = jax.nn.softmax(s_BxHxTxO, axis=-1).astype(v_BxOxHxK.dtype)
    return jnp.einsum("bhto,bohk->bthk", p_BxHxTxO, v_BxOxHxK)


class _LayerCache:
    """One layer's slice of the cache as the attention core the layer calls: it writes the
    step's K and V at `start` and attends over the result. The layer returns x only, so
    the written slice leaves through `written` (read in the same trace, after the layer)."""

    def __init__(self, k_BxOxYxK, v_BxOxYxK, start, ring: int | None = None):
        self.k, self.v, self.start, self.ring = k_BxOxYxK, v_BxOxYxK, start, ring
        self.written = None

    def __call__(self, q_BxTxHxK, k_BxTxYxK, v_BxTxYxK, window=None, softcap: float | None = None):
        if self.ring is not None:
            return self._ring(q_BxTxHxK, k_BxTxYxK, v_BxTxYxK, window, softcap)
        k = lax.dynamic_update_slice(self.k, k_BxTxYxK.astype(self.k.dtype), (0, self.start, 0, 0))
        v = lax.dynamic_update_slice(self.v, v_BxTxYxK.astype(self.v.dtype), (0, self.start, 0, 0))
        self.written = (k, v)
        return attend(q_BxTxHxK, k, v, self.start, window, softcap).astype(q_BxTxHxK.dtype)

    def _ring(self, q_BxTxHxK, k_BxTxYxK, v_BxTxYxK, window, softcap):
        """The ring's O places hold positions start-O .. start-1 (place j the one that is j
        mod O; negative before the sequence has O). The T new keys are attended beside
        them (a prompt longer than the window sees its own, the ring none of them yet),
        then the last min(T, O) of them written to their places."""
        assert window == self.ring, f"the ring holds {self.ring} positions; this layer's window is {window}"
        O, T, start = self.k.shape[1], k_BxTxYxK.shape[1], self.start
        held_O = start - O + (jnp.arange(O) - start) % O
        new_T = start + jnp.arange(T)
        k = jnp.concatenate([self.k, k_BxTxYxK.astype(self.k.dtype)], axis=1)
        v = jnp.concatenate([self.v, v_BxTxYxK.astype(self.v.dtype)], axis=1)
        out = attend(q_BxTxHxK, k, v, start, window, softcap, positions_O=jnp.concatenate([held_O, new_T]))
        m = min(T, O)
        place_m = new_T[T - m:] % O
        self.written = (self.k.at[:, place_m].set(k[:, O + T - m:]), self.v.at[:, place_m].set(v[:, O + T - m:]))
        return out.astype(q_BxTxHxK.dtype)


def forward(model, params, tokens_BxT, start, cache):
    """(logits B x T x V of tokens at positions start .. start+T-1, the cache with their
    keys and values written). Attention sees the cache up to each token's own position."""
    B, T = tokens_BxT.shape
    positions_BxT = jnp.broadcast_to(start + jnp.arange(T), (B, T))
    x_BxTxD = model.embed(params, tokens_BxT, segments=Decoding(None, positions_BxT))

    def layer(x_BxTxD, xs):
        blk, k_BxOxYxK, v_BxOxYxK, i = xs
        core = _LayerCache(k_BxOxYxK, v_BxOxYxK, start, model.cache_window)
        index = {} if i is None else {"index": i}  # layers that differ by their place (Gemma's local, global)
        x_BxTxD = model.layer(blk, x_BxTxD, segments=Decoding(None, positions_BxT, core), **index)
        if core.written is None:  # a bug of the family's: its layer computes attention some other way
            raise NotImplementedError(f"model {model.name!r}: its layer does not take its attention core from "
                                      "Decoder.attention(par, segments), so it cannot decode with the KV cache")
        return x_BxTxD, core.written

    index_L = jnp.arange(model.config.n_layers) if model.INDEXED_LAYERS else None
    x_BxTxD, (k, v) = lax.scan(layer, x_BxTxD, (params[model.LAYERS], cache[K_CACHE], cache[V_CACHE], index_L))
    return model.head(params, x_BxTxD), {K_CACHE: k, V_CACHE: v}
