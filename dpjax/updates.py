"""Update rules: how data-parallel workers agree on an update when the network is slow.

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

A rule is an `UpdateRule`: pure `init` / `step` functions like an optax transformation,
called inside `shard_map` on one worker's values; `delayed_gradients` is also a plain
`optax.GradientTransformation`. `make_update_step` turns a rule into jitted steps
over a mesh. Workers' state differs under delayed, sparse and async, so it is stored
honestly: every leaf carries a leading worker axis of size n (the product of the data
axes), sharded over the data axes, and a checkpoint holds every worker's copy.

delayed:0, delayed-nocomp:0, sparse:1 and async:0 (fetch=push=1) are sync: their
factories return `sync(...)`, the same arithmetic as `DistributedOptimizer`, so they
equal it bit for bit (tests/test_updates.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.data_parallel import DistributedOptimizer, allreduce_gradients
from dpjax.mesh import data_axes
from dpjax.sharding import state_specs

HELP = ("how workers agree on an update: 'sync' (gradient average every step); 'delayed:T' (DTAW: apply "
        "the own gradient now, the average T steps late with the stale own gradient swapped out); "
        "'delayed-nocomp:T' (only the T-step-old average); 'sparse:P[,outer=LR]' (local SGD, parameters "
        "averaged every P steps; outer=LR: DiLoCo outer Nesterov with that lr); "
        "'async:TAU[,fetch=F][,push=Q]' (parameter server; gradients on copies up to TAU versions old, "
        "seeded; Downpour: fetch every F, push accumulated gradients every Q steps)")


@dataclass(frozen=True)
class UpdateSpec:
    """A parsed `--update` value. `n` is T (delayed), P (sparse) or TAU (async)."""

    kind: str = "sync"  # sync | delayed | delayed-nocomp | sparse | async
    n: int = 0
    outer_lr: float = 0.0  # sparse: 0 means a plain parameter average
    fetch: int = 1
    push: int = 1

    @property
    def is_sync(self) -> bool:
        return (self.kind == "sync" or (self.kind.startswith("delayed") and self.n == 0)
                or (self.kind == "sparse" and self.n == 1 and not self.outer_lr)
                or (self.kind == "async" and self.n == 0 and self.fetch == 1 and self.push == 1))

    def __str__(self) -> str:
        if self.kind == "sync":
            return "sync"
        opts = {"sparse": [f"outer={self.outer_lr:g}"] if self.outer_lr else [],
                "async": [f"fetch={self.fetch}"] * (self.fetch > 1) + [f"push={self.push}"] * (self.push > 1)}
        return ",".join([f"{self.kind}:{self.n}", *opts.get(self.kind, [])])


_OPTIONS = {"sparse": {"outer": float}, "async": {"fetch": int, "push": int}}


def parse_update(text: str) -> UpdateSpec:
    """'delayed:4' -> UpdateSpec('delayed', 4). Raises ValueError (one line) for bad specs."""
    head, *opts = str(text).strip().split(",")
    kind, _, num = head.partition(":")

    def bad(why):
        return ValueError(f"bad --update {text!r}: {why}")

    if kind == "sync" and not num and not opts:
        return UpdateSpec()
    what = {"delayed": "the delay T", "delayed-nocomp": "the delay T", "sparse": "the period P",
            "async": "the staleness bound TAU"}
    if kind not in what:
        raise bad("choose sync, delayed:T, delayed-nocomp:T, sparse:P or async:TAU")
    low = 1 if kind == "sparse" else 0
    try:
        n = int(num)
    except ValueError:
        n = -1
    if n < low:
        raise bad(f"{what[kind]} must be an integer >= {low}")
    kw = {}
    for opt in opts:
        key, eq, val = opt.partition("=")
        conv = _OPTIONS.get(kind, {}).get(key.strip())
        if conv is None or not eq:
            allowed = ", ".join(f"{k}=..." for k in _OPTIONS.get(kind, {})) or "none"
            raise bad(f"unknown option {opt!r} (options of {kind}: {allowed})")
        try:
            kw[key.strip()] = conv(val)
        except ValueError:
            raise bad(f"option {key.strip()} needs a number, got {val!r}") from None
    if kw.get("outer", 1) <= 0 or min(kw.get("fetch", 1), kw.get("push", 1)) < 1:
        raise bad("outer must be positive, fetch and push at least 1")
    return UpdateSpec(kind, n, kw.get("outer", 0.0), kw.get("fetch", 1), kw.get("push", 1))


class UpdateRule(NamedTuple):
    """One worker's side of an update rule, called inside `shard_map` on local values.

    init(params) -> state; step(value_and_grad, params, state, batch) -> (params, state, loss);
    flush(params, state) -> (params, state) delivers what is still in flight;
    specs(param_specs, state_shapes) -> a PartitionSpec per state leaf (no worker axis);
    average(tree) -> the mean over the data axes with the rule's allreduce;
    divergent: whether workers' parameters may differ (then evaluation uses their mean).
    """

    init: Callable
    step: Callable
    flush: Callable
    specs: Callable
    average: Callable
    divergent: bool


def _mean_fn(axis_name, allreduce):
    return lambda tree: allreduce_gradients(tree, axis_name, **allreduce)


def _stacked(param_specs):
    """Specs of a buffer of parameter copies stacked on a new leading axis."""
    return jax.tree.map(lambda s: P(None, *s), param_specs)


def _from_transformation(tx, axis_name, allreduce, *, divergent, flush_steps=0) -> UpdateRule:
    def step(value_and_grad, params, state, batch):
        loss, grads = value_and_grad(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def flush(params, state):
        for _ in range(flush_steps):  # steps with no new gradient: the averages in flight land
            updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
            params = optax.apply_updates(params, updates)
        return params, state

    return UpdateRule(tx.init, step, flush, lambda ps, shapes: state_specs(tx, shapes, ps),
                      _mean_fn(axis_name, allreduce), divergent)


def sync(inner, axis_name="data", **allreduce) -> UpdateRule:
    """Every step the gradient average feeds `inner`: `DistributedOptimizer` as a rule.
    allreduce: `algorithm`, `fusion_mb`, `compression`, ... (see `allreduce_gradients`)."""
    return _from_transformation(DistributedOptimizer(inner, axis_name, **allreduce), axis_name, allreduce,
                                divergent=False)


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

    Here the allreduce of step i runs inside step i's program and its result waits in
    the state; nothing depends on it before step i+T, so a runtime that overlaps
    programs can hide it behind T steps of compute (experiments/wan.py models that).
    """
    if delay == 0:
        return DistributedOptimizer(inner, axis_name, **allreduce)
    T = int(delay)

    def init_fn(params):
        buf = jax.tree.map(lambda x: jnp.zeros((T, *x.shape), x.dtype), params)
        return DelayedState(inner.init(params), jnp.zeros((), jnp.int32), buf, buf)

    def update_fn(grads, state, params=None):
        gbar = allreduce_gradients(grads, axis_name, **allreduce)
        slot = state.t % T
        old_gbar, old_g = (jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, slot, 0, keepdims=False), buf)
                           for buf in (state.gbar_TxP, state.g_TxP))
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
    tx = delayed_gradients(inner, delay, axis_name, compensate=compensate, **allreduce)
    rule = _from_transformation(tx, axis_name, allreduce, divergent=True, flush_steps=delay)

    def specs(ps, shapes):
        return DelayedState(state_specs(inner, shapes.inner, ps), P(), _stacked(ps), _stacked(ps))

    return rule._replace(specs=specs)


