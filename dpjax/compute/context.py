"""The `context` axis: long sequences split over devices, and the attention across them.

Each sequence of T tokens is cut into 2C chunks of c = T/2C; device i of the C devices
along `context` holds chunks i and 2C-1-i (causal load balancing: under the causal mask
an early chunk has little to attend to and a late one much, so every device takes one of
each; Brandon et al., "Striped attention", 2023, and the zig-zag layout of Llama 3's
context parallelism). Its tokens keep their global positions (the position embedding
and the mask read them). Everything but attention is per token, so only attention crosses
the axis, by one of the registered algorithms (`CONTEXT_ATTENTIONS`, `--context-attention`):

    ring       Liu et al., "Ring attention with blockwise transformers" (2023): the K/V
               blocks travel round a ring of ppermutes (`dpjax.collectives.p2p.send`,
               so links and timelines see each hop); each device folds every block it
               receives into a blockwise softmax with a running max m and sum l
               (Milakov & Gimelshein 2018; FlashAttention's recurrence). The send of
               the next block is issued before the current block is computed, so XLA
               may overlap them. Under the zig-zag layout a block from another device
               is exactly half needed: from an earlier device all my queries see its
               first chunk; from a later one only my second chunk sees all of it; so
               each step computes half a block and no device idles.
    allgather  all-gather K and V over the axis (`dpjax.collectives.all_gather`), then
               attend the local queries to all T keys, masked by global positions.

The backward pass of both is JAX's autodiff of the forward: the transpose of each
ppermute is a ppermute of the cotangent the other way, so the backward of the ring is a
second ring carrying dK / dV home (the same bytes as the forward); the backward of the
all-gather is a reduce-scatter. Blocks are computed with the scores written out in
float32 (`dpjax.compute.attention.naive`'s math), whatever the policy's kernel.

Packed rows (`dpjax.compute.attention`'s segment ids) and sliding windows: the ring
sends each block's segment ids beside its K/V (B x T/C int32 a hop) and the all-gather
gathers them; every block is then masked by `attention.allowed` at the keys' global
positions (causal, same segment, within the window), and the half blocks causality
skips stay skipped. Without them the program is the one above, op for op. Soft-capped
scores (`softcap`, Gemma 2's) are capped in every block before the mask, as the local
kernels cap them.

Grouped-query attention (`dpjax.models.llama`: Y K/V heads serving H query heads) passes
the Y heads; each block repeats them to the H where it computes (`shared`).

Per layer and device, per forward pass, with KV = 2 B (T/C) H K values the local K and V
(H: the K/V heads, Y under grouped-query attention):
both send (C-1) KV values in C-1 steps, which is the bound: a device must receive the
K and V of the other C-1 devices (`schedule`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dpjax import collectives
from dpjax.compute.attention import allowed, kernel as local_kernel, soft_cap
from dpjax.compute.tensor_parallel import _active
from dpjax.collectives.ranks import axis_size, index, shift_perm
from dpjax.collectives import cost as collective_cost
from dpjax.collectives.cost import Schedule
from dpjax.collectives.p2p import send
from dpjax.registry import Registry


def chunk_positions(T: int, C: int, i) -> np.ndarray | jax.Array:
    """The global positions of device i's T/C tokens: chunk i, then chunk 2C-1-i (c = T/2C
    each). `i` may be a traced index (inside a shard_map) or an int."""
    c, xp = T // (2 * C), np if isinstance(i, (int, np.integer)) else jnp
    return xp.concatenate([i * c + xp.arange(c), (2 * C - 1 - i) * c + xp.arange(c)])


def layout_order(T: int, C: int) -> np.ndarray:
    """Every position in the order the devices hold them (device 0's tokens, then 1's, ...):
    what `split` then a gather over the axis gives, and the keys' order after `allgather`."""
    return np.concatenate([chunk_positions(T, C, i) for i in range(C)])


def active(par) -> bool:
    """Whether `par` (a `dpjax.compute.tensor_parallel.Parallel`) splits sequences over a context axis here."""
    return _active(getattr(par, "context_axis", None))


def split(x_BxT, par):
    """This device's tokens of whole sequences B x T (dim 1): chunks i and 2C-1-i, B x T/C.
    The sequences themselves where no context axis is active."""
    if not active(par):
        return x_BxT
    C, i, T = axis_size(par.context_axis), index(par.context_axis), x_BxT.shape[1]
    c = T // (2 * C)
    assert T % (2 * C) == 0, (T, C)  # dpjax.plan refused anything else
    return jnp.concatenate([lax.dynamic_slice_in_dim(x_BxT, i * c, c, axis=1),
                            lax.dynamic_slice_in_dim(x_BxT, (2 * C - 1 - i) * c, c, axis=1)], axis=1)


