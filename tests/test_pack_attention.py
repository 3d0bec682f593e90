"""Packed rows in attention (`dpjax.compute.attention`, `dpjax.compute.context`): the segment
mask and the sliding window against numpy, on the local kernels and across a context axis
(ring, all-gather), gradients too; and no leak across documents in the models: the logits
of an example packed beside others equal its logits alone (GPT and Llama, naive and xla,
and on a context axis), which fails if attention or positions cross a packed boundary."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dpjax.compute import attention, context
from dpjax.compute.attention import Segments
from dpjax.compute.policy import Policy
from dpjax.compute.tensor_parallel import DENSE, Parallel
from dpjax.models import get_model

B, T, H, K = 2, 16, 2, 4
# two rows: three examples then padding; one example across the whole row
SEG = np.array([[1] * 5 + [2] * 3 + [3] * 6 + [0] * 2, [1] * 16], np.int32)


def rand(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def numpy_attention(q, k, v, seg, window):
    """float64, one query at a time: softmax over the keys j <= i of its segment within the window."""
    out = np.zeros(q.shape, np.float64)
    for b in range(q.shape[0]):
        for i in range(q.shape[1]):
            keys = [j for j in range(i + 1) if seg[b, j] == seg[b, i] and (window is None or i - j < window)]
            s = np.einsum("hk,jhk->hj", q[b, i].astype(np.float64), k[b, keys].astype(np.float64)) / np.sqrt(K)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, i] = np.einsum("hj,jhk->hk", p / p.sum(-1, keepdims=True), v[b, keys])
    return out


@pytest.mark.parametrize("kernel", ["naive", "xla"])
@pytest.mark.parametrize("window,segments", [(3, False), (None, True), (4, True)])
def test_masked_attention_equals_numpy(kernel, window, segments):
    """Causal, same segment, within the window: each kernel's output is numpy's, query by query."""
    q, k, v = rand(0, B, T, H, K), rand(1, B, T, H, K), rand(2, B, T, H, K)
    seg = SEG if segments else np.ones((B, T), np.int32)
    got = attention.causal(q, k, v, kernel, segment_ids_BxT=jnp.asarray(SEG) if segments else None, window=window)
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, seg, window), rtol=1e-5, atol=1e-6)


def test_a_bad_window_is_refused():
    q = rand(0, 1, 4, 1, K)
    with pytest.raises(ValueError, match="window"):
        attention.causal(q, q, q, "naive", window=0)


@pytest.mark.parametrize("name,C,Y,window", [("ring", 4, 1, None), ("allgather", 4, H, 5),
                                             pytest.param("ring", 4, H, 5, marks=pytest.mark.slow),
                                             pytest.param("allgather", 2, 1, None, marks=pytest.mark.slow),
                                             pytest.param("ring", 8, H, 3, marks=pytest.mark.slow)])
def test_context_attention_with_segments_equals_plain_attention(mesh_of, put, name, C, Y, window):
    """Each device's queries, with their segment ids (travelling round the ring beside the
    K/V blocks, or gathered), give the rows of the plain masked attention over the whole
    sequence; the gradients too (through the ppermutes / the all-gather)."""
    mesh = mesh_of(f"context={C}", C)
    q, cot = rand(0, B, T, H, K), rand(3, B, T, H, K)
    k, v = rand(1, B, T, Y, K), rand(2, B, T, Y, K)
    order = context.layout_order(T, C)

    def body(q, k, v, cot, seg):
        attend = context.CONTEXT_ATTENTIONS[name].attend
        out, vjp = jax.vjp(lambda *a: attend(*a, "context", segment_ids_BxT=seg, window=window), q, k, v)
        return (out, *vjp(cot))

    spec = P(None, "context")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 4, check_vma=False))
    got = fn(*(put(mesh, x[:, order], spec) for x in (q, k, v, cot, SEG)))

    def plain(q, k, v):
        return attention.naive(q, jnp.repeat(k, H // Y, axis=2), jnp.repeat(v, H // Y, axis=2), jnp.asarray(SEG),
                               window)

    out, vjp = jax.vjp(plain, q, k, v)
    np.testing.assert_allclose(np.asarray(got[0]), numpy_attention(q, np.repeat(k, H // Y, 2), np.repeat(v, H // Y, 2),
                                                                   SEG, window)[:, order], rtol=1e-5, atol=2e-6)
    for g, w in zip(got, (out, *vjp(jnp.asarray(cot)))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w)[:, order], rtol=1e-5, atol=2e-6)


# --- no leak across documents, in the models --------------------------------------------------------

SEQ, V = 16, 64
LENGTHS = (5, 7, 3)  # three examples in one row of 16: 15 tokens, one slot of padding
MODELS = {"gpt": get_model("gpt", vocab_size=V, seq_len=SEQ, d_model=16, n_layers=2, n_heads=4, d_ff=32),
          "llama": get_model("llama", vocab_size=V, seq_len=SEQ, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                             d_ff=32)}


def packed_row():
    """(alone: each example in a row of its own, padded after it; packed: the three in one row, and
    a second row holding the last two the other way round; their Segments)."""
    rng = np.random.default_rng(7)
    ex = [rng.integers(1, V, n).astype(np.int32) for n in LENGTHS]
    alone = np.zeros((3, SEQ), np.int32)
    for i, e in enumerate(ex):
        alone[i, :len(e)] = e
    rows = [[0, 1, 2], [2, 1]]
    tokens, seg, pos = (np.zeros((2, SEQ), np.int32) for _ in range(3))
    for r, members in enumerate(rows):
        at = 0
        for s, i in enumerate(members, 1):
            n = LENGTHS[i]
            tokens[r, at:at + n], seg[r, at:at + n], pos[r, at:at + n] = ex[i], s, np.arange(n)
            at += n
    return alone, tokens, seg, pos, rows


def check_no_leak(alone_logits, packed_logits, rows):
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            n = LENGTHS[i]
            np.testing.assert_allclose(packed_logits[r, at:at + n], alone_logits[i, :n], rtol=2e-5, atol=2e-5)
            at += n


@pytest.fixture(scope="module")
def params():
    return {name: m.init(jax.random.key(0)) for name, m in MODELS.items()}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("kernel", ["naive", "xla"])
def test_an_example_packed_beside_others_has_its_logits_alone(params, name, kernel):
    """Its own positions (restarting at 0: the GPT's table, the Llama's rope) and attention to
    itself only: a shared position count or a key of the example before it moves every logit."""
    model, par = MODELS[name], dataclasses.replace(DENSE, policy=Policy(attention=kernel))
    alone, tokens, seg, pos, rows = packed_row()
    fn = jax.jit(lambda p, t, s: model.logits(p, t, par, s))
    alone_logits = np.asarray(fn(params[name], alone, None))
    packed = np.asarray(fn(params[name], tokens, Segments(jnp.asarray(seg), jnp.asarray(pos))))
    check_no_leak(alone_logits, packed, rows)


@pytest.mark.parametrize("name,algorithm", [("llama", "ring"), ("gpt", "allgather"),
                                            pytest.param("gpt", "ring", marks=pytest.mark.slow),
                                            pytest.param("llama", "allgather", marks=pytest.mark.slow)])
def test_no_leak_on_the_context_axis(mesh_of, put, params, name, algorithm):
    """The packed rows split over a context axis of 4 (each device chunks i and 7-i: an
    example straddles devices), their segment ids and positions split alike: each example's
    logits are its logits alone on one device."""
    mesh, model = mesh_of("context=4", 4), MODELS[name]
    par = Parallel(context_axis="context", policy=Policy(context_attention=algorithm))
    alone, tokens, seg, pos, rows = packed_row()
    alone_logits = np.asarray(jax.jit(model.logits)(params[name], alone))

    def body(p, t, s, q):
        split = lambda x: context.split(x, par)  # noqa: E731
        return model.logits(p, split(t), par, Segments(split(s), split(q)))

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), P()), out_specs=P(None, "context"),
                               check_vma=False))
    got = np.asarray(fn(params[name], tokens, seg, pos))
    whole = np.empty_like(got)
    whole[:, context.layout_order(SEQ, 4)] = got  # back from the devices' order to the row's
    check_no_leak(alone_logits, whole, rows)