class LocalState(NamedTuple):
    inner: optax.OptState  # each worker's own, never averaged (DiLoCo keeps inner states local)
    t: jax.Array
    anchor: optax.Params  # parameters after the last average (with an outer optimizer; else ())
    outer: optax.OptState


def sparse(inner, period: int, axis_name="data", *, outer: optax.GradientTransformation | None = None,
           **allreduce) -> UpdateRule:
    """Temporally sparse updates / local SGD: `inner` steps on the local gradient; every
    `period` steps the workers average. Without `outer` the parameters are averaged;
    with it (DiLoCo, Douillard et al. 2023) the accumulated updates anchor - w_k are,
    and their mean is the gradient of `outer` applied to the anchor (e.g.
    optax.sgd(0.7, momentum=0.9, nesterov=True)). period=1 without `outer` returns
    `sync`: one local step then a parameter average is SGD on the average gradient only
    up to round-off, and not at all for Adam, whose step is nonlinear in the gradient.
    """
    if period == 1 and outer is None:
        return sync(inner, axis_name, **allreduce)
    mean = _mean_fn(axis_name, allreduce)

    def init(params):
        anchor = params if outer is not None else ()
        return LocalState(inner.init(params), jnp.zeros((), jnp.int32), anchor,
                          outer.init(params) if outer is not None else ())

    def average(params, state):
        if outer is None:
            return mean(params), state
        delta = mean(jax.tree.map(jnp.subtract, state.anchor, params))  # DiLoCo's outer gradient
        updates, outer_state = outer.update(delta, state.outer, state.anchor)
        new = optax.apply_updates(state.anchor, updates)
        return new, state._replace(anchor=new, outer=outer_state)

    def step(value_and_grad, params, state, batch):
        loss, grads = value_and_grad(params, batch)
        updates, inner_state = inner.update(grads, state.inner, params)
        params = optax.apply_updates(params, updates)
        state = state._replace(inner=inner_state, t=state.t + 1)
        # in a cond, so the exchange (and its bytes) happens once per period
        params, state = lax.cond(state.t % period == 0, average, lambda p, s: (p, s), params, state)
        return params, state, loss

    def specs(ps, shapes):
        return LocalState(state_specs(inner, shapes.inner, ps), P(), ps if outer is not None else (),
                          state_specs(outer, shapes.outer, ps) if outer is not None else ())

    return UpdateRule(init, step, average, specs, mean, True)


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
    K, F, Q = tau + 1, int(fetch_every), int(push_every)
    mean = _mean_fn(axis_name, allreduce)

    def init(params):
        hist = jax.tree.map(lambda x: jnp.broadcast_to(x, (K, *x.shape)), params)
        acc = jax.tree.map(jnp.zeros_like, params) if Q > 1 else ()
        return AsyncState(inner.init(params), jnp.zeros((), jnp.int32), hist, params, jnp.zeros((), jnp.int32), acc)

    def step(value_and_grad, params, state, batch):
        t, k = state.t, lax.axis_index(axis_name)
        fetch = (t + k) % F == 0
        version = jnp.where(fetch, t - jnp.minimum(staleness(seed, t, k, tau), t), state.version)
        fetched = jax.tree.map(lambda h: lax.dynamic_index_in_dim(h, version % K, 0, keepdims=False),
                               state.history_KxP)
        local = jax.tree.map(lambda a, b: jnp.where(fetch, a, b), fetched, state.local)
        loss, grads = value_and_grad(local, batch)
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

    return UpdateRule(init, step, lambda p, s: (p, s), specs, mean, False)


