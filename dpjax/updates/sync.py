"""sync: every step, the gradient average (Horovod; `DistributedOptimizer`).

The degenerate specs of the other rules (delayed:0, delayed-nocomp:0, sparse:1,
async:0 with fetch=push=1) build this rule: the same program, bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import optax

from dpjax.sharding import state_specs
from dpjax.mesh import as_axes
from dpjax.compression import Exchange
from dpjax.updates.base import UpdateRule, identity, local_like
from dpjax.updates.registry import Kind, register


class SyncState(NamedTuple):
    inner: optax.OptState
    exchange: object  # the compressed exchange's state (dpjax.compression.feedback.State)


def sync(inner, axis_name=(), *, exchange: Exchange | None = None, **allreduce) -> UpdateRule:
    """Every step the gradient averaged over the workers feeds `inner`: the arithmetic of
    `DistributedOptimizer` (allreduce_gradients, then inner.update). exchange: the run's
    `Exchange`, or allreduce: its keywords `algorithm`, `fusion_mb`, `compression`, ...
    (see `allreduce_gradients`).

    With a compression that keeps error feedback the workers' parameters stay alike but
    their error buffers differ: the state is `SyncState` and the rule is per worker
    (every worker's buffer is kept, on the leading worker axis)."""
    axes = as_axes(axis_name)
    ex = Exchange.of(exchange, **allreduce)
    if ex.keeps_state(axes):
        return _with_feedback(inner, axes, ex)

    def step(grad_fn, params, state, batch):
        loss, grads = grad_fn(params, batch)
        grads, _ = ex.mean(local_like(grads, params), axes)
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return UpdateRule("sync", inner.init, step, identity, lambda ps, shapes: state_specs(inner, shapes, ps),
                      lambda params: params, axes, False)


def _with_feedback(inner, axes, ex: Exchange) -> UpdateRule:
    def init(params):
        return SyncState(inner.init(params), ex.init(params, axes))

    def step(grad_fn, params, state, batch):
        loss, grads = grad_fn(params, batch)
        grads, exchange = ex.mean(local_like(grads, params), axes, state.exchange)
        updates, inner_state = inner.update(grads, state.inner, params)
        return optax.apply_updates(params, updates), SyncState(inner_state, exchange), loss

    def specs(ps, shapes):
        return SyncState(state_specs(inner, shapes.inner, ps), ex.specs(ps, axes))

    return UpdateRule("sync", init, step, identity, specs, lambda params: params, axes, True)


register(Kind("sync", "gradient average every step",
              build=lambda spec, inner, axis_name, *, seed, **allreduce: sync(inner, axis_name, **allreduce),
              is_sync=lambda spec: True))
