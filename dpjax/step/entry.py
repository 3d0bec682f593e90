"""Where callers come in: the steps for a plan or a model (`for_plan`, `for_model`), for
research code's own loss and rule (`make_update_step`), and a step's programs kept across
restarts (`kept`). Each builds with `dpjax.step.builder.build`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dpjax.pipeline import staged as pipeline_staged
from dpjax.compression import Exchange
from dpjax.plan import Plan, for_layout, for_rule
from dpjax.sharding import Layout
from dpjax.step.builder import TrainStep, build
from dpjax.tasks import TASKS
from dpjax.updates import UpdateRule


def for_plan(plan: Plan, donate: bool = True, clock=None) -> TrainStep:
    """The steps of a plan made for a dpjax model (`plan.model`: `loss(params, batch,
    par)`, `init`): its own loss, or on a layout with a stage axis the pipeline's schedule
    in place of value_and_grad(model.loss)."""
    model, layout = plan.model, plan.layout
    assert model is not None, "for_plan builds a dpjax model's steps (research code's own loss: dpjax.step.build)"
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


def kept(step: TrainStep, keep, tag: str = "") -> TrainStep:
    """`step` with each program kept by `keep` (`dpjax.recovery.programs.Programs.keep`): a
    restarted process loads their executables instead of tracing and compiling them.
    tag: what tells this step's programs from another step's of the same run (an
    autotune's settings)."""
    return dataclasses.replace(step, **{f: keep(f"{f}{tag}", getattr(step, f))
                                        for f in ("init", "train", "evaluate", "flush", "consensus")})