def make_rule(spec: UpdateSpec | str, inner, axis_name="data", *, seed: int = 0, **allreduce) -> UpdateRule:
    """The rule a spec names, wrapping the inner optimizer `inner`."""
    s = parse_update(spec) if isinstance(spec, str) else spec
    if s.kind == "sync":
        return sync(inner, axis_name, **allreduce)
    if s.kind.startswith("delayed"):
        return delayed(inner, s.n, axis_name, compensate=s.kind == "delayed", **allreduce)
    if s.kind == "sparse":
        outer = optax.sgd(s.outer_lr, momentum=0.9, nesterov=True) if s.outer_lr else None
        return sparse(inner, s.n, axis_name, outer=outer, **allreduce)
    return stale_async(inner, s.n, axis_name, seed=seed, fetch_every=s.fetch, push_every=s.push, **allreduce)


@dataclass(frozen=True)
class UpdateStep:
    """A rule's jitted steps over a mesh. `_W` values carry the leading worker axis.

    init(params) -> (params_W, state_W), from parameters replicated over the data axes;
    train_step(params_W, state_W, batch) -> (params_W, state_W, mean loss of the workers);
    eval_step(params_W, batch) -> mean loss of the consensus parameters;
    flush(params_W, state_W) -> (params_W, state_W): what is in flight lands;
    consensus(params_W) -> params: the workers' mean for divergent rules (delayed:
    the mean of the workers is where the in-flight averages lead, for SGD exactly;
    sparse: the next synchronisation point), else the common copy (sync, async: the
    server's parameters).
    """

    rule: UpdateRule
    workers: int
    init: Callable
    train_step: Callable
    eval_step: Callable
    flush: Callable
    consensus: Callable


