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

What a sequence's mask needs beyond causality, and the layer signature that carries it:

    segment_ids  B x T int32, per token: which example of a packed row it belongs to (1, 2,
                 ...; 0 for padding). A query attends to keys of its own segment only
                 (`dpjax.data.packing`: several examples in one row must not see each other).
    window       an int w (static): a query at position p sees keys at p-w+1 .. p only
                 (sliding-window attention: Mistral, Gemma's local layers; Beltagy et al.,
                 "Longformer", 2020). None: every earlier key.
    softcap      a float c (static): the scores soft-capped, c tanh(s / c), before the mask
                 (Gemma 2's attn_logit_softcapping; Gemma Team, "Gemma 2", 2024). None or
                 0: as they are. XLA's fused kernel has no place for the tanh: with a cap,
                 `xla` computes the naive form; `cudnn` is refused (the plan never picks
                 it for a capped model: `dpjax.compute.policy.cudnn_refusal`).

`Segments` carries the per-token part through a model: its `segment_ids_BxT` and
`positions_BxT` (each token's position within its own example, 0 at its start: what a
learned position table or rope reads). A `Decoder` (`dpjax.models.base`) takes it as the
optional last argument of `forward`, `embed`, `layer` and `layer_stats`
(`layer(blk, x, par, segments=None)`); a layer passes `segments.segment_ids_BxT` and its
window to its attention core: `causal(q, k, v, kernel, segment_ids=, window=)` here, or
the context axis's core (`dpjax.compute.context.kernel(par)`, the same keywords). None
everywhere is the unpacked model, traced exactly as before (the same compiled program).

How each kernel takes the mask: naive writes it into the scores; xla and cudnn take the
segment mask as `jax.nn.dot_product_attention`'s boolean `mask` (B x 1 x T x T) and the
window as its `local_window_size=(w-1, 0)`. cuDNN's kernel reads the window natively
(its sliding_window_length) but a boolean mask only as a dense additive bias; its packed
layout (per-segment offsets and lengths) is not in JAX's public API (jax 0.10.2), and dpjax
has not run either on a GPU: the plan therefore keeps cuDNN out of packed runs
(`dpjax.compute.policy.cudnn_refusal`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from dpjax.compute.policy import ATTENTION_NAME, ATTENTIONS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
    """The per-token facts of packed rows a model reads (B x T int32 each; see the module
    docstring): which example each token is of, and its position within it."""

    segment_ids_BxT: jax.Array
    positions_BxT: jax.Array


def allowed(pos_q_T, pos_k_T2, segment_q_BxT=None, segment_k_BxT2=None, window: int | None = None):
    """Which keys each query sees, bool: causal by the row positions given (`pos_q_T`,
    `pos_k_T2`: where each token sits in the whole sequence; global ones over a context
    axis), within the window, and of the same segment. 1 x 1 x T x S without segments, B x
    1 x T x S with them (broadcast over the heads)."""
    d_TxT2 = pos_q_T[:, None] - pos_k_T2[None, :]
    ok_TxT2 = d_TxT2 >= 0
    if window is not None:
        ok_TxT2 = ok_TxT2 & (d_TxT2 < window)
    ok = ok_TxT2[None, None]
    if segment_q_BxT is not None:
        ok = ok & (segment_q_BxT[:, None, :, None] == segment_k_BxT2[:, None, None, :])
    return ok


def _check_window(window) -> None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"attention window {window!r}: a positive int (the keys p-window+1 .. p)")


def soft_cap(s, cap: float | None):
    """cap * tanh(s / cap): scores squashed smoothly into (-cap, cap); None or 0: s."""
    return s if not cap else cap * jnp.tanh(s / cap)


def naive(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, segment_ids_BxT=None, window: int | None = None,
          softcap: float | None = None):
    """Softmax(Q K^T / sqrt(K) + causal mask) V with the scores written out; the mask's
    value is float32's most negative number and the softmax is taken in float32. With
    `segment_ids_BxT` or `window` the mask is `allowed`'s (causal, same segment, in the window);
    with `softcap` the scores are capped first."""
    B, T, H, K = q_BxTxHxK.shape
    assert k_BxTxHxK.shape == v_BxTxHxK.shape == (B, T, H, K), (q_BxTxHxK.shape, k_BxTxHxK.shape, v_BxTxHxK.shape)
    s_BxHxTxT = jnp.einsum("bqhk,bthk->bhqt", q_BxTxHxK, k_BxTxHxK).astype(jnp.float32) / math.sqrt(K)
    s_BxHxTxT = soft_cap(s_BxHxTxT, softcap)
    if segment_ids_BxT is None and window is None:
        ok = jnp.tril(jnp.ones((T, T), bool))
    else:
        _check_window(window)
        ok = allowed(jnp.arange(T), jnp.arange(T), segment_ids_BxT, segment_ids_BxT, window)
    s_BxHxTxT = jnp.where(ok, s_BxHxTxT, jnp.finfo(jnp.float32).min)
    p_BxHxTxT = jax.nn.softmax(s_BxHxTxT, axis=-1).astype(v_BxTxHxK.dtype)
    return jnp.einsum("bhqt,bthk->bqhk", p_BxHxTxT, v_BxTxHxK)


def causal(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, kernel: str = "naive", *, segment_ids_BxT=None,
           window: int | None = None, softcap: float | None = None):
    """Causal attention with the named `kernel` (one of `ATTENTIONS`), its output named
    for remat; `segment_ids_BxT`, `window` and `softcap` as the module docstring says."""
    if kernel not in ATTENTIONS:
        raise ValueError(f"attention kernel {kernel!r}: expected one of {', '.join(ATTENTIONS)}")
    _check_window(window)
    if softcap and kernel == "cudnn":
        raise ValueError(f"attention softcap {softcap}: cuDNN's fused kernel cannot soft-cap the scores")
    if kernel == "naive" or softcap:  # xla's fused kernel has no tanh between its matmuls: the naive form
        out = naive(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, segment_ids_BxT, window, softcap)
    elif segment_ids_BxT is None and window is None:
        out = jax.nn.dot_product_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, is_causal=True, implementation=kernel)
    else:
        mask = None  # B x 1 x T x T: same segment (broadcast over the heads)
        if segment_ids_BxT is not None:
            mask = segment_ids_BxT[:, None, :, None] == segment_ids_BxT[:, None, None, :]
        out = jax.nn.dot_product_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, mask=mask, is_causal=True,
                                           local_window_size=None if window is None else (window - 1, 0),
                                           implementation=kernel)
    assert out.shape == q_BxTxHxK.shape, (out.shape, q_BxTxHxK.shape)
    return checkpoint_name(out, ATTENTION_NAME)


def kernel(name: str):
    """`causal` with its kernel fixed: a `core(q, k, v, segment_ids_BxT=None, window=None, softcap=None)`
    for `tensor_parallel.head_parallel_attention` and the models' layers."""
    def core(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, segment_ids_BxT=None, window=None, softcap=None):
        return causal(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, name, segment_ids_BxT=segment_ids_BxT, window=window,
                      softcap=softcap)
    return core
