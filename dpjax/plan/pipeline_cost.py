"""The bubble and the memory of a pipeline, read from compiled programs.

`dpjax.hlo` counts the matrix FLOPs one device executes from a compiled program's text
(every device runs the same SPMD program; loop bodies trip-count times, cuBLAS / cuDNN
calls included: the count the run's hardware FLOPs use, and true on a GPU, where XLA's
`cost_analysis()` counts those calls as nothing). In lockstep a stage's idle slots compute on
placeholder data (`engine`), so they are executed FLOPs: the bubble is

    1 - useful / executed,

executed: the FLOPs of the pipelined gradient program on S stages, its tick loops
    unrolled (as the step runs them);
useful: the FLOPs of the same per-device work with no idle slot: the one-stage program
    over the device's own L/S layers, the same micro-batches (for interleaved, the same
    V chunks of L/(SV) layers), which has no fill or drain. Like every stage of the
    S-stage program it embeds and runs the head in each forward slot (masked where they
    do not belong), so the two differ only in the slots executed.

`plain_flops` sets the one-stage program against the unpipelined model
(`jax.value_and_grad(model.loss)` on each micro-batch): it must be that work plus the
re-materialised forward of the layers (and, with V chunks, the ends of the model in
every chunk's slot), and nothing else: an engine that ran idle work in every program
alike would pass the bubble check, not this one. Memory: `train_memory` is the
compiled train step's memory analysis (arguments: parameters, optimizer state, batch;
temporaries: activations, stash, gradients), of a step the caller built.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.compute import stack as stack_runner
from dpjax.hlo import Module
from dpjax.mesh import data_axes, make_mesh
from dpjax.pipeline import Pipeline, bubble_formula, staged
from dpjax.sharding import make_layout


def program_flops(lowered) -> float:
    """The matrix FLOPs of one run of a lowered program, compiled (`dpjax.hlo`); an error
    naming what cannot be counted, never a short count."""
    flops = Module(lowered.compile().as_text()).flops()
    if flops.value is None:
        raise ValueError(f"cannot count the FLOPs of {', '.join(flops.unknown)}")
    return flops.value


def _placed(layout, model):
    shapes = jax.eval_shape(lambda k: layout.store(model.init(k)), jax.random.key(0))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, layout.shardings())


def _batch(mesh, rows: int, seq_len: int, lead=()):
    spec = P(*[None] * len(lead), data_axes(mesh) or None)
    return jax.ShapeDtypeStruct((*lead, rows, seq_len + 1), np.int32, sharding=NamedSharding(mesh, spec))


def gradient_flops(model, mesh, pipe: Pipeline, rows: int) -> float:
    """FLOPs of one device's pipeline schedule (its ticks: loss and this stage's gradients)
    on a global batch of `rows` sequences, ticks unrolled."""
    layout = make_layout(model, mesh, pipeline=dataclasses.replace(pipe, unroll=True))
    st = staged.for_model(model, layout)
    par = layout.parallel()
    # The ticks alone: the shared leaves' allreduce over `stage` after them is no slot's work
    # (and unrolled, XLA fuses the chain of per-tick sums into each slice of its ring, so
    # the sums would be counted once a slice). Each device's outputs are its own (P():
    # only their FLOPs are read).
    dp = int(np.prod([mesh.shape[a] for a in data_axes(mesh)], dtype=np.int64))

    def ticks(params, batch_BdxT1):
        assert batch_BdxT1.shape == (rows // dp, model.config.seq_len + 1), (batch_BdxT1.shape, rows, dp)
        return st.schedule(params, batch_BdxT1, par)

    fn = jax.jit(jax.shard_map(ticks, mesh=mesh, in_specs=(layout.specs, P(data_axes(mesh) or None)), out_specs=P(),
                               check_vma=False))
    return program_flops(fn.lower(_placed(layout, model), _batch(mesh, rows, model.config.seq_len)))


def with_layers(model, n_layers: int):
    return type(model)(dataclasses.replace(model.config, n_layers=n_layers))


def one_stage_mesh():
    return make_mesh("stage=1", jax.devices()[:1])


def measure_bubble(model, stages: int, pipe: Pipeline, rows: int) -> dict:
    """executed / useful FLOPs of `pipe` on a `stage=S` mesh (S devices, one replica of
    `rows` sequences) and the bubble they give, beside the papers' formula; and the useful
    program against the work expected of it (`useful_vs_expected`, 1 when the engine adds
    nothing else): the unpipelined model's (`plain_flops`, with the re-materialised
    forward) and, with V chunks, the V - 1 extra passes of the ends a micro-batch
    (`ends_flops`; `ends_share`: their part of a slot's FLOPs)."""
    mesh = make_mesh(f"stage={stages}", jax.devices()[:stages])
    pipe = pipe.resolved(stages)
    M, V = pipe.microbatches, pipe.virtual_stages
    assert M is not None  # resolved: one a stage unless given
    executed = gradient_flops(model, mesh, pipe, rows)
    one = with_layers(model, model.config.n_layers // stages)
    useful = gradient_flops(one, one_stage_mesh(), pipe, rows)
    b = rows // M
    ends = ends_flops(one, b)
    # every chunk slot carries the head and the embedding (masked but in the slots of a
    # micro-batch's first and last chunk): V - 1 more of them a micro-batch than needed
    expected = plain_flops(one, M, b) + (V - 1) * M * ends
    return {"executed": executed, "useful": useful, "bubble": 1 - useful / executed,
            "formula": bubble_formula(pipe.schedule, stages, M, V), "expected": expected,
            "useful_vs_expected": useful / expected, "ends_share": ends / (useful / (M * V))}


def ends_flops(model, rows: int) -> float:
    """FLOPs of a slot's work at the ends of the model, which each forward slot runs (masked
    where it does not belong): the embedding and its VJP, the head's loss and gradient."""
    T, D = model.config.seq_len, model.config.d_model
    params = jax.eval_shape(model.init, jax.random.key(0))
    shared = {k: v for k, v in params.items() if k != model.LAYERS}
    tokens = jax.ShapeDtypeStruct((rows, T), np.int32)
    y = jax.ShapeDtypeStruct((rows, T, D), np.float32)

    def ends(sh, tok, y):
        x, embed_vjp = jax.vjp(lambda s: model.embed(s, tok), sh)
        head = jax.value_and_grad(lambda s, y: model.head_loss(s, y, tok), (0, 1))(sh, y)
        return x, embed_vjp(y), head

    return program_flops(jax.jit(ends).lower(shared, tokens, y))


def plain_flops(model, microbatches: int, rows: int) -> float:
    """The unpipelined model's work on `microbatches` micro-batches of `rows` sequences:
    `jax.value_and_grad(model.loss)` on each, plus one more forward of its layers (a
    pipeline's backward re-materialises it from the stage's input)."""
    T = model.config.seq_len
    params = jax.eval_shape(model.init, jax.random.key(0))
    micro = jax.ShapeDtypeStruct((rows, T + 1), np.int32)
    value_and_grad = program_flops(jax.jit(jax.value_and_grad(model.loss)).lower(params, micro))

    def layers(stack, x_BxTxD):  # the one stack runner (scanned: the HLO count reads the loop's trip count)
        index_L = jnp.arange(stack_runner.depth(stack)) if model.INDEXED_LAYERS else None
        return stack_runner.run(model.layer, stack, x_BxTxD, index_L=index_L)

    x = jax.ShapeDtypeStruct((rows, T, model.config.d_model), np.float32)
    forward = program_flops(jax.jit(layers).lower(params[model.LAYERS], x))
    return microbatches * (value_and_grad + forward)


def train_memory(step, model, global_batch: int):
    """The compiled train step's memory analysis (per device) of `step`, a built
    `dpjax.step.TrainStep` of `model` (the caller builds it: the pipeline sits below the
    step builder and does not import it), one backward pass of `global_batch` sequences."""
    params, state = jax.eval_shape(step.init, _placed(step.layout, model))
    batch = _batch(step.layout.mesh, global_batch, model.config.seq_len, (1,))
    return step.train.lower(params, state, batch).compile().memory_analysis()


__all__ = ["ends_flops", "gradient_flops", "measure_bubble", "plain_flops", "program_flops", "train_memory"]
