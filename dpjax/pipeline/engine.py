"""The tick loop that runs a timetable: forwards, backwards and the sends between stages.

Inside `shard_map` over the stage axis, every stage runs this same program. A tick is

    forward slot   (m, r, ok) = timetable.forward(t, s)
                   x = embed(tokens of m)    on the first chunk (stage 0, r = 0)
                       the activation received from the previous stage    otherwise
                   keep x in the stash; y = chunk_r(x)
                   on the last chunk (stage S-1, r = V-1): the loss of m and its gradient
                   dy/dy_out (seeded with 1/M: the step's loss is the mean over m)
    backward slot  (m, r, ok) = timetable.backward(t, s)
                   dy = the seed    on the last chunk,   the gradient received   otherwise
                   recompute chunk_r from its stashed input and pull dy back through it
                   (`jax.vjp`): the chunk's parameter gradient (accumulated) and dx;
                   on the first chunk dx goes on into the embedding's VJP
    sends          y -> stage s+1, dx -> stage s-1: one `collectives.p2p.send` each
                   ("activations", "gradients"; round the ring, last <-> first, when
                   V > 1), through the point-to-point helper every collective uses

Slots that are not `ok` (fill and drain) compute on whatever the stage holds and their
results are masked away: in lockstep an idle stage waits for the busiest one anyway, and
one program for all stages keeps every collective in step. The embedding and the loss
are masked the same way on the stages that do not own them. Everything crossing a stage
boundary is in the two sends; the parameters never move.

`pieces`: embed(shared, tokens_BxT) -> x_BxTxD, chunk(chunk_params_L, x, r) -> x (chunk r of
this stage: its leaves carry the chunk's layers on the leading axis) and loss(shared, y, targets_BxT)
-> mean loss of a micro-batch. `shared` holds the parameters outside the layers (the
embedding, tied to the head, and the final norm), the same on every stage.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dpjax.collectives.p2p import send
from dpjax.pipeline.schedule import Timetable


class Pieces(NamedTuple):
    embed: Callable
    chunk: Callable
    loss: Callable


def shift(x, axis: str, stages: int, step: int, circular: bool, name: str):
    """x sent `step` (+1 or -1) stages along `axis`, named `name`: the pipeline's one kind
    of collective (`collectives.p2p.send`, so `--link stage=...` charges it and a timeline
    names it). Without `circular`, the stage at the end receives zeros."""
    pairs = [(i, (i + step) % stages) for i in range(stages) if circular or 0 <= i + step < stages]
    if not pairs:
        return jnp.zeros_like(x)
    if pairs == [(0, 0)]:
        return x
    return send(x, axis, pairs, name=name)


def _get(buf, i):
    return lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def _put(buf, i, x, ok):
    """buf[i] = x where `ok`, else unchanged (an idle slot must not clobber a live one)."""
    return lax.dynamic_update_index_in_dim(buf, jnp.where(ok, x, _get(buf, i)), i, 0)


def _add(acc, d, ok):
    return jax.tree.map(lambda a, g: a + jnp.where(ok, g, jnp.zeros_like(g)), acc, d)


def run(tt: Timetable, pieces: Pieces, shared, chunks_GxL, batch_MxBxT1, *, axis: str, grad: bool = True,
        unroll: bool = False):
    """The mean loss over the M micro-batches (on every stage), and with `grad` this
    stage's gradients: (loss, d_shared, d_chunks_GxL). d_shared is this stage's part
    only (the embedding's on the first stage, the head's on the last, zeros elsewhere):
    the caller sums it over the stage axis. unroll: the tick loops as straight-line code
    (XLA's cost analysis counts a loop body once; the bubble measurement needs every tick)."""
    S, M, V = tt.stages, tt.microbatches, tt.chunks
    assert batch_MxBxT1.ndim == 3 and batch_MxBxT1.shape[0] == M, (batch_MxBxT1.shape, M)
    _, b, T1 = batch_MxBxT1.shape
    assert all(c.shape[0] == V for c in jax.tree.leaves(chunks_GxL)), (jax.tree.map(jnp.shape, chunks_GxL), V)
    # Opaque to XLA even where the axis has one stage: no stage's program may fold away an
    # idle slot's work or its masks, so every program executes what its timetable says.
    s = lax.optimization_barrier(lax.axis_index(axis))
    x_spec = jax.eval_shape(pieces.embed, shared, batch_MxBxT1[0, :, :-1])
    # b x T x D, what every send carries (b x T/C x D: a context axis's device embeds its own chunks)
    assert x_spec.shape[0] == b and (T1 - 1) % x_spec.shape[1] == 0, (x_spec.shape, b, T1)
    zeros_x = jnp.zeros(x_spec.shape, x_spec.dtype)

    forward, backward = _slots(tt, pieces, shared, chunks_GxL, batch_MxBxT1, s, x_spec, grad)

    def tick(c, t, do_forward: bool, do_backward: bool):
        c = dict(c)
        if do_forward:  # before the backward: on the last chunk the backward needs this tick's seed
            c["recv_x"] = shift(forward(c, t), axis, S, +1, V > 1, "activations")
        if do_backward:
            c["recv_dx"] = shift(backward(c, t), axis, S, -1, V > 1, "gradients")
        return c, None

    carry = {"recv_x": zeros_x, "loss": jnp.zeros((), jnp.float32)}
    if grad:
        carry.update(recv_dx=zeros_x, stash=jnp.zeros((tt.stash_slots, *x_spec.shape), x_spec.dtype),
                     seeds=jnp.zeros((tt.seed_slots, *x_spec.shape), x_spec.dtype),
                     d_shared=jax.tree.map(jnp.zeros_like, shared), d_chunks=jax.tree.map(jnp.zeros_like, chunks_GxL))
    for ph in tt.phases:
        do_forward, do_backward = ph.forward, ph.backward and grad
        if not (do_forward or do_backward):
            continue
        body = lambda c, t, f=do_forward, b=do_backward: tick(c, t, f, b)  # noqa: E731
        carry, _ = lax.scan(body, carry, jnp.arange(ph.start, ph.start + ph.ticks), unroll=unroll)
    loss = lax.psum(carry["loss"], axis)  # only the last stage's is not zero
    if not grad:
        return loss
    return loss, carry["d_shared"], carry["d_chunks"]


def _slots(tt: Timetable, pieces: Pieces, shared, chunks_GxL, batch_MxBxT1, s, x_spec, grad: bool):
    """(forward(c, t) -> y, backward(c, t) -> dx): what stage `s` computes in tick t's
    forward and backward slots, from and into the carry `c` (the stash, the seeds, the
    received activation and gradient, the accumulated loss and gradients). `run` sends
    what they return; a slot that is not `ok` computes and is masked away."""
    S, M, V = tt.stages, tt.microbatches, tt.chunks

    def micro(m):  # tokens and targets of micro-batch m (clamped: an idle slot's are masked away)
        b_BxT1 = _get(batch_MxBxT1, jnp.clip(m, 0, M - 1))
        return b_BxT1[:, :-1], b_BxT1[:, 1:]

    def chunk(r):
        return jax.tree.map(lambda c: c[r], chunks_GxL)

    def first(r):
        return (s == 0) & (r == 0)

    def last(r):
        return (s == S - 1) & (r == V - 1)

    def forward(c, t):
        m, r, ok = tt.forward(t, s)
        tokens, targets = micro(m)
        x = jnp.where(first(r), pieces.embed(shared, tokens), c["recv_x"])
        y = pieces.chunk(chunk(r), x, r)
        assert x.shape == y.shape == x_spec.shape, (x.shape, y.shape, x_spec.shape)
        done = ok & last(r)
        if grad:
            c["stash"] = _put(c["stash"], tt.stash_slot(m, r, s), x, ok)
            loss, (d_shared, dy) = jax.value_and_grad(lambda sh, y: pieces.loss(sh, y, targets) / M, (0, 1))(shared, y)
            c["d_shared"] = _add(c["d_shared"], d_shared, done)
            c["seeds"] = _put(c["seeds"], m % tt.seed_slots, dy, done)
        else:
            loss = pieces.loss(shared, y, targets) / M
        c["loss"] = c["loss"] + jnp.where(done, loss, 0.0)
        return y

    def backward(c, t):
        m, r, ok = tt.backward(t, s)
        tokens, _ = micro(m)
        dy = jnp.where(last(r), _get(c["seeds"], m % tt.seed_slots), c["recv_dx"])
        _, chunk_vjp = jax.vjp(lambda w, x: pieces.chunk(w, x, r), chunk(r),
                               _get(c["stash"], tt.stash_slot(m, r, s)))
        d_chunk, dx = chunk_vjp(dy)
        assert dy.shape == dx.shape == x_spec.shape, (dy.shape, dx.shape, x_spec.shape)
        c["d_chunks"] = jax.tree.map(lambda a, g: a.at[r].add(jnp.where(ok, g, jnp.zeros_like(g))),
                                     c["d_chunks"], d_chunk)
        _, embed_vjp = jax.vjp(lambda sh: pieces.embed(sh, tokens), shared)
        c["d_shared"] = _add(c["d_shared"], embed_vjp(dx)[0], ok & first(r))
        return dx

    return forward, backward