def positions(T_local: int, par):
    """The global positions of this device's T_local tokens (0 .. T-1 when not split)."""
    if not active(par):
        return jnp.arange(T_local)
    C = axis_size(par.context_axis)
    return chunk_positions(T_local * C, C, index(par.context_axis))


def kernel(par) -> Callable:
    """The attention core `(q, k, v, segment_ids_BxT=None, window=None) -> out` (B x T/C x
    H x K each; this device's segment ids, B x T/C) a layer calls: the policy's local
    kernel, or, with a context axis, the policy's context attention."""
    if not active(par):
        return local_kernel(par.policy.attention)
    algorithm = CONTEXT_ATTENTIONS[par.policy.context_attention]

    def core(q, k, v, segment_ids_BxT=None, window=None, softcap=None):
        return algorithm.attend(q, k, v, par.context_axis, segment_ids_BxT=segment_ids_BxT, window=window,
                                softcap=softcap)
    return core


# ---------------------------------------------------------------------------------------
# Blockwise softmax: (o, m, l) the unnormalised output, running max and sum of a set of query rows


def shared(kv_BxTxYxK, H: int):
    """K or V heads repeated to the H query heads they serve (grouped-query attention: K/V
    head y serves query heads y*H/Y .. (y+1)*H/Y-1, as `dpjax.models.llama`). The ring and
    the all-gather carry only the Y heads and each block repeats them where it computes, so
    a device sends Y/H of the repeated bytes, and the backward (the repeat's transpose)
    sums each group's cotangents before they travel home."""
    Y = kv_BxTxYxK.shape[2]
    assert H % Y == 0, (H, Y)
    return kv_BxTxYxK if Y == H else jnp.repeat(kv_BxTxYxK, H // Y, axis=2)


def _scores(q_BxTxHxK, k_BxTxYxK, softcap=None):
    K = q_BxTxHxK.shape[-1]
    k_BxTxHxK = shared(k_BxTxYxK, q_BxTxHxK.shape[2])
    return soft_cap(jnp.einsum("bqhk,bthk->bhqt", q_BxTxHxK, k_BxTxHxK).astype(jnp.float32) / math.sqrt(K), softcap)


def _first(s_BxHxTxT, v_BxTxYxK):
    """(o, m, l) of the first block a row sees (it always has an unmasked key: itself)."""
    v_BxTxHxK = shared(v_BxTxYxK, s_BxHxTxT.shape[1])
    m_BxHxT = s_BxHxTxT.max(-1)
    p_BxHxTxT = jnp.exp(s_BxHxTxT - m_BxHxT[..., None])
    o_BxTxHxK = jnp.einsum("bhqt,bthk->bqhk", p_BxHxTxT.astype(v_BxTxHxK.dtype), v_BxTxHxK,
                           preferred_element_type=jnp.float32)
    return o_BxTxHxK, m_BxHxT, p_BxHxTxT.sum(-1)


def _fold(stats, s_BxHxTxT, v_BxTxYxK):
    """(o, m, l) with one more block of scores (no masked entry) folded in."""
    v_BxTxHxK = shared(v_BxTxYxK, s_BxHxTxT.shape[1])
    o_BxTxHxK, m_BxHxT, l_BxHxT = stats
    new_BxHxT = jnp.maximum(m_BxHxT, s_BxHxTxT.max(-1))
    p_BxHxTxT = jnp.exp(s_BxHxTxT - new_BxHxT[..., None])
    keep_BxHxT = jnp.exp(m_BxHxT - new_BxHxT)
    o_BxTxHxK = o_BxTxHxK * jnp.swapaxes(keep_BxHxT, 1, 2)[..., None] + jnp.einsum(
        "bhqt,bthk->bqhk", p_BxHxTxT.astype(v_BxTxHxK.dtype), v_BxTxHxK, preferred_element_type=jnp.float32)
    return o_BxTxHxK, new_BxHxT, l_BxHxT * keep_BxHxT + p_BxHxTxT.sum(-1)


def _rows(stats, lo: int, hi: int):
    o, m, total = stats
    return o[:, lo:hi], m[..., lo:hi], total[..., lo:hi]


def _set_rows(stats, part, lo: int):
    return tuple(lax.dynamic_update_slice_in_dim(x, p, lo, axis=1 if x.ndim == 4 else 2) for x, p in zip(stats, part))


def _masked(q_BxTxHxK, k_BxTxYxK, pos_q, pos_k, seg_q=None, seg_k=None, window=None, softcap=None):
    s_BxHxTxT = _scores(q_BxTxHxK, k_BxTxYxK, softcap)
    if seg_q is None and window is None:
        return jnp.where(pos_q[:, None] >= pos_k[None, :], s_BxHxTxT, jnp.finfo(jnp.float32).min)
    return jnp.where(allowed(pos_q, pos_k, seg_q, seg_k, window), s_BxHxTxT, jnp.finfo(jnp.float32).min)


def ring(q_BxTcxHxK, k_BxTcxYxK, v_BxTcxYxK, axis, segment_ids_BxT=None, window: int | None = None,
         softcap: float | None = None):
    """Causal attention of this device's queries (chunks i and 2C-1-i) to the whole
    sequence, the K/V blocks passed round the ring (see the module docstring). Y K/V heads
    may serve the H query heads (Y divides H): the ring carries the Y (`shared`).
    segment_ids_BxT (this device's, B x Tc) travel round the ring beside their K/V block;
    a block's keys are masked by segment and `window` (`dpjax.compute.attention.allowed`)
    at their global positions. A block's half that causality masks whole stays skipped."""
    B, Tc, H, K = q_BxTcxHxK.shape
    Y = k_BxTcxYxK.shape[2]
    assert k_BxTcxYxK.shape == v_BxTcxYxK.shape == (B, Tc, Y, K) and H % Y == 0 and Tc % 2 == 0, (
        q_BxTcxHxK.shape, k_BxTcxYxK.shape)
    C, i, c = axis_size(axis, "ring attention"), index(axis), Tc // 2
    pos, seg_BxTc = chunk_positions(Tc * C, C, i), segment_ids_BxT
    masked = seg_BxTc is not None or window is not None
    if seg_BxTc is not None:
        assert seg_BxTc.shape == (B, Tc), (seg_BxTc.shape, q_BxTcxHxK.shape)
    # my own block, causal (and by segment, window): a row always sees itself
    stats = _first(_masked(q_BxTcxHxK, k_BxTcxYxK, pos, pos, seg_BxTc, seg_BxTc, window, softcap), v_BxTcxYxK)
    block = jnp.stack([k_BxTcxYxK, v_BxTcxYxK])  # 2 x B x Tc x Y x K, with segments (it, B x Tc ids)
    if seg_BxTc is not None:
        block = (block, seg_BxTc)
    ahead = _pass(block, axis, C) if C > 1 else None

    def parts(blk):  # (K/V, their segment ids or None, the sending device j)
        if not masked:
            return blk, None, None
        kv, j = blk
        return (kv[0], kv[1], j) if seg_BxTc is not None else (kv, None, j)

    def earlier(stats, blk):  # from device j < i: all my queries see its first chunk (chunk j) whole
        kv, seg_k, j = parts(blk)
        k_BxTxYxK, v_BxTxYxK = kv[0][:, :c], kv[1][:, :c]
        if not masked:
            return _fold(stats, _scores(q_BxTcxHxK, k_BxTxYxK, softcap), v_BxTxYxK)
        s_BxHxTcxT2 = _masked(q_BxTcxHxK, k_BxTxYxK, pos, j * c + jnp.arange(c), seg_BxTc,
                             None if seg_k is None else seg_k[:, :c], window, softcap)
        return _fold(stats, s_BxHxTcxT2, v_BxTxYxK)

    def later(stats, blk):  # from device j > i: my second chunk (2C-1-i) sees both of its chunks
        kv, seg_k, j = parts(blk)
        mine = _rows(stats, c, Tc)  # before the scores: the unmasked program's order, op for op
        if not masked:
            s_BxHxT2xTc = _scores(q_BxTcxHxK[:, c:], kv[0], softcap)
        else:
            s_BxHxT2xTc = _masked(q_BxTcxHxK[:, c:], kv[0], pos[c:], chunk_positions(Tc * C, C, j),
                                 None if seg_BxTc is None else seg_BxTc[:, c:], seg_k, window, softcap)
        part = _fold(mine, s_BxHxT2xTc, kv[1])
        return _set_rows(stats, part, c)

    for s in range(1, C):
        block = ahead  # the block of device (i - s) mod C
        if s < C - 1:
            ahead = _pass(block, axis, C)  # in flight while this block computes
        j = (i - s) % C
        stats = lax.cond(j < i, earlier, later, stats, (block, j) if masked else block)
    o_BxTcxHxK, _, l_BxHxTc = stats
    return (o_BxTcxHxK / jnp.swapaxes(l_BxHxTc, 1, 2)[..., None]).astype(q_BxTcxHxK.dtype)


def _pass(block, axis, C: int):
    """One hop round the ring: the K/V block, and its segment ids when it has them."""
    if isinstance(block, tuple):
        kv, seg = block
        return send(kv, axis, shift_perm(C), name="kv"), send(seg, axis, shift_perm(C), name="segments")
    return send(block, axis, shift_perm(C), name="kv")


def allgather(q_BxTcxHxK, k_BxTcxYxK, v_BxTcxYxK, axis, segment_ids_BxT=None, window: int | None = None,
              softcap: float | None = None):
    """Causal attention of this device's queries to all T keys, gathered over the axis
    (dpjax's all-gather), masked by global positions. The Y K/V heads are gathered and
    then repeated to the H query heads (`shared`). segment_ids_BxT (this device's, B x Tc)
    are gathered beside them, and the keys masked by segment and `window` too."""
    B, Tc, H, K = q_BxTcxHxK.shape
    Y = k_BxTcxYxK.shape[2]
    assert k_BxTcxYxK.shape == v_BxTcxYxK.shape == (B, Tc, Y, K) and H % Y == 0, (q_BxTcxHxK.shape,
                                                                                  k_BxTcxYxK.shape)
    C = axis_size(axis, "all-gather attention")
    kv_Tcx2xBxYxK = jnp.moveaxis(jnp.stack([k_BxTcxYxK, v_BxTcxYxK]), 2, 0)
    kv_Tx2xBxYxK = collectives.all_gather(kv_Tcx2xBxYxK, axis)  # in device order: layout_order's positions
    k_BxTxYxK, v_BxTxYxK = jnp.moveaxis(kv_Tx2xBxYxK, 0, 2)
    seg_k_BxT = None
    if segment_ids_BxT is not None:
        assert segment_ids_BxT.shape == (B, Tc), (segment_ids_BxT.shape, q_BxTcxHxK.shape)
        seg_k_BxT = collectives.all_gather(segment_ids_BxT.T, axis).T  # the keys' ids, in the same order
    s_BxHxTcxT = _masked(q_BxTcxHxK, k_BxTxYxK, chunk_positions(Tc * C, C, index(axis)),
                         jnp.asarray(layout_order(Tc * C, C)), segment_ids_BxT, seg_k_BxT, window, softcap)
    p_BxHxTcxT = jax.nn.softmax(s_BxHxTcxT, axis=-1).astype(v_BxTxYxK.dtype)
    return jnp.einsum("bhqt,bthk->bqhk", p_BxHxTcxT, shared(v_BxTxYxK, H))


# ---------------------------------------------------------------------------------------
# The registry and the cost model


@dataclass(frozen=True)
class ContextAttention:
    """One context attention: attend(q, k, v, axis, segment_ids_BxT=None, window=None)
    inside a shard_map over the context axis, and cost(C, kv_bytes) -> `Schedule` of one
    forward pass of one layer (kv_bytes: a device's own K and V together); the backward
    pass sends as much again."""

    name: str
    attend: Callable
    cost: Callable


def _ring_cost(C: int, kv_bytes: int) -> Schedule:
    return Schedule(C - 1, (C - 1) * kv_bytes)


def _allgather_cost(C: int, kv_bytes: int) -> Schedule:
    return collective_cost.schedule("ring", C, C * kv_bytes // 4, 4, primitive="all_gather")


def bound_bytes(C: int, kv_bytes: int) -> int:
    """What any context attention must bring to a device per layer and forward pass: the
    K and V of the other C-1 devices."""
    return (C - 1) * kv_bytes


def schedule(name: str, C: int, B: int, T: int, H: int, K: int, itemsize: int = 4) -> Schedule:
    """(steps, bytes a device sends) of context attention `name` for one layer's forward
    pass over B sequences of T tokens, H K/V heads of width K (this device's K/V heads:
    with grouped-query attention the Y that travel, not the query heads)."""
    return CONTEXT_ATTENTIONS[name].cost(C, 2 * B * (T // C) * H * K * itemsize)


CONTEXT_ATTENTIONS: Registry[ContextAttention] = Registry("context attention")
CONTEXT_ATTENTIONS.register(ContextAttention("ring", ring, _ring_cost))
CONTEXT_ATTENTIONS.register(ContextAttention("allgather", allgather, _allgather_cost))
