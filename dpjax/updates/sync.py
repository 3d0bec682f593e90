"""sync: every step, the gradient average (Horovod; `DistributedOptimizer`).

The degenerate specs of the other rules (delayed:0, delayed-nocomp:0, sparse:1,
async:0 with fetch=push=1) build this rule: the same program, bit for bit.
"""

from __future__ import annotations

import optax

from dpjax.sharding import state_specs
from dpjax.updates.base import UpdateRule, as_axes, identity, mean_over
from dpjax.updates.registry import Kind, register


def sync(inner, axis_name=(), **allreduce) -> UpdateRule:
    """Every step the gradient averaged over the workers feeds `inner`: the arithmetic of
    `DistributedOptimizer` (allreduce_gradients, then inner.update). allreduce:
    `algorithm`, `fusion_mb`, `compression`, ... (see `allreduce_gradients`)."""
    axes = as_axes(axis_name)
    mean = mean_over(axes, allreduce)

    def step(grad_fn, params, state, batch):
        loss, grads = grad_fn(params, batch)
        updates, state = inner.update(mean(grads), state, params)
        return optax.apply_updates(params, updates), state, loss

    return UpdateRule("sync", inner.init, step, identity, lambda ps, shapes: state_specs(inner, shapes, ps),
                      lambda params: params, axes, False)


register(Kind("sync", "gradient average every step",
              build=lambda spec, inner, axis_name, *, seed, **allreduce: sync(inner, axis_name, **allreduce),
              is_sync=lambda spec: True))
