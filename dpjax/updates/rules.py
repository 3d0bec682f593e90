"""Update rules: how workers agree on an update when the network between them is slow.

    sync                 every step, the gradient average (Horovod; `DistributedOptimizer`).
    delayed:T            Zhu, Lu, Lin, Lin & Han, "Distributed Training Across the World"
                         (DTAW, 2019; the same algebra as their "Delayed Gradient Averaging",
                         NeurIPS 2021): each worker applies its own gradient at once; the
                         average of step i arrives at step i+T and replaces the worker's
                         stale contribution, w <- w - lr * (gbar_{i-T} - g_{i-T}).
    delayed-nocomp:T     plain delayed SGD: only the stale average gbar_{i-T} is applied.
    sparse:P[,outer=LR]  temporally sparse updates / local SGD (Lin et al. 2018, "Don't use large
                         mini-batches, use local SGD"): local steps, the parameters averaged every
                         P steps; with outer=LR, DiLoCo (Douillard et al. 2023): the averaged
                         update since the last average is a pseudo-gradient for an outer
                         Nesterov SGD (momentum 0.9).
    async:TAU[,fetch=F][,push=Q]
                         a parameter server seen by stale workers (Hogwild, Recht et al. 2011;
                         Downpour SGD, Dean et al. 2012): each worker's gradient is computed on
                         a copy of the server's parameters up to TAU versions old.

This module is the algebra only. A rule is an `UpdateRule` of pure functions, called
inside `shard_map` on ONE worker's values: `step` receives `grad_fn`, which gives the
worker's gradient (already averaged over the worker's own devices and accumulated over
its micro-batches by `dpjax.step`), and the rule's exchanges between workers run over
`axes`, the worker axes, with the rule's allreduce. A worker may be one device or a
whole group (`--workers node`: a site of several devices, synchronous inside).

delayed:0, delayed-nocomp:0, sparse:1 and async:0 (fetch=push=1) are sync: their
factories return `sync(...)`, so they are the same program, bit for bit.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from dpjax.mesh import as_axes, axis_arg  # noqa: F401  (re-exported: the rules and step use them)
from dpjax import links
from dpjax.data_parallel import DistributedOptimizer, allreduce_gradients
from dpjax.sharding import state_specs
from dpjax.updates.grammar import UpdateSpec, parse_update


class UpdateRule(NamedTuple):
    """One worker's side of an update rule, called inside `shard_map` on local values.

    init(params) -> state;
    step(grad_fn, params, state, batch) -> (params, state, loss), where
        grad_fn(params, batch) -> (loss, the worker's gradient);
    flush(params, state) -> (params, state): what is still in flight lands;
    specs(param_specs, state_shapes) -> a PartitionSpec per state leaf (no worker axis);
    consensus(params) -> the parameters the workers agree on (evaluation, export): their
        exact mean where they diverge (delayed, sparse), else their common copy;
    axes: the worker axes the rule exchanges over (() for a single worker);
    per_worker: whether workers' parameters or state differ (then every worker's copy is
        kept, on a leading worker axis).
    """

    name: str
    init: Callable
    step: Callable
    flush: Callable
    specs: Callable
    consensus: Callable
    axes: tuple
    per_worker: bool


def mean_over(axes: tuple, allreduce: dict):
    """The mean of a tree over `axes` with the rule's allreduce (the identity over no axes)."""
    if not axes:
        return lambda tree: tree
    return lambda tree: allreduce_gradients(tree, axis_arg(axes), **allreduce)


def _exact(allreduce: dict) -> dict:
    """The same exchange without wire compression: for parameters that must stay exact."""
    return {**allreduce, "compression": None}


def _stacked(param_specs):
    """Specs of a buffer of parameter copies stacked on a new leading axis."""
    return jax.tree.map(lambda s: P(None, *s), param_specs)


def _identity(params, state):
    return params, state


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

    return UpdateRule("sync", inner.init, step, _identity, lambda ps, shapes: state_specs(inner, shapes, ps),
                      lambda params: params, axes, False)


