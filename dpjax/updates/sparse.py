"""sparse:P[,outer=LR]: temporally sparse updates / local SGD, and DiLoCo.

Lin et al. 2018, "Don't use large mini-batches, use local SGD": local steps, the
parameters averaged every P steps. With outer=LR, DiLoCo (Douillard et al. 2023): the
averaged update since the last average is a pseudo-gradient for an outer Nesterov SGD
(momentum 0.9) with that learning rate. sparse:1 without outer is sync.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from dpjax import scopes
from dpjax.sharding import state_specs
from dpjax.mesh import as_axes
from dpjax.compression import Exchange
from dpjax.updates.base import UpdateRule, identity, local_like
from dpjax.updates.registry import Kind, Option, register
from dpjax.updates.sync import sync


class LocalState(NamedTuple):
    inner: optax.OptState  # each worker's own, never averaged (DiLoCo keeps inner states local)
    t: jax.Array
    anchor: optax.Params  # parameters after the last average (with an outer optimizer or compression; else ())
    outer: optax.OptState
    exchange: object = ()  # the compressed exchange's state (error feedback on the outer delta), () without one


def sparse(inner, period: int, axis_name="data", *, outer: optax.GradientTransformation | None = None,
           exchange: Exchange | None = None, **allreduce) -> UpdateRule:
    """Temporally sparse updates / local SGD: `inner` steps on the worker's gradient; every
    `period` steps the workers average. Without `outer` the parameters are averaged;
    with it (DiLoCo, Douillard et al. 2023) the accumulated updates anchor - w_k are,
    and their mean is the gradient of `outer` applied to the anchor (e.g.
    optax.sgd(0.7, momentum=0.9, nesterov=True)). period=1 without `outer` returns
    `sync`: one local step then a parameter average is SGD on the average gradient only
    up to round-off, and not at all for Adam, whose step is nonlinear in the gradient.

    With wire compression the plain average sends the update since the last average,
    anchor - mean(anchor - w_k), not the parameters themselves: rounding whole weights
    to bf16 at every average would erase updates smaller than 1/256 of a weight.
    """
    ex = Exchange.of(exchange, **allreduce)
    if period == 1 and outer is None:
        return sync(inner, axis_name, exchange=ex)
    axes = as_axes(axis_name)
    keep_anchor = outer is not None or ex.spec is not None

    def init(params):
        return LocalState(inner.init(params), jnp.zeros((), jnp.int32), params if keep_anchor else (),
                          outer.init(params) if outer is not None else (), ex.init(params, axes))

    def average(params, state):
        if not keep_anchor:
            return ex.mean(params, axes)[0], state
        # DiLoCo's outer gradient: what is compressed (Streaming DiLoCo, INTELLECT-1)
        delta, exchange = ex.mean(jax.tree.map(jnp.subtract, state.anchor, params), axes, state.exchange)
        state = state._replace(exchange=exchange)
        if outer is None:
            new = jax.tree.map(jnp.subtract, state.anchor, delta)
            return new, state._replace(anchor=new)
        updates, outer_state = outer.update(delta, state.outer, state.anchor)
        new = optax.apply_updates(state.anchor, updates)
        return new, state._replace(anchor=new, outer=outer_state)

    def step(grad_fn, params, state, batch):
        loss, grads = grad_fn(params, batch)
        updates, inner_state = inner.update(local_like(grads, params), state.inner, params)
        params = optax.apply_updates(params, updates)
        state = state._replace(inner=inner_state, t=state.t + 1)
        # in a cond, so the exchange (and its bytes) happens once per period; named, so that
        # comm_bytes charges it to the steps that run it (`dpjax.train.comm_bytes`)
        with scopes.scope("average", period=period):
            params, state = lax.cond(state.t % period == 0, average, identity, params, state)
        return params, state, loss

    def specs(ps, shapes):
        return LocalState(state_specs(inner, shapes.inner, ps), P(), ps if keep_anchor else (),
                          state_specs(outer, shapes.outer, ps) if outer is not None else (), ex.specs(ps, axes))

    name = f"sparse:{period}" + (",outer" if outer is not None else "")
    exact = ex.exact()  # the consensus: the workers' parameters, averaged exactly
    return UpdateRule(name, init, step, average, specs, lambda params: exact.mean(params, axes)[0], axes, True)


def _build(spec, inner, axis_name, *, seed, **exchange):
    outer = optax.sgd(spec.outer_lr, momentum=0.9, nesterov=True) if spec.outer_lr else None
    return sparse(inner, spec.n, axis_name, outer=outer, **exchange)


register(Kind("sparse", "local SGD, parameters averaged every P steps; outer=LR: DiLoCo outer Nesterov with that lr",
              build=_build, is_sync=lambda spec: spec.n == 1 and not spec.outer_lr, number="the period P", low=1,
              options=(Option("outer", "outer_lr", "LR", float, lambda v: v > 0, "positive"),),
              period=lambda spec: spec.n))
