"""The sharded train and eval steps: one `jit(shard_map(...))` each.

All of them are `dpjax.shard_step`s. Inside the step every device sees its own slice of the batch (rows split over the
data axes: `node` and `data`) and a replica of the parameters; the gradient average
over the data axes is dpjax's `DistributedOptimizer`, so every byte that crosses
devices goes through an explicit collective. The `model` axis holds replicas until
tensor parallelism gives it work.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.data_parallel import DistributedOptimizer, batch_sharding, broadcast_params, shard_step
from dpjax.mesh import data_axes


def dp_axis(mesh):
    """The axis name gradients are averaged over: one name, or (outer, inner) for two."""
    axes = data_axes(mesh)
    return axes[0] if len(axes) == 1 else axes


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"  # adamw | sgd | momentum
    lr: float = 3e-3
    lr_scaling: str = "none"  # none | linear (Goyal et al.: lr * global_batch / 256)
    warmup_steps: int = 0
    weight_decay: float = 0.0
    clip_norm: float = 1.0

    def peak_lr(self, global_batch: int) -> float:
        return self.lr * global_batch / 256 if self.lr_scaling == "linear" else self.lr

    def schedule(self, global_batch: int):
        """Linear warmup then constant. With linear scaling the warmup starts from the
        unscaled lr and ramps to the scaled one (Goyal et al.'s gradual warmup);
        without, it ramps from 0."""
        peak = self.peak_lr(global_batch)
        if self.warmup_steps <= 0:
            return optax.constant_schedule(peak)
        start = self.lr if self.lr_scaling == "linear" else 0.0
        return optax.linear_schedule(start, peak, self.warmup_steps)

    def make(self, global_batch: int) -> optax.GradientTransformation:
        if self.lr_scaling not in ("none", "linear"):
            raise ValueError(f"unknown lr scaling {self.lr_scaling!r}; choose none or linear")
        sched = self.schedule(global_batch)
        if self.name == "adamw":
            opt = optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=self.weight_decay)
        elif self.name == "sgd":
            opt = optax.sgd(sched)
        elif self.name == "momentum":
            opt = optax.sgd(sched, momentum=0.9, nesterov=True)
        else:
            raise ValueError(f"unknown optimizer {self.name!r}; choose adamw, sgd or momentum")
        return optax.chain(optax.clip_by_global_norm(self.clip_norm), opt) if self.clip_norm > 0 else opt


def replicated(mesh):
    return NamedSharding(mesh, P())


def init_state(model, tx, mesh, key):
    """Parameters and optimizer state, created by a jitted init directly in their sharding."""
    def init(k):
        params = model.init(k)
        return params, tx.init(params)

    return jax.jit(init, out_shardings=replicated(mesh))(key)


def make_train_step(model, tx, mesh, *, donate: bool = True):
    """(params, opt_state, batch) -> (params, opt_state, mean loss over the global batch).

    `tx` should be a DistributedOptimizer over `dp_axis(mesh)`.
    """
    axes = data_axes(mesh)

    def step(params, opt_state, batch_bxT1):
        loss, grads = jax.value_and_grad(model.loss)(params, batch_bxT1)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, lax.pmean(loss, axes)

    return shard_step(step, mesh, batch_argnums=(2,), donate_argnums=(0, 1) if donate else ())


def make_eval_step(model, mesh):
    axes = data_axes(mesh)

    def step(params, batch_bxT1):
        return lax.pmean(model.loss(params, batch_bxT1), axes)

    return shard_step(step, mesh, batch_argnums=(1,))


def make_broadcast_step(mesh):
    """Horovod's broadcast_parameters over the data axes, as a jitted step."""
    return shard_step(functools.partial(broadcast_params, axis_name=dp_axis(mesh), root=0), mesh)


def distributed_optimizer(opt: OptimizerConfig, mesh, global_batch: int, *, algorithm="ring", fusion_mb=64.0,
                          compression=None, backward_passes_per_step=1, **options):
    return DistributedOptimizer(opt.make(global_batch), axis_name=dp_axis(mesh), algorithm=algorithm,
                                fusion_mb=fusion_mb, compression=compression,
                                backward_passes_per_step=backward_passes_per_step, **options)


def put_batch(stream, cursor: int, global_batch: int, mesh):
    """The global batch at `cursor` as one sharded array; each device reads only its rows
    (in a multi-process run, each process reads only what its devices hold)."""
    sharding = batch_sharding(mesh)
    shape = (global_batch, stream.seq_len + 1)
    return jax.make_array_from_callback(
        shape, sharding, lambda idx: stream.batch(cursor, global_batch, rows=idx[0]))


def num_bytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