class DelayedState(NamedTuple):
    inner: optax.OptState
    t: jax.Array  # steps taken; slot t % T of the buffers holds step t-T's values
    gbar_TxP: optax.Updates  # averages in flight (zeros until they exist)
    g_TxP: optax.Updates  # this worker's own gradients of the same steps


def delayed_gradients(inner, delay: int, axis_name="data", *, compensate: bool = True,
                      **allreduce) -> optax.GradientTransformation:
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
    if delay == 0:
        return DistributedOptimizer(inner, axis_name, **allreduce)
    T = int(delay)
    mean = mean_over(as_axes(axis_name), allreduce)

    def init_fn(params):
        buf = jax.tree.map(lambda x: jnp.zeros((T, *x.shape), x.dtype), params)
        return DelayedState(inner.init(params), jnp.zeros((), jnp.int32), buf, buf)

    def update_fn(grads, state, params=None):
        with links.deferred(state.t):
            gbar = mean(grads)
        slot = state.t % T
        old_gbar, old_g = (jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, slot, 0, keepdims=False), buf)
                           for buf in (state.gbar_TxP, state.g_TxP))
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

        return updates, DelayedState(inner_state, state.t + 1, put(state.gbar_TxP, gbar), put(state.g_TxP, grads))

    return optax.GradientTransformation(init_fn, update_fn)


