"""The inner optimizer a run asks for: name, learning-rate schedule, clipping.

`OptimizerConfig.make(global_batch, specs)` builds the optax transformation that every
update rule wraps. Goyal et al.'s linear scaling and gradual warmup live here; so does
global-norm clipping over sharded gradients (`specs`: each leaf's PartitionSpec, so the
norm sums every shard exactly once).

The learning-rate schedules are a registry (`LR_SCHEDULES`). Every schedule first warms
up linearly over `warmup_steps` to the peak rate (from 0, or, with Goyal et al.'s linear
scaling, from the unscaled lr: their gradual warmup), then follows its shape from the peak
down to `min_lr`:

  constant  the peak to the end (no decay)
  cosine    half a cosine over the decay (Loshchilov & Hutter 2017, SGDR, without restarts)
  linear    a straight line over the decay
  wsd       warmup-stable-decay: the peak until the last decay steps, then down along 1 - sqrt
            (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed
            Training Durations": their 1-sqrt cooldown beat the linear one)

The decay of cosine and linear starts right after warm-up and lasts every step left
unless `decay_steps` says otherwise; wsd's lasts the last fifth of the run by default.
Step t counts optimizer updates from 0 (optax's count): update t uses lr(t), and after
the decay the rate stays at `min_lr`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from dpjax.errors import UserError
from dpjax.sharding import sq_norm

OPTIMIZERS = ("adamw", "sgd", "momentum", "onebit_adam")
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.95, 1e-8  # adamw's, and 1-bit Adam's (dpjax.updates.onebit_adam)
LR_SCALINGS = ("none", "linear")


@dataclass(frozen=True)
class LrSchedule:
    """One schedule: `keep(f)` is the part of the gap between the peak and min_lr that is
    left when a fraction f (0..1) of the decay is done, 1 -> 0 (None: no decay); `tail`:
    the decay is the run's last steps (wsd) rather than the ones right after warm-up.
    The rate is min_lr + (peak - min_lr) * keep(f): near min_lr no float32 cancellation."""

    help: str
    keep: Callable | None
    tail: bool = False

    def window(self, steps: int, warmup: int, decay_steps: int | None) -> tuple[int, int]:
        """(first step of the decay, its length) in a run of `steps` updates."""
        if self.keep is None:
            return warmup, 0
        if self.tail:
            length = decay_steps if decay_steps is not None else max(1, steps // 5)
            return steps - length, length
        return warmup, decay_steps if decay_steps is not None else max(1, steps - warmup)


LR_SCHEDULES = {
    "constant": LrSchedule("the peak rate after warm-up", None),
    # (1 + cos(pi f)) / 2 written as cos^2(pi f / 2): no cancellation as f -> 1
    "cosine": LrSchedule("half a cosine from the peak to --min-lr", lambda f: jnp.cos(jnp.pi / 2 * f) ** 2),
    "linear": LrSchedule("a straight line from the peak to --min-lr", lambda f: 1 - f),
    "wsd": LrSchedule("warmup-stable-decay: the peak, then a 1-sqrt decay to --min-lr over the last --decay-steps "
                 "(a fifth of --steps unless given; Hägele et al. 2024)", lambda f: 1 - jnp.sqrt(f), tail=True),
}


def describe_schedules() -> str:
    return "; ".join(f"{name}: {shape.help}" for name, shape in LR_SCHEDULES.items())


def make_schedule(name: str, *, peak: float, start: float, warmup: int, min_lr: float = 0.0,
                  decay_start: int | None = None, decay_steps: int = 0):
    """The schedule `name` as an optax schedule (step count -> rate): linear warm-up from
    `start` to `peak` over `warmup` steps, then the shape's decay from `peak` to `min_lr`
    over `decay_steps` steps from `decay_start` (default: the end of warm-up)."""
    if name not in LR_SCHEDULES:
        raise UserError(f"unknown lr schedule {name!r}; choose one of {', '.join(LR_SCHEDULES)}")
    shape = LR_SCHEDULES[name]
    if shape.keep is None or decay_steps <= 0:  # today's schedule, unchanged: warm-up then the peak
        return optax.constant_schedule(peak) if warmup <= 0 else optax.linear_schedule(start, peak, warmup)
    begin = warmup if decay_start is None else decay_start

    def after(count):
        f = jnp.clip((count - begin) / decay_steps, 0.0, 1.0)
        return min_lr + (peak - min_lr) * shape.keep(f)

    if warmup <= 0:
        return after
    warm = optax.linear_schedule(start, peak, warmup)
    return lambda count: jnp.where(count < warmup, warm(count), after(count))


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"  # one of OPTIMIZERS
    lr: float = 3e-3
    lr_scaling: str = "none"  # one of LR_SCALINGS; linear: Goyal et al.'s lr * global_batch / 256
    warmup_steps: int = 0
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    lr_schedule: str = "constant"  # one of LR_SCHEDULES: the shape after warm-up
    min_lr: float = 0.0  # where the decay ends (not scaled)
    decay_start: int | None = None  # the decay's first step (None: the end of warm-up)
    decay_steps: int = 0  # the decay's length (0: none)

    def peak_lr(self, global_batch: int) -> float:
        return self.lr * global_batch / 256 if self.lr_scaling == "linear" else self.lr

    def schedule(self, global_batch: int):
        """Linear warmup, then the `lr_schedule`'s shape (`LR_SCHEDULES`). With
        linear scaling the warmup starts from the unscaled lr and ramps to the scaled one
        (Goyal et al.'s gradual warmup); without, it ramps from 0."""
        start = self.lr if self.lr_scaling == "linear" else 0.0
        return make_schedule(self.lr_schedule, peak=self.peak_lr(global_batch), start=start,
                                 warmup=self.warmup_steps, min_lr=self.min_lr, decay_start=self.decay_start,
                                 decay_steps=self.decay_steps)

    def make(self, global_batch: int, specs=None) -> optax.GradientTransformation:
        """The optimizer; `specs` (the gradients' PartitionSpecs) make the clipping norm
        global over sharded gradients."""
        if self.lr_scaling not in LR_SCALINGS:
            raise UserError(f"unknown lr scaling {self.lr_scaling!r}; choose {' or '.join(LR_SCALINGS)}")
        sched = self.schedule(global_batch)
        if self.name in ("adamw", "onebit_adam"):  # 1-bit Adam's warm-up is this AdamW, bit for bit
            opt = optax.adamw(sched, b1=ADAM_B1, b2=ADAM_B2, eps=ADAM_EPS, weight_decay=self.weight_decay)
        elif self.name == "sgd":
            opt = optax.sgd(sched)
        elif self.name == "momentum":
            opt = optax.sgd(sched, momentum=0.9, nesterov=True)
        else:
            raise UserError(f"unknown optimizer {self.name!r}; choose {', '.join(OPTIMIZERS)}")
        clip = self.clipper(specs)
        return opt if clip is None else optax.chain(clip, opt)

    def clipper(self, specs=None) -> optax.GradientTransformation | None:
        """The global-norm clipping `make` chains before the optimizer (None: off)."""
        if self.clip_norm <= 0:
            return None
        return optax.clip_by_global_norm(self.clip_norm) if specs is None else clip_by_global_norm(
            self.clip_norm, functools.partial(sq_norm, specs=specs))


def clip_by_global_norm(max_norm: float, sq_norm_fn) -> optax.GradientTransformation:
    """optax.clip_by_global_norm (same rule, same empty state) with the squared norm
    computed by `sq_norm_fn`: over sharded gradients a local norm would be wrong."""
    def update(updates, state, params=None):
        norm = jnp.sqrt(sq_norm_fn(updates))
        updates = jax.tree.map(lambda t: jnp.where(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm),
                               updates)
        return updates, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
