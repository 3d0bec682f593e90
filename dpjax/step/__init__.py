"""THE step builder: a plan (`dpjax.plan`) -> jitted steps, and what a run needs around them.

Every training step dpjax runs is built from one `Plan` by `build` (`dpjax.step.builder`,
the programs and what each device holds inside them; `dpjax.step.gradient`, the worker's
gradient they run). This module is where callers come in: the steps for a plan or a
model (`for_plan`, `for_model`), for research code's own loss and rule
(`make_update_step`), a step's programs kept across restarts (`kept`), and the values
the programs take, placed in their shardings without a device ever holding the whole
(`init_params`, `put_batch`, `replicated`).

The room is three files because they change for different reasons: a new entry point or
placement here, a new program or layout in the builder, a new way to reduce a gradient
in `gradient`. `build` and `TrainStep` are this module's too (`dpjax.step.build`): the
entry points build with them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.mesh import data_axes
from dpjax.pipeline import staged as pipeline_staged
from dpjax.plan import Exchange, Plan, for_layout, for_rule
from dpjax.sharding import Layout
from dpjax.step.builder import TrainStep, build
from dpjax.tasks import TASKS
from dpjax.updates import UpdateRule


def for_plan(plan: Plan, donate: bool = True, clock=None) -> TrainStep:
    """The steps of a plan made for a dpjax model (`plan.model`: `loss(params, batch,
    par)`, `init`): its own loss, or on a layout with a stage axis the pipeline's schedule
    in place of value_and_grad(model.loss)."""
    model, layout = plan.model, plan.layout
    abstract = jax.eval_shape(lambda k: plan.policy.store(layout.store(model.init(k))), jax.random.key(0))
    if layout.pipeline is None:
        task = TASKS[plan.task]  # what the step optimises (dpjax.tasks): lm's loss is the model's own
        stats = task.loss_and_stats(model, plan.settings) if model.has_stats or task.reports else None
        return build(task.loss(model, plan.settings), plan, abstract_params=abstract, donate=donate, clock=clock,
                     loss_and_stats=stats)
    staged = pipeline_staged.for_model(model, layout, plan.exchange.algorithm, split=plan.split)
    return build(staged.loss, plan, abstract_params=abstract, donate=donate, value_and_grad=staged.value_and_grad,
                 clock=clock)


def for_model(model, layout: Layout, *, global_batch: int, update="sync", opt=None, passes: int = 1,
              exchange: Exchange = Exchange(), links: tuple = (), seed: int = 0, donate: bool = True,
              clock=None) -> TrainStep:
    """The steps of a dpjax model on a layout made by hand: `for_plan` of
    `dpjax.plan.for_layout(...)` (the same arguments)."""
    return for_plan(for_layout(model, layout, global_batch=global_batch, update=update, opt=opt, passes=passes,
                               exchange=exchange, links=links, seed=seed), donate=donate, clock=clock)


def make_update_step(loss_fn, rule: UpdateRule, mesh, params, *, param_specs=None, passes: int = 1,
                     exchange: Exchange = Exchange(), donate: bool = True) -> TrainStep:
    """The steps of `rule` for research code: `loss_fn(params, local_batch) -> scalar`.

    params: the parameters (or their shapes); param_specs: a PartitionSpec per parameter
    over the non-data axes (default P(): a replica on every `model` rank). The rule's
    axes (its `axis_name`) are the worker axes; any other data axes average gradients
    synchronously inside each worker (`dpjax.plan.for_rule`). The train batch is A x B
    (A = passes).
    """
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params)
    plan = for_rule(rule, mesh, abstract, param_specs=param_specs, passes=passes, exchange=exchange)
    return build(lambda p, b, par: loss_fn(p, b), plan, abstract_params=abstract, donate=donate)


def init_params(model, layout: Layout, key, policy=None, keep=None):
    """The model's parameters, created by a jitted init directly in their sharding: no
    device ever holds a whole sharded weight, and the values do not depend on the mesh
    (jax's partitionable threefry). policy: a `dpjax.compute.policy.Policy` whose param_dtype the
    master weights take (default: as the model makes them, float32); keep: a
    `dpjax.recovery.programs.Programs.keep` (the compiled init kept across restarts)."""
    store = (lambda p: p) if policy is None else policy.store
    init = jax.jit(lambda k: store(layout.store(model.init(k))), out_shardings=layout.shardings())
    return (init if keep is None else keep("init_params", init))(key)


def kept(step: TrainStep, keep, tag: str = "") -> TrainStep:
    """`step` with each program kept by `keep` (`dpjax.recovery.programs.Programs.keep`): a
    restarted process loads their executables instead of tracing and compiling them.
    tag: what tells this step's programs from another step's of the same run (an
    autotune's settings)."""
    return dataclasses.replace(step, **{f: keep(f"{f}{tag}", getattr(step, f))
                                        for f in ("init", "train", "evaluate", "flush", "consensus")})


def replicated(mesh):
    return NamedSharding(mesh, P())


def put_batch(stream, cursor: int, global_batch: int, mesh, passes: int | None = None, rows: int | None = None):
    """The global batch at `cursor` as one sharded array; each process reads only the rows
    its devices hold, each once (the devices along `model` that share a block get one
    read). passes=A: A consecutive batches stacked, A x B x T+1 (the train step's
    micro-batches). A stream whose batch is a dict of arrays (a task's: `dpjax.tasks`)
    gives a dict of sharded arrays, every leaf split by rows alike. rows: the rows a batch
    of `global_batch` examples fills when not one each (packed: `dpjax.data.sft.PackedStream`);
    the cursor still moves by examples."""
    R = global_batch if rows is None else rows
    rows = data_axes(mesh) or None
    read = {}  # block index -> rows read: the callback runs once per device, not per block

    def once(key, fn):
        if key not in read:
            read[key] = fn()
        return read[key]

    if passes is None:
        spec, lead = P(rows), (R,)

        def block(idx):
            return once(idx[0].indices(R), lambda: stream.batch(cursor, global_batch, rows=idx[0]))
    else:
        spec, lead = P(None, rows), (passes, R)

        def block(idx):
            return once((idx[0].indices(passes), idx[1].indices(R)), lambda: _stacked(
                [stream.batch(cursor + k * global_batch, global_batch, rows=idx[1]) for k in range(passes)[idx[0]]]))

    sharding = NamedSharding(mesh, spec)
    shape = (*lead, stream.seq_len + 1)
    first = block(next(iter(sharding.addressable_devices_indices_map(shape).values())))
    if not isinstance(first, dict):
        return jax.make_array_from_callback(shape, sharding, block)
    return {k: jax.make_array_from_callback((*lead, *v.shape[len(lead):]), sharding,
                                            lambda idx, k=k: block(idx)[k]) for k, v in first.items()}


def _stacked(batches):
    if isinstance(batches[0], dict):
        return {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    return np.stack(batches)


def num_bytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