def delayed(inner, delay: int, axis_name="data", *, compensate: bool = True, **allreduce) -> UpdateRule:
    """`delayed_gradients` as a rule; `flush` lands the T averages still in flight."""
    if delay == 0:
        return sync(inner, axis_name, **allreduce)
    axes = as_axes(axis_name)
    tx = delayed_gradients(inner, delay, axes, compensate=compensate, **allreduce)

    def step(grad_fn, params, state, batch):
        loss, grads = grad_fn(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def flush(params, state):
        for _ in range(delay):  # steps with no new gradient: the averages in flight land
            updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
            params = optax.apply_updates(params, updates)
        return params, state

    def specs(ps, shapes):
        return DelayedState(state_specs(inner, shapes.inner, ps), P(), _stacked(ps), _stacked(ps))

    name = f"delayed{'' if compensate else '-nocomp'}:{delay}"
    return UpdateRule(name, tx.init, step, flush, specs, mean_over(axes, _exact(allreduce)), axes, True)


class LocalState(NamedTuple):
    inner: optax.OptState  # each worker's own, never averaged (DiLoCo keeps inner states local)
    t: jax.Array
    anchor: optax.Params  # parameters after the last average (with an outer optimizer or compression; else ())
    outer: optax.OptState


def sparse(inner, period: int, axis_name="data", *, outer: optax.GradientTransformation | None = None,
           **allreduce) -> UpdateRule:
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
    if period == 1 and outer is None:
        return sync(inner, axis_name, **allreduce)
    axes = as_axes(axis_name)
    mean = mean_over(axes, allreduce)
    keep_anchor = outer is not None or allreduce.get("compression") not in (None, "none")

    def init(params):
        return LocalState(inner.init(params), jnp.zeros((), jnp.int32), params if keep_anchor else (),
                          outer.init(params) if outer is not None else ())

    def average(params, state):
        if not keep_anchor:
            return mean(params), state
        delta = mean(jax.tree.map(jnp.subtract, state.anchor, params))  # DiLoCo's outer gradient
        if outer is None:
            new = jax.tree.map(jnp.subtract, state.anchor, delta)
            return new, state._replace(anchor=new)
        updates, outer_state = outer.update(delta, state.outer, state.anchor)
        new = optax.apply_updates(state.anchor, updates)
        return new, state._replace(anchor=new, outer=outer_state)

    def step(grad_fn, params, state, batch):
        loss, grads = grad_fn(params, batch)
        updates, inner_state = inner.update(grads, state.inner, params)
        params = optax.apply_updates(params, updates)
        state = state._replace(inner=inner_state, t=state.t + 1)
        # in a cond, so the exchange (and its bytes) happens once per period
        params, state = lax.cond(state.t % period == 0, average, _identity, params, state)
        return params, state, loss

    def specs(ps, shapes):
        return LocalState(state_specs(inner, shapes.inner, ps), P(), ps if keep_anchor else (),
                          state_specs(outer, shapes.outer, ps) if outer is not None else ())

    name = f"sparse:{period}" + (",outer" if outer is not None else "")
    return UpdateRule(name, init, step, average, specs, mean_over(axes, _exact(allreduce)), axes, True)


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
    history_KxP: optax.Params  # versions t, t-1, .., t-K+1 at slots v % K (K = TAU+1)
    local: optax.Params  # the copy this worker computes gradients on
    version: jax.Array  # which server version `local` is
    acc: optax.Updates  # gradients summed since this worker's last push (or () when push=1)


def stale_async(inner, tau: int, axis_name="data", *, seed: int = 0, fetch_every: int = 1, push_every: int = 1,
                **allreduce) -> UpdateRule:
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
    if tau == 0 and fetch_every == 1 and push_every == 1:
        return sync(inner, axis_name, **allreduce)
    axes = as_axes(axis_name)
    K, F, Q = tau + 1, int(fetch_every), int(push_every)
    mean = mean_over(axes, allreduce)

    def init(params):
        hist = jax.tree.map(lambda x: jnp.broadcast_to(x, (K, *x.shape)), params)
        acc = jax.tree.map(jnp.zeros_like, params) if Q > 1 else ()
        return AsyncState(inner.init(params), jnp.zeros((), jnp.int32), hist, params, jnp.zeros((), jnp.int32), acc)

    def step(grad_fn, params, state, batch):
        t = state.t
        k = lax.axis_index(axis_arg(axes)) if axes else 0
        fetch = (t + k) % F == 0
        version = jnp.where(fetch, t - jnp.minimum(staleness(seed, t, k, tau), t), state.version)
        fetched = jax.tree.map(lambda h: lax.dynamic_index_in_dim(h, version % K, 0, keepdims=False),
                               state.history_KxP)
        local = jax.tree.map(lambda a, b: jnp.where(fetch, a, b), fetched, state.local)
        loss, grads = grad_fn(local, batch)
        acc = state.acc
        if Q > 1:
            acc = jax.tree.map(jnp.add, acc, grads)
            push = (t + k) % Q == Q - 1
            grads = jax.tree.map(lambda a: jnp.where(push, a, jnp.zeros_like(a)), acc)
            acc = jax.tree.map(lambda a: jnp.where(push, jnp.zeros_like(a), a), acc)
        updates, inner_state = inner.update(mean(grads), state.inner, params)
        params = optax.apply_updates(params, updates)
        hist = jax.tree.map(lambda h, p: lax.dynamic_update_index_in_dim(h, p, (t + 1) % K, 0),
                            state.history_KxP, params)
        return params, AsyncState(inner_state, t + 1, hist, local, version, acc), loss

    def specs(ps, shapes):
        return AsyncState(state_specs(inner, shapes.inner, ps), P(), _stacked(ps), ps, P(), ps if Q > 1 else ())

    # the server's copy is the same on every worker: the consensus is that copy
    return UpdateRule(f"async:{tau}", init, step, _identity, specs, lambda params: params, axes, True)


def make_rule(spec: UpdateSpec | str, inner, axis_name="data", *, seed: int = 0, **allreduce) -> UpdateRule:
    """The rule a spec names, wrapping the inner optimizer `inner`, between the workers
    that `axis_name` (one data axis or a tuple of them; () for one worker) numbers."""
    s = parse_update(spec) if isinstance(spec, str) else spec
    if s.kind == "sync":
        return sync(inner, axis_name, **allreduce)
    if s.kind.startswith("delayed"):
        return delayed(inner, s.n, axis_name, compensate=s.kind == "delayed", **allreduce)
    if s.kind == "sparse":
        outer = optax.sgd(s.outer_lr, momentum=0.9, nesterov=True) if s.outer_lr else None
        return sparse(inner, s.n, axis_name, outer=outer, **allreduce)
    return stale_async(inner, s.n, axis_name, seed=seed, fetch_every=s.fetch, push_every=s.push, **allreduce)
