"""The KV cache with a sliding window: a grouped-query Mistral whose layers attend over the
last 3 keys gives the windowed full forward's logits through the cache, a ring of 3
positions a layer (a prompt of 5, then a token a step to 8: positions past the window and
the ring's places written over; a prompt of 2, shorter than the ring, too). The windowed
full forward is checked against numpy's masks in tests/test_pack_attention.py; the GPT's
cache in tests/test_generate_checkpoint.py, the plain Llama's in tests/test_generate.py. A
Gemma (local and global layers, a full cache, the window picked by each layer's index
inside the scan, soft-capped scores) through the cache equals its full forward too;
tests/test_gemma.py and test_mistral.py check their cached greedy output against transformers'.
"""

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.generate import cache as kv
from dpjax.models import get_model


def cached_logits(model, params, ids, prefill: int):
    """Logits of every position: `prefill` tokens in one pass, then one token a step."""
    forward = jax.jit(lambda p, t, start, c: kv.forward(model, p, t, start, c))
    got, cache = forward(params, ids[:, :prefill], 0, kv.empty(model, ids.shape[0], ids.shape[1]))
    rows = [np.asarray(got)]
    for t in range(prefill, ids.shape[1]):
        logits, cache = forward(params, ids[:, t:t + 1], t, cache)
        rows.append(np.asarray(logits))
    return np.concatenate(rows, axis=1)


IDS = jnp.asarray([[5, 17, 3, 250, 9, 11, 64, 2], [1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)


def random_params(model, seed: int):
    """Parameters of the model's shapes drawn by numpy (init's random draws cost seconds
    of compiling on this CPU; any values serve a comparison of two forwards)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.3, s.shape), s.dtype), shapes)


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_mistral_ring_cache_equals_its_full_forward():
    """Grouped-query heads (4 query heads, 2 K/V), every layer's window of 3: the cache
    keeps 3 positions a layer, not the sequence's 8."""
    mistral = get_model("mistral", vocab_size=256, seq_len=16, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=32, sliding_window=3)
    assert kv.empty(mistral, 2, IDS.shape[1])[kv.K_CACHE].shape == (2, 2, 3, 2, 4)
    params = random_params(mistral, 4)
    full_windowed = np.asarray(jax.jit(mistral.apply)(params, IDS))
    for prefill in (5, 2):
        _close(cached_logits(mistral, params, IDS, prefill), full_windowed)


def test_a_gemma_cache_equals_its_full_forward():
    """A local then a global layer (window 3: the cache's mask takes the window the layer
    picks by its traced index; the full forward branches by lax.cond), Gemma 3's q/k norms
    and Gemma 2's soft-capped scores at once (a cap of 1: the scores of 0.3-wide random
    weights reach it), grouped-query heads."""
    gemma = get_model("gemma3", vocab_size=256, seq_len=16, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=8, d_ff=32, sliding_window=3, sliding_window_pattern=2, attn_softcap=1.0)
    assert gemma.config.local_layers().tolist() == [True, False]
    params = random_params(gemma, 5)
    _close(cached_logits(gemma, params, IDS, 5), np.asarray(jax.jit(gemma.apply)(params, IDS)))
