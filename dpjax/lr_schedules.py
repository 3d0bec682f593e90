"""Learning-rate schedules: what the rate does after warm-up, one registry entry each.

Every schedule first warms up linearly over `warmup_steps` to the peak rate (from 0, or,
with Goyal et al.'s linear scaling, from the unscaled lr: their gradual warmup), then
follows its shape from the peak down to `min_lr`:

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

from dataclasses import dataclass
from typing import Callable

import jax.numpy as jnp
import optax

from dpjax.errors import UserError


@dataclass(frozen=True)
class Shape:
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
    "constant": Shape("the peak rate after warm-up", None),
    # (1 + cos(pi f)) / 2 written as cos^2(pi f / 2): no cancellation as f -> 1
    "cosine": Shape("half a cosine from the peak to --min-lr", lambda f: jnp.cos(jnp.pi / 2 * f) ** 2),
    "linear": Shape("a straight line from the peak to --min-lr", lambda f: 1 - f),
    "wsd": Shape("warmup-stable-decay: the peak, then a 1-sqrt decay to --min-lr over the last --decay-steps "
                 "(default: a fifth of --steps; Hägele et al. 2024)", lambda f: 1 - jnp.sqrt(f), tail=True),
}


def describe() -> str:
    return "; ".join(f"{name}: {shape.help}" for name, shape in LR_SCHEDULES.items())


def make(name: str, *, peak: float, start: float, warmup: int, min_lr: float = 0.0, decay_start: int | None = None,
         decay_steps: int = 0):
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
