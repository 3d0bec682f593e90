"""async:TAU[,fetch=F][,push=Q]: a parameter server seen by stale workers.

Hogwild (Recht et al. 2011), Downpour SGD (Dean et al. 2012): each worker's gradient is
computed on a copy of the server's parameters up to TAU versions old, the staleness
drawn from a seed so that any process can regenerate the schedule; Downpour's n_fetch
and n_push as fetch=F and push=Q. async:0 (fetch=push=1) is sync.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from dpjax.sharding import state_specs
from dpjax.mesh import as_axes, axis_arg
from dpjax.compression import Exchange
from dpjax.updates.base import UpdateRule, identity, local_like, stacked
from dpjax.updates.registry import Kind, Option, register
from dpjax.updates.sync import sync


def staleness(seed: int, step, worker, tau: int):
    """How many versions old the copy is that `worker` fetches at `step`: uniform on
    0..TAU from (seed, step, worker) alone, so any process can regenerate it."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), worker)
    return jax.random.randint(key, (), 0, tau + 1)


def staleness_schedule(seed: int, steps: int, workers: int, tau: int) -> np.ndarray:
    """The schedule `async` follows, int [steps, workers], clipped to the versions that exist."""
    f = jax.jit(jax.vmap(jax.vmap(lambda t, k: staleness(seed, t, k, tau), (None, 0)), (0, None)))
    t = np.arange(steps)
    return np.minimum(np.asarray(f(t, np.arange(workers))), t[:, None])


class AsyncState(NamedTuple):
    inner: optax.OptState  # the server's optimizer state (the same on every worker)
    t: jax.Array  # the server's version: steps applied
    history_RxP: optax.Params  # versions t, t-1, .., t-R+1 at slots v % R (R = tau + 1)
    local: optax.Params  # the copy this worker computes gradients on
    version: jax.Array  # which server version `local` is
    acc: optax.Updates  # gradients summed since this worker's last push (or () when push=1)
    exchange: object = ()  # the compressed exchange's state (error feedback), () without one


def stale_async(inner, tau: int, axis_name="data", *, seed: int = 0, fetch_every: int = 1, push_every: int = 1,
                exchange: Exchange | None = None, **allreduce) -> UpdateRule:
    """Bounded-staleness asynchronous SGD as a parameter server sees it, in rounds.

    The per-worker `params` are the server's copy (the same on every worker). At round t
    worker k, if (t + k) % fetch_every == 0, fetches version t - tau_k(t), tau_k(t) drawn
    by `staleness` (so its copy is up to TAU + fetch_every - 1 versions old); it computes
    its gradient on its copy and adds it to a local sum, which it pushes when
    (t + k) % push_every == push_every - 1 (Downpour's n_fetch / n_push, staggered as
    unsynchronised replicas would be). The server applies the mean over workers of what
    was pushed (zero from those that did not) as one `inner` step: every worker's
    gradient weighs alike, as in stale-synchronous parallel; Hogwild would apply them one
    by one. tau=0, fetch=push=1 returns `sync`.
    """
    ex = Exchange.of(exchange, **allreduce)
    if tau == 0 and fetch_every == 1 and push_every == 1:
        return sync(inner, axis_name, exchange=ex)
    axes = as_axes(axis_name)
    K, F, Q = tau + 1, int(fetch_every), int(push_every)

    def init(params):
        hist = jax.tree.map(lambda x: jnp.broadcast_to(x, (K, *x.shape)), params)
        acc = jax.tree.map(jnp.zeros_like, params) if Q > 1 else ()
        return AsyncState(inner.init(params), jnp.zeros((), jnp.int32), hist, params, jnp.zeros((), jnp.int32), acc,
                          ex.init(params, axes))

    def step(grad_fn, params, state, batch):
        t = state.t
        k = lax.axis_index(axis_arg(axes)) if axes else 0
        fetch = (t + k) % F == 0
        version = jnp.where(fetch, t - jnp.minimum(staleness(seed, t, k, tau), t), state.version)
        fetched = jax.tree.map(lambda h: lax.dynamic_index_in_dim(h, version % K, 0, keepdims=False),
                               state.history_RxP)
        local = jax.tree.map(lambda a, b: jnp.where(fetch, a, b), fetched, state.local)
        loss, grads = grad_fn(local, batch)
        grads = local_like(grads, params)
        acc = state.acc
        if Q > 1:
            acc = jax.tree.map(jnp.add, acc, grads)
            push = (t + k) % Q == Q - 1
            grads = jax.tree.map(lambda a: jnp.where(push, a, jnp.zeros_like(a)), acc)
            acc = jax.tree.map(lambda a: jnp.where(push, jnp.zeros_like(a), a), acc)
        grads, exchange = ex.mean(grads, axes, state.exchange)
        updates, inner_state = inner.update(grads, state.inner, params)
        params = optax.apply_updates(params, updates)
        hist = jax.tree.map(lambda h, p: lax.dynamic_update_index_in_dim(h, p, (t + 1) % K, 0),
                            state.history_RxP, params)
        return params, AsyncState(inner_state, t + 1, hist, local, version, acc, exchange), loss

    def specs(ps, shapes):
        return AsyncState(state_specs(inner, shapes.inner, ps), P(), stacked(ps), ps, P(), ps if Q > 1 else (),
                          ex.specs(ps, axes))

    # the server's copy is the same on every worker: the consensus is that copy
    return UpdateRule(f"async:{tau}", init, step, identity, specs, lambda params: params, axes, True)


def _build(spec, inner, axis_name, *, seed, **exchange):
    return stale_async(inner, spec.n, axis_name, seed=seed, fetch_every=spec.fetch, push_every=spec.push,
                       **exchange)


def _at_least_one(v):
    return v >= 1


register(Kind("async", "parameter server; gradients on copies up to TAU versions old, seeded; Downpour: fetch every "
              "F, push accumulated gradients every Q steps", build=_build,
              is_sync=lambda spec: spec.n == 0 and spec.fetch == 1 and spec.push == 1,
              number="the staleness bound TAU",
              options=(Option("fetch", "fetch", "F", int, _at_least_one, "at least 1"),
                       Option("push", "push", "Q", int, _at_least_one, "at least 1"))))
