"""delayed:T and delayed-nocomp:T: the average of a step's gradients applied T steps late.

Zhu, Lu, Lin, Lin & Han, "Distributed Training Across the World" (DTAW, 2019; the same
algebra as their "Delayed Gradient Averaging", NeurIPS 2021): each worker applies its
own gradient at once; the average of step i arrives at step i+T and replaces the
worker's stale contribution, w <- w - lr * (gbar_{i-T} - g_{i-T}). delayed-nocomp:T is
plain delayed SGD: only the stale average gbar_{i-T} is applied. T = 0 is sync.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from dpjax import links
from dpjax.data_parallel import DistributedOptimizer
from dpjax.sharding import state_specs
from dpjax.mesh import as_axes
from dpjax.compression import Exchange
from dpjax.updates.base import UpdateRule, local_like, stacked
from dpjax.updates.registry import Kind, register
from dpjax.updates.sync import sync


class DelayedState(NamedTuple):
    inner: optax.OptState
    t: jax.Array  # steps taken; slot t % R of the buffers (R = delay) holds step t-R's values
    gbar_RxP: optax.Updates  # averages in flight (zeros until they exist)
    g_RxP: optax.Updates  # this worker's own gradients of the same steps
    exchange: object = ()  # the compressed exchange's state (error feedback), () without one


def delayed_gradients(inner, delay: int, axis_name="data", *, compensate: bool = True,
                      exchange: Exchange | None = None, **allreduce) -> optax.GradientTransformation:
    """DTAW's delayed averaging (Zhu et al.) as an optax wrapper, inside `shard_map`.

    At step i the local gradient g_i is allreduced (issued now, read T steps later) and
    `inner` is fed
        compensate=True:  g_i + (gbar_{i-T} - g_{i-T})   (the slide: the own stale term is
                          swapped for the average once it arrives; for i < T just g_i)
        compensate=False: gbar_{i-T}                       (delayed SGD; for i < T `inner`
                          does not step)
    With SGD, w_N = w_0 - lr * (sum_{i<N-T} gbar_i + sum_{N-T<=i<N} g_i): once the last T
    averages land (T steps with zero gradient, `UpdateRule.flush`), every worker holds
    w_0 - lr * sum_i gbar_i. With momentum or Adam the compensation is made in the
    gradient stream: the optimizer's moments are built from the compensated gradients,
    and its past states (momentum from local gradients, Adam's second moment) are not
    corrected afterwards. delay=0 returns `DistributedOptimizer` (sync).

    The allreduce of step i runs inside step i's program and its result waits in the
    state; nothing depends on it before step i+T. Over an emulated slow link
    (`dpjax.links`) its transfer is filed under step i and waited for at step i+T only,
    so T steps of compute hide it, as communication on its own stream would.
    """
    ex = Exchange.of(exchange, **allreduce)
    if delay == 0:
        return DistributedOptimizer(inner, axis_name, **ex.kwargs())
    T, axes = int(delay), as_axes(axis_name)

    def init_fn(params):
        buf = jax.tree.map(lambda x: jnp.zeros((T, *x.shape), x.dtype), params)
        return DelayedState(inner.init(params), jnp.zeros((), jnp.int32), buf, buf, ex.init(params, axes))

    def update_fn(grads, state, params=None):
        # the error buffer (and PowerSGD's Q) carries across the delay: it is fed back next
        # step, so that exchange starts once this one has arrived (links: `after`)
        with links.deferred(state.t, after=state.t - 1 if ex.keeps_state(axes) else None):
            gbar, exchange = ex.mean(grads, axes, state.exchange)
        slot = state.t % T
        old_gbar, old_g = (jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, slot, 0, keepdims=False), buf)
                           for buf in (state.gbar_RxP, state.g_RxP))
        old_gbar = links.wait_deferred(old_gbar, state.t - T)  # the average of step t-T has arrived
        if compensate:
            fed = jax.tree.map(lambda g, a, b: g + (a - b), grads, old_gbar, old_g)
            updates, inner_state = inner.update(fed, state.inner, params)
        else:
            updates, inner_state = lax.cond(
                state.t >= T, lambda: inner.update(old_gbar, state.inner, params),
                lambda: (jax.tree.map(jnp.zeros_like, grads), state.inner))

        def put(buf, x):
            return jax.tree.map(lambda b, v: lax.dynamic_update_index_in_dim(b, v, slot, 0), buf, x)

        return updates, DelayedState(inner_state, state.t + 1, put(state.gbar_RxP, gbar), put(state.g_RxP, grads),
                                     exchange)

    return optax.GradientTransformation(init_fn, update_fn)


def delayed(inner, delay: int, axis_name="data", *, compensate: bool = True, exchange: Exchange | None = None,
            **allreduce) -> UpdateRule:
    """`delayed_gradients` as a rule; `flush` lands the T averages still in flight."""
    ex = Exchange.of(exchange, **allreduce)
    if delay == 0:
        return sync(inner, axis_name, exchange=ex)
    axes = as_axes(axis_name)
    tx = delayed_gradients(inner, delay, axes, compensate=compensate, exchange=ex)

    def step(grad_fn, params, state, batch):
        loss, grads = grad_fn(params, batch)
        updates, state = tx.update(local_like(grads, params), state, params)
        return optax.apply_updates(params, updates), state, loss

    def flush(params, state):
        for _ in range(delay):  # steps with no new gradient: the averages in flight land
            updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
            params = optax.apply_updates(params, updates)
        return params, state

    def specs(ps, shapes):
        return DelayedState(state_specs(inner, shapes.inner, ps), P(), stacked(ps), stacked(ps), ex.specs(ps, axes))

    name = f"delayed{'' if compensate else '-nocomp'}:{delay}"
    exact = ex.exact()  # the consensus: the workers' parameters, averaged exactly
    return UpdateRule(name, tx.init, step, flush, specs, lambda params: exact.mean(params, axes)[0], axes, True)


def _build(compensate: bool):
    def build(spec, inner, axis_name, *, seed, **allreduce):
        return delayed(inner, spec.n, axis_name, compensate=compensate, **allreduce)
    return build


register(Kind("delayed", "DTAW: apply the own gradient now, the average T steps late with the stale own gradient "
              "swapped out", build=_build(True), is_sync=lambda spec: spec.n == 0, number="the delay T"))
register(Kind("delayed-nocomp", "only the T-step-old average", build=_build(False), is_sync=lambda spec: spec.n == 0,
              number="the delay T"))