def make_update_step(loss_fn, rule: UpdateRule, mesh, *, param_specs=None, donate: bool = True) -> UpdateStep:
    """Jitted shard_map steps of `rule` for `loss_fn(params, local_batch) -> scalar`.

    param_specs: a PartitionSpec per parameter over the non-data axes (default P(): a
    replica on every `model` rank); per-worker leaves get the data axes prepended, so
    each device holds [1, ...] of its worker. The batch is split by rows over the data
    axes (`dpjax.data_parallel.batch_sharding`). Inside, gradients stay local
    (check_vma=False) and every average is the rule's explicit allreduce.
    """
    axes = data_axes(mesh)
    n = math.prod(mesh.shape[a] for a in axes)
    value_and_grad = jax.value_and_grad(loss_fn)

    def specs_of(params_W):
        local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params_W)
        ps = param_specs if param_specs is not None else jax.tree.map(lambda _: P(), local)
        state = rule.specs(ps, jax.eval_shape(rule.init, local))
        per_worker = lambda tree: jax.tree.map(lambda s: P(axes, *s), tree)  # noqa: E731
        return ps, per_worker(ps), per_worker(state)

    def squeeze(tree):
        def one(x):
            assert x.shape[0] == 1, f"a device should hold one worker's copy, got leading dim {x.shape[0]}"
            return x[0]
        return jax.tree.map(one, tree)

    def expand(tree):
        return jax.tree.map(lambda x: x[None], tree)

    def smap(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def common(params):
        return rule.average(params) if rule.divergent else params

    def init(params):
        local = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *x.shape), x.dtype), params)
        ps, pw, sw = specs_of(local)
        return smap(lambda p: (expand(p), expand(rule.init(p))), (ps,), (pw, sw))(params)

    def train(params_W, state_W, batch):
        _, pw, sw = specs_of(params_W)

        def body(params_W, state_W, batch):
            params, state, loss = rule.step(value_and_grad, squeeze(params_W), squeeze(state_W), batch)
            return expand(params), expand(state), lax.pmean(loss, axes)

        return smap(body, (pw, sw, P(axes)), (pw, sw, P()))(params_W, state_W, batch)

    def evaluate(params_W, batch):
        _, pw, _ = specs_of(params_W)
        body = lambda p, b: lax.pmean(loss_fn(common(squeeze(p)), b), axes)  # noqa: E731
        return smap(body, (pw, P(axes)), P())(params_W, batch)

    def flush(params_W, state_W):
        _, pw, sw = specs_of(params_W)

        def body(params_W, state_W):
            return tuple(expand(x) for x in rule.flush(squeeze(params_W), squeeze(state_W)))

        return smap(body, (pw, sw), (pw, sw))(params_W, state_W)

    def consensus(params_W):
        ps, pw, _ = specs_of(params_W)
        return smap(lambda p: common(squeeze(p)), (pw,), ps)(params_W)

    return UpdateStep(rule, n, jax.jit(init), jax.jit(train, donate_argnums=(0, 1) if donate else ()),
                      jax.jit(evaluate), jax.jit(flush), jax.jit(consensus))


def worker_sharding(mesh, spec=P()):
    """Where a per-worker leaf lives: its leading worker axis split over the data axes."""
    return NamedSharding(mesh, P(data_axes(mesh), *spec))
