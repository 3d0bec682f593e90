"""The inner optimizer a run asks for: name, learning-rate schedule, clipping.

`OptimizerConfig.make(global_batch, specs)` builds the optax transformation that every
update rule wraps. Goyal et al.'s linear scaling and gradual warmup live here (the
schedules after warm-up: `dpjax.lr_schedules`); so does
global-norm clipping over sharded gradients (`specs`: each leaf's PartitionSpec, so the
norm sums every shard exactly once).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from dpjax.errors import UserError
from dpjax.sharding import sq_norm

OPTIMIZERS = ("adamw", "sgd", "momentum", "onebit_adam")
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.95, 1e-8  # adamw's, and 1-bit Adam's (dpjax.updates.onebit_adam)
LR_SCALINGS = ("none", "linear")


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"  # one of OPTIMIZERS
    lr: float = 3e-3
    lr_scaling: str = "none"  # one of LR_SCALINGS; linear: Goyal et al.'s lr * global_batch / 256
    warmup_steps: int = 0
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    lr_schedule: str = "constant"  # one of dpjax.lr_schedules.LR_SCHEDULES: the shape after warm-up
    min_lr: float = 0.0  # where the decay ends (not scaled)
    decay_start: int | None = None  # the decay's first step (None: the end of warm-up)
    decay_steps: int = 0  # the decay's length (0: none)

    def peak_lr(self, global_batch: int) -> float:
        return self.lr * global_batch / 256 if self.lr_scaling == "linear" else self.lr

    def schedule(self, global_batch: int):
        """Linear warmup, then the `lr_schedule`'s shape (`dpjax.lr_schedules`). With
        linear scaling the warmup starts from the unscaled lr and ramps to the scaled one
        (Goyal et al.'s gradual warmup); without, it ramps from 0."""
        from dpjax import lr_schedules

        start = self.lr if self.lr_scaling == "linear" else 0.0
        return lr_schedules.make(self.lr_schedule, peak=self.peak_lr(global_batch), start=start,
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
