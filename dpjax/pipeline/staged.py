"""A model cut into stages for `dpjax.step.build`: the pipelined loss and gradient.

`for_model(model, layout)` gives the two functions the step builder takes in place of
`model.loss` and `jax.value_and_grad(model.loss)` when the layout has a stage axis. Per
device, inside the step's shard_map:

    FSDP: the stage's parameters all-gathered over the data axes once per step (not once
          per micro-batch); the gather's VJP reduce-scatters the summed gradient at the end
    the replica's batch, Bd x T+1, cut into M micro-batches of Bd/M rows
    engine.run(timetable, ...)      the schedule: loss and this stage's gradients
    the gradient of the shared leaves (embedding, final norm) summed over `stage`: the
    embedding's from the first stage plus the tied head's from the last

Everything else (the average over the data axes, the update rule, clipping with a norm
summed over every axis that splits a leaf, `stage` included) is the step builder's, as
for any layout.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dpjax import collectives, fusion
from dpjax.compute import context, stack
from dpjax.mesh import STAGE
from dpjax.pipeline import engine, timetable


class Staged(NamedTuple):
    loss: Callable  # (params, batch_BdxT1, par) -> mean loss over the replica's batch
    value_and_grad: Callable  # (params, batch_BdxT1, par) -> (loss, gradients like params)
    schedule: Callable  # (params, batch_BdxT1, par) -> engine.run's (loss, d_shared, d_chunks): the ticks alone
    timetable: object


def _stage_algorithm(algorithm: str) -> str:
    # an algorithm over (outer, inner) levels needs two axes; `stage` is one
    return "ring" if collectives.registry.nested(algorithm) else algorithm


def for_model(model, layout, algorithm: str = "ring", split=None) -> Staged:
    """The pipelined loss and gradient of `model` (its `LAYERS` stack split over `stage`,
    `embed`, `layer` and `head_loss` pieces) on `layout` (which carries the `Pipeline`);
    `algorithm`: dpjax's allreduce for the shared leaves' gradient over `stage`. split:
    LoRA's `dpjax.models.lora.Split` (its trained part inside the layer stack: the
    adapters); value_and_grad then gives the gradient of that part only, the frozen rest
    a constant of each chunk, embedding and head (never differentiated, nothing summed
    over `stage`)."""
    pipe, S = layout.pipeline, layout.mesh.shape[STAGE]
    tt = timetable(pipe, S)
    M, V, key = tt.microbatches, tt.chunks, model.LAYERS
    algorithm = _stage_algorithm(algorithm)

    def prepare(params, batch_BdxT1, par):
        return _prepare(model, M, V, params, batch_BdxT1, par, S)

    def loss(params, batch_BdxT1, par):
        pieces, shared, chunks_GxL, batch_MxBxT1, _ = prepare(params, batch_BdxT1, par)
        return engine.run(tt, pieces, shared, chunks_GxL, batch_MxBxT1, axis=STAGE, grad=False, unroll=pipe.unroll)

    def schedule(params, batch_BdxT1, par):
        pieces, shared, chunks_GxL, batch_MxBxT1, _ = prepare(params, batch_BdxT1, par)
        return engine.run(tt, pieces, shared, chunks_GxL, batch_MxBxT1, axis=STAGE, unroll=pipe.unroll)

    def value_and_grad(params, batch_BdxT1, par):
        if split is not None:
            return _trained_value_and_grad(model, M, V, S, tt, split, pipe.unroll, params, batch_BdxT1, par)
        pieces, shared, chunks_GxL, batch_MxBxT1, unshard = prepare(params, batch_BdxT1, par)
        loss, d_shared, d_chunks = engine.run(tt, pieces, shared, chunks_GxL, batch_MxBxT1, axis=STAGE,
                                              unroll=pipe.unroll)
        grads = {**d_shared, key: jax.tree.map(lambda g: g[0] if V == 1 else g, d_chunks)}
        if unshard is not None:
            (grads,) = unshard(grads)
        # The shared leaves' gradient lives on the stages that used them (embedding: first;
        # tied head, final norm: last): summed over the stage axis, each stage ends with it
        # whole. One fused buffer, one allreduce: XLA:CPU's runtime can mix up independent
        # collective-permutes over the same devices running at once (a rendezvous check
        # fails, seen with a ring per leaf on a 4-of-8-device mesh).
        shared = {k: g for k, g in grads.items() if k != key}
        plan = fusion.plan_buckets(shared, float("inf"))
        summed = [collectives.allreduce(buf, STAGE, algorithm=algorithm, op="sum") for buf in fusion.pack(plan, shared)]
        return loss, {**fusion.unpack(plan, summed), key: grads[key]}

    return Staged(loss, value_and_grad, schedule, tt)


def _trained_value_and_grad(model, M: int, V: int, S: int, tt, split, unroll: bool, params, batch_BdxT1, par):
    """(loss, gradient of `split.trained(params)`): the schedule differentiates the trained
    leaves of each chunk only (LoRA's adapters, every one stacked on the layer axis); the
    frozen base enters each chunk, the embedding and the head as a constant. Under FSDP the
    frozen part is gathered without a VJP (no reduce-scatter of a gradient it never gets)."""
    key = model.LAYERS
    trained, frozen = split.trained(params), split.frozen(params)
    unshard = None
    if par.gather_dims is not None:
        dims = par.gather_dims
        trained, unshard = jax.vjp(dataclasses.replace(par, gather_dims=split.trained(dims)).use, trained)
        frozen = dataclasses.replace(par, gather_dims=split.frozen(dims)).use(frozen)
    dense = dataclasses.replace(par, gather_dims=None)
    whole, shared, frozen_GxL, batch_MxBxT1, _ = _prepare(model, M, V, frozen, batch_BdxT1, dense, S)
    trained_GxL = jax.tree.map(lambda w: w[None] if V == 1 else w, trained)

    def chunk(w, x, r):  # the chunk's adapters joined to its frozen base layers
        base = jax.tree.map(lambda c: c[r], frozen_GxL)
        return whole.chunk(split.join(w, {key: base})[key], x, r)

    # nothing outside the layers is trained: the engine differentiates an empty `shared`
    pieces = engine.Pieces(embed=lambda _, tok: whole.embed(shared, tok), chunk=chunk,
                           loss=lambda _, y, tgt: whole.loss(shared, y, tgt))
    loss, _, d_GxL = engine.run(tt, pieces, {}, trained_GxL, batch_MxBxT1, axis=STAGE, unroll=unroll)
    grads = jax.tree.map(lambda g: g[0] if V == 1 else g, d_GxL)
    if unshard is not None:
        (grads,) = unshard(grads)
    return loss, grads


def _prepare(model, M: int, V: int, params, batch_BdxT1, par, S: int = 1):
    """What `engine.run` takes from one device's parameters and rows: (pieces, shared,
    chunks_GxL, the M micro-batches, the FSDP gather's VJP or None). The FSDP-split
    parameters are gathered here once (the pieces then use them as they are), the stage's
    layers cut into its V chunks and the rest kept as `shared`."""
    key = model.LAYERS
    B, T1 = batch_BdxT1.shape
    assert T1 == model.config.seq_len + 1, (batch_BdxT1.shape, model.config.seq_len)
    assert B % M == 0, f"{M} micro-batches do not divide the replica's {B} rows (dpjax.pipeline.check_batch)"
    unshard = None
    if par.gather_dims is not None:
        params, unshard = jax.vjp(par.use, params)
    dense = dataclasses.replace(par, gather_dims=None)  # gathered already: the pieces use them as they are
    stack_Ls = params[key]
    # V = 1: the stage's L/S layers are its one chunk; V > 1: stored V x L/(SV) already
    chunks_GxL = jax.tree.map(lambda w: w[None] if V == 1 else w, stack_Ls)
    n = jax.tree.leaves(chunks_GxL)[0].shape[1]
    assert all(w.shape[:2] == (V, n) for w in jax.tree.leaves(chunks_GxL)), jax.tree.map(jax.numpy.shape, chunks_GxL)
    shared = {k: v for k, v in params.items() if k != key}
    # with a context axis each device embeds, runs and scores its own chunks of every sequence
    # (`dpjax.compute.context.split`: the identity without one); the stages send those
    pieces = engine.Pieces(embed=lambda sh, tok: model.embed(sh, context.split(tok, dense), dense),
                           chunk=_chunk_fn(model, dense, S, V),
                           loss=lambda sh, y, tgt: model.head_loss(sh, y, context.split(tgt, dense), dense))
    return pieces, shared, chunks_GxL, batch_BdxT1.reshape(M, B // M, T1), unshard


def _chunk_fn(model, par, S: int, V: int):
    """chunk(chunk_L, x, r) -> x: chunk r's layers run by the one stack runner. A model
    whose layers differ by their index (`INDEXED_LAYERS`) gets each one's in the whole
    model: chunk r of stage s holds layers (r S + s) n .. (r S + s + 1) n - 1 (n = L / SV;
    `dpjax.pipeline.store` keeps the stack V x L/V, `stage` splitting the second axis)."""
    L = model.config.n_layers

    def chunk(chunk_L, x_BxTxD, r):  # a chunk's layers, gathered already, by the one stack runner
        if not model.INDEXED_LAYERS:
            return stack.run(model.layer, chunk_L, x_BxTxD, par)
        n = L // (S * V)
        first = (r * S + lax.axis_index(STAGE)) * n if S > 1 else r * n
        return stack.run(model.layer, chunk_L, x_BxTxD, par, index_L=first + jnp.arange(n))
    return chunk
