"""The sharded train and eval steps: one `jit(shard_map(...))` each.

All of them are `dpjax.shard_step`s over a `dpjax.sharding.Layout`. Inside the step
every device sees its own slice of the batch (rows split over the data axes: `node`
and `data`) and its shards of the parameters: split over `model` by the model's
tensor-parallel table, and over the data axes too under FSDP. Every byte that crosses
devices goes through an explicit dpjax collective: the tensor-parallel layers' f/g
over `model`, FSDP's all-gather / reduce-scatter over the data axes, and otherwise the
`DistributedOptimizer`'s fused allreduce of the gradients.
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
from dpjax.sharding import Layout, make_layout, sq_norm, state_specs


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

    def make(self, global_batch: int, specs=None) -> optax.GradientTransformation:
        """The optimizer; `specs` (the gradients' PartitionSpecs) make the clipping norm
        global over sharded gradients."""
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
        if self.clip_norm <= 0:
            return opt
        clip = optax.clip_by_global_norm(self.clip_norm) if specs is None else clip_by_global_norm(
            self.clip_norm, functools.partial(sq_norm, specs=specs))
        return optax.chain(clip, opt)


def clip_by_global_norm(max_norm: float, sq_norm_fn) -> optax.GradientTransformation:
    """optax.clip_by_global_norm (same rule, same empty state) with the squared norm
    computed by `sq_norm_fn`: over sharded gradients a local norm would be wrong."""
    def update(updates, state, params=None):
        norm = jnp.sqrt(sq_norm_fn(updates))
        updates = jax.tree.map(lambda t: jnp.where(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm),
                               updates)
        return updates, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def replicated(mesh):
    return NamedSharding(mesh, P())


def as_layout(model, mesh_or_layout) -> Layout:
    """A Layout; a bare mesh means replicated parameters (pure data parallelism), as in
    `distributed_optimizer`, so that the steps and the optimizer agree on the layout."""
    if isinstance(mesh_or_layout, Layout):
        return mesh_or_layout
    return make_layout(model, mesh_or_layout, tensor_parallel=False)


def opt_specs(tx, layout: Layout, model):
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    return state_specs(tx, jax.eval_shape(tx.init, abstract), layout.specs)


def init_state(model, tx, layout, key):
    """Parameters and optimizer state, created by a jitted init directly in their
    sharding: no device ever holds a whole sharded weight, and the values do not depend
    on the mesh (jax's partitionable threefry)."""
    layout = as_layout(model, layout)

    def init(k):
        params = model.init(k)
        return params, tx.init(params)

    out = (layout.shardings(), layout.shardings(opt_specs(tx, layout, model)))
    return jax.jit(init, out_shardings=out)(key)


def make_train_step(model, tx, layout, *, donate: bool = True):
    """(params, opt_state, batch) -> (params, opt_state, mean loss over the global batch).

    `tx` should be `distributed_optimizer(..., layout, ...)`.
    """
    layout = as_layout(model, layout)
    axes, par = data_axes(layout.mesh), layout.parallel()
    ospecs = opt_specs(tx, layout, model)

    def step(params, opt_state, batch_bxT1):
        loss, grads = jax.value_and_grad(model.loss)(params, batch_bxT1, par)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, lax.pmean(loss, axes)

    return shard_step(step, layout.mesh, batch_argnums=(2,), donate_argnums=(0, 1) if donate else (),
                      in_specs=(layout.specs, ospecs, None), out_specs=(layout.specs, ospecs, P()))


def make_eval_step(model, layout):
    layout = as_layout(model, layout)
    axes, par = data_axes(layout.mesh), layout.parallel()

    def step(params, batch_bxT1):
        return lax.pmean(model.loss(params, batch_bxT1, par), axes)

    return shard_step(step, layout.mesh, batch_argnums=(1,), in_specs=(layout.specs, None))


def make_broadcast_step(layout: Layout):
    """Horovod's broadcast_parameters over the data axes, as a jitted step (each device
    broadcasts its own shards; under FSDP there is nothing to broadcast: the data ranks
    hold different shards, and the step is the identity)."""
    if layout.fsdp:
        return lambda params: params
    fn = functools.partial(broadcast_params, axis_name=dp_axis(layout.mesh), root=0)
    return shard_step(fn, layout.mesh, in_specs=(layout.specs,), out_specs=layout.specs)


def distributed_optimizer(opt: OptimizerConfig, layout, global_batch: int, *, algorithm="ring", fusion_mb=64.0,
                          compression=None, backward_passes_per_step=1, **options):
    """The DistributedOptimizer for `layout` (or a mesh: replicated parameters). Under
    FSDP the gradients arrive reduce-scattered and averaged, so it does not allreduce."""
    mesh = layout.mesh if isinstance(layout, Layout) else layout
    specs = layout.specs if isinstance(layout, Layout) else None
    fsdp = isinstance(layout, Layout) and layout.fsdp
    return DistributedOptimizer(opt.make(global_batch, specs), axis_name=None if fsdp else dp_axis(mesh),
                                algorithm=algorithm, fusion_mb=fusion_mb, compression=compression,
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
