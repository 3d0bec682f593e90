"""1-bit Adam: AdamW whose variance freezes after a warm-up, then its momentum travels compressed.

Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang & He, "1-bit Adam: Communication
Efficient Large-Scale Training with Adam's Convergence Speed" (ICML 2021). Error
feedback under Adam amplifies what an error buffer releases (Adam divides each
coordinate by its own running scale; experiments/RESULTS.md measures sign 3.69 against
2.59 uncompressed); once the variance v stops moving, Adam is a momentum SGD with a
fixed per-coordinate preconditioner, and compressing the momentum with error feedback
is as safe as it is for SGD. Per worker (`--compression METHOD,start=S`):

    steps < S   (warm-up)   g = the exact mean of the workers' gradients (the uncompressed
                            allreduce; in the per-shard form of `--compress-axes`, each
                            device's shard across and the site's all-gather), then the AdamW of
                            `--optimizer adamw` (its clipping,
                            schedule, betas, eps and weight decay): bit for bit that run
    steps >= S  (frozen)    g = this worker's own gradient, clipped to the global norm
                            m_i = b1 m + (1 - b1) g
                            m = the mean of the m_i through METHOD with error feedback
                                (`onebit`, the default: scaled sign with worker and server
                                error, 1-bit Adam's compressed allreduce; or any registered
                                method with error feedback)
                            p <- p - lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^k)) + eps) + wd p)
                            v stays as its k-th update left it (k = S without refresh)
    refresh=R   (steps S R, S R^2, ...)  g = the exact mean, clipped, as in the warm-up
                            m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2 (its k-th update)
                            p <- p - lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^k)) + eps) + wd p)

The refreshes are 0/1 Adam's answer (Lu, Li, Zhang, Tang & He, "Maximizing Communication
Efficiency for Large-scale Training via 0/1 Adam", ICLR 2023; DeepSpeed's ZeroOneAdam)
to a variance frozen too early: v keeps being updated, from exact exchanges whose
interval grows exponentially (0/1 Adam doubles it every `var_update_scaler` updates;
here every update, after the S warm-up steps). On the main job (experiments/RESULTS.md)
start=3,refresh=2 (9 exact steps in 300) with the momentum sent exactly ends level with
AdamW: the refreshed variance costs nothing there, where a variance frozen at step 50
costs 2-4%. 0/1 Adam's other half, 1-bit compression of the gradient instead of the
momentum, ended far worse under this schedule (RESULTS.md), and its local steps
(skipped rounds) are not built.

bound=C (after the freeze): each coordinate of the exchanged momentum is clipped to
C sqrt(v_hat), and what is clipped off is held (`OneBitState.held`, the same on every
worker) and added to the next step's momentum before its exchange: delayed, not lost.
A scaled sign gives every value of a chunk the chunk's mean magnitude; divided by a
small sqrt(v), a quiet coordinate would move many times what AdamW moves it. On the main
job C = 0.1 with start=3,refresh=2 ends 1.2% above AdamW over 3 seeds at 16.5x fewer
bytes (RESULTS.md, "1-bit Adam with a refreshed variance and a bound").

Where it lives: an update rule (the workers' side of the exchange), registered as the
rule `--optimizer onebit_adam` chooses (with `--update sync`; `registry.for_optimizer`).
The gradient is averaged inside a worker as for any rule (exact; `--workers node` keeps FSDP or the per-site mean on the
fast link), and between workers the rule owns the exchange: in the warm-up it is the
gradient's exact allreduce, after it the momentum's compressed one, so no gradient
allreduce runs between workers after the freeze. The two are a `lax.cond` under
`dpjax:compression(start=S)`, as `compression.feedback`'s start steps are, so the
metrics' comm_bytes charges each step the branch it runs (`accounting.compressed_at`
knows the refreshes). The state is the AdamW
chain's own (its mu and nu, sharded like the parameters) and the exchange's
(`feedback.State`: the worker error and the method's state, e.g. the server error),
per worker, so checkpoints save and restore it. A resume across a change of the model
or stage split is refused (`Exchange.split`: the method keeps state of its
own), because each server owns chunks of its local shard and the split moves them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from dpjax import scopes
from dpjax.sharding import state_specs
from dpjax.mesh import as_axes
from dpjax.compression import Exchange, Form
from dpjax.updates.base import UpdateRule, identity
from dpjax.updates.registry import Kind, register


class OneBitState(NamedTuple):
    inner: optax.OptState  # the AdamW chain's state: (clip,) (adam's count, mu, nu; ...; the schedule's count)
    exchange: Any  # the momentum's compressed exchange (dpjax.compression.feedback.State)
    held: Any = ()  # bound=C: the momentum held back by the bound, shaped like the parameters (() without)


def onebit_adam(adamw, clip, schedule, axis_name=(), *, b1: float, b2: float, eps: float, weight_decay: float,
                exchange: Exchange | None = None, **allreduce) -> UpdateRule:
    """The rule over the worker axes `axis_name`. adamw: the optax AdamW chain of
    `--optimizer adamw` (the warm-up runs it as it is, and its state's ScaleByAdamState and
    ScaleByScheduleState carry on after); clip(g) -> g clipped to the global norm (or g);
    schedule(count) -> lr; b1, b2, eps, weight_decay: AdamW's, the same as `adamw`'s.
    exchange (or allreduce, its keywords): the run's `Exchange`; its `compression`
    (METHOD,start=S[,refresh=R][,bound=C]) names the momentum's method, S, the warm-up steps (at least 1: v is
    frozen from them), R, the refreshes' ratio (0: none), and C, the bound on each
    coordinate of the exchanged momentum in units of sqrt(v_hat) (0: none)."""
    axes = as_axes(axis_name)
    ex = Exchange.of(exchange, **allreduce)
    spec = ex.spec
    assert ex.form is not Form.PLAIN and spec.start >= 1, spec  # dpjax.plan refuses the rest
    exact = ex.exact(per_shard=True)  # the gradient's exact mean, per shard where the momentum's is
    ex = dataclasses.replace(ex, compression=dataclasses.replace(spec, start=0, refresh=0, bound=0.0))
    assert ex.keeps_state(axes) or not axes, spec
    rule = _Rule(adamw, clip, schedule, axes, ex, exact, b1, b2, eps, weight_decay, freeze=spec.start,
                 bound=spec.bound, refreshes=jnp.asarray(spec.refreshes(), jnp.int32))
    return UpdateRule("onebit_adam", rule.init, rule.step, identity, rule.specs, lambda params: params, axes,
                      ex.keeps_state(axes))


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity (`refreshes` is an array)
class _Rule:
    """The rule's parts, resolved once by `onebit_adam`: the AdamW chain and its schedule,
    the two exchanges (the gradient's exact mean for the warm-up and the refreshes, the
    momentum's compressed one after the freeze) and AdamW's arithmetic, done by hand once
    the variance is frozen. Each step runs one of two branches (`exact_step`, `frozen`)."""

    adamw: Any
    clip: Callable
    schedule: Callable
    axes: tuple
    ex: Exchange  # the momentum's: start, refresh and bound taken off (this rule runs them)
    exact: Any
    b1: float
    b2: float
    eps: float
    weight_decay: float
    freeze: int
    bound: float
    refreshes: Any  # the steps after the freeze that update v (maybe none)

    def init(self, params):
        inner, exchange = self.adamw.init(params), self.ex.init(params, self.axes)
        return OneBitState(inner, exchange, jax.tree.map(jnp.zeros_like, params) if self.bound else ())

    def specs(self, ps, shapes):
        return OneBitState(state_specs(self.adamw, shapes.inner, ps), self.ex.specs(ps, self.axes),
                           ps if self.bound else ())

    def v_updates(self, count):
        """How many times v was updated in the `count` steps done: each warm-up step, each refresh."""
        return jnp.minimum(count, self.freeze) + jnp.sum(self.refreshes < count)

    def debiased(self, v, k):
        """v_hat: v after k updates, its bias corrected."""
        return jax.tree.map(lambda x: x / (1 - self.b2 ** k).astype(x.dtype), v)

    def momentum(self, g, adam):
        """b1 m + (1 - b1) g, from the m the state holds."""
        return jax.tree.map(lambda gi, mu: (1 - self.b1) * gi + self.b1 * mu, g, adam.mu)

    def adam_step(self, params, m, v_hat, count, lr):
        """AdamW's update of the parameters from m (t = count steps, these included) and v_hat."""
        def one(p, m, v_hat):
            m_hat = m / (1 - self.b1 ** count).astype(m.dtype)
            return p - lr * (m_hat / (jnp.sqrt(v_hat) + self.eps) + self.weight_decay * p)

        return jax.tree.map(one, params, m, v_hat)

    def step(self, grad_fn, params, state, batch):
        loss, g = grad_fn(params, batch)
        adam = _find(state.inner, optax.ScaleByAdamState)
        count = optax.safe_increment(adam.count)  # t: the steps done, this one included
        sched = _find(state.inner, optax.ScaleByScheduleState)  # None for a constant lr given as a float
        lr = self.schedule(adam.count if sched is None else sched.count)
        exact_now = (adam.count < self.freeze) | jnp.any(self.refreshes == adam.count)
        with scopes.scope("compression", start=self.freeze):  # comm_bytes charges a step the branch it runs
            params, state = lax.cond(exact_now, lambda: self.exact_step(g, params, state, adam, count, lr),
                                     lambda: self.frozen(g, params, state, adam, count, lr))
        return params, state, loss

    def exact_step(self, g, params, state, adam, count, lr):
        """The warm-up (the chain's own AdamW) or a refresh (m and v both updated), from the
        gradient's exact mean."""
        gm, _ = self.exact.mean(g, self.axes)  # the one exchange of this branch (the update below has none)

        def warm():
            updates, inner = self.adamw.update(gm, state.inner, params)
            return optax.apply_updates(params, updates), state._replace(inner=inner)

        def refresh():
            gc = self.clip(gm)
            m = self.momentum(gc, adam)
            v = jax.tree.map(lambda gi, nu: (1 - self.b2) * gi * gi + self.b2 * nu, gc, adam.nu)
            params_ = self.adam_step(params, m, self.debiased(v, self.v_updates(adam.count) + 1), count, lr)
            return params_, state._replace(inner=_carried(state.inner, count, m, v))

        return lax.cond(adam.count < self.freeze, warm, refresh)

    def frozen(self, g, params, state, adam, count, lr):
        """After the freeze: this worker's momentum through the compressed exchange, v as it was."""
        local = self.momentum(self.clip(g), adam)
        if self.bound:  # what the bound held back last step goes out now, once (the same on every worker)
            local = jax.tree.map(jnp.add, local, state.held)
        with scopes.scope("momentum"):
            m, exchange = self.ex.mean(local, self.axes, state.exchange)
        v_hat = self.debiased(adam.nu, self.v_updates(adam.count))
        held = ()
        if self.bound:  # no coordinate's momentum beyond bound x sqrt(v_hat): the excess is held, not lost
            bound = self.bound
            kept = jax.tree.map(lambda a, v: jnp.clip(a, -bound * jnp.sqrt(v), bound * jnp.sqrt(v)), m, v_hat)
            held, m = jax.tree.map(jnp.subtract, m, kept), kept
        params_ = self.adam_step(params, m, v_hat, count, lr)
        return params_, OneBitState(_carried(state.inner, count, m, adam.nu), exchange, held)


def _carried(inner, count, m, nu):
    """The chain's state after a step of ours: adam's count, mu and nu; the schedule's count."""
    return _replace(inner, {optax.ScaleByAdamState: lambda s: s._replace(count=count, mu=m, nu=nu),
                            optax.ScaleByScheduleState: lambda s: s._replace(count=optax.safe_increment(s.count))})


def _find(state, kind):
    """The one `kind` (an optax state NamedTuple) inside the chain's nested tuples."""
    if isinstance(state, kind):
        return state
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        found = [f for f in (_find(s, kind) for s in state) if f is not None]
        assert len(found) <= 1, (kind, state)
        return found[0] if found else None
    return None


def _replace(state, fns):
    """The chain's state with each state of a kind in `fns` replaced by fns[kind](it)."""
    for kind, fn in fns.items():
        if isinstance(state, kind):
            return fn(state)
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        return tuple(_replace(s, fns) for s in state)
    return state


# `--optimizer onebit_adam` without a --compression (issue 36): the warm-up a share of the run, as the
# paper's 15-25%, at most WARMUP_MAX steps, then 0/1 Adam's refreshes of the variance; no bound. Measured
# by experiments/onebit_grid.py (experiments/RESULTS.md, "1-bit Adam's default"): a bound cost loss at
# every C tried, and at 1000 steps a warm-up of 100 ended nearer AdamW than one of 200 or 250 (the
# refreshes, S R, S R^2, ..., keep v fresh; a later freeze leaves fewer of them), at 200 steps 40 nearer
# than 20.
WARMUP_FRACTION, WARMUP_MAX, REFRESH, BOUND = 0.2, 100, 2, 0.0


def default_compression(steps: int) -> str:
    """The --compression `--optimizer onebit_adam` runs with when none is given, for a run
    of `steps` steps: onebit,start=S (S = WARMUP_FRACTION x steps, at least 1, at most
    WARMUP_MAX) with refresh=REFRESH and bound=BOUND (0 leaves either out)."""
    out = f"onebit,start={max(1, min(round(WARMUP_FRACTION * steps), WARMUP_MAX))}"
    return out + (f",refresh={REFRESH}" if REFRESH else "") + (f",bound={BOUND:g}" if BOUND else "")


def for_config(opt, adamw, global_batch: int, specs, axis_name=(), *, b1: float, b2: float, eps: float,
               **allreduce) -> UpdateRule:
    """The rule of a `dpjax.optim.OptimizerConfig` named onebit_adam, whose `make` gave
    `adamw` (the warm-up's chain): its clipping over the layout's `specs`, schedule for
    `global_batch`, weight decay, and AdamW's b1, b2, eps (`dpjax.optim.ADAM_*`, passed
    by the plan: optim is this package's neighbour, not below it)."""
    clipper = opt.clipper(specs)
    clip = (lambda g: g) if clipper is None else (lambda g: clipper.update(g, optax.EmptyState())[0])
    return onebit_adam(adamw, clip, opt.schedule(global_batch), axis_name, b1=b1, b2=b2, eps=eps,
                       weight_decay=opt.weight_decay, **allreduce)


def _build(spec, inner, axis_name, *, seed, optimizer, **exchange):
    """The registry's build: `for_config` of the run's optimizer (`registry.Optimizer`)."""
    o = optimizer
    return for_config(o.config, inner, o.global_batch, o.specs, axis_name, b1=o.b1, b2=o.b2, eps=o.eps, **exchange)


register(Kind("onebit_adam", "1-bit Adam: AdamW, its variance frozen after start=S, then the momentum compressed",
              build=_build, is_sync=lambda spec: False, chosen_by_optimizer=True))
