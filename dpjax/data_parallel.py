"""Data parallelism the Horovod way: an optimizer wrapper that averages gradients.

`DistributedOptimizer(inner)` is an `optax.GradientTransformation` to be used inside
`jax.shard_map`, where each data-parallel rank holds the gradient of its own slice of
the batch. Its update packs the gradients into tensor-fusion buckets
(`dpjax.fusion`), allreduces each bucket once with the chosen explicit algorithm
(`dpjax.collectives`), unpacks the average and hands it to `inner`: the exchange
every rule runs (`dpjax.compression.exchange.Exchange`), with its error feedback. This is
Horovod's design (Sergeev & Del Balso, "Horovod: fast and easy distributed deep
learning in TensorFlow", 2018): wrap the optimizer, broadcast the initial parameters,
shard the data.

The shard_map that holds the train step must be built with `check_vma=False`: with
JAX's varying-manual-axes checking on, differentiating replicated parameters against
per-rank data makes autodiff insert its own psum, and the gradient would be averaged
twice (once by JAX, silently, once here).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax import collectives
from dpjax.collectives.ranks import axis_size
from dpjax.compression import Exchange
from dpjax.fusion import pack, plan_buckets, unpack
from dpjax.mesh import DATA, NOT_DATA, bound, data_axes
from dpjax.wrap.rng import bound_data_axes
from dpjax.wrap.checks import splits_nothing
from dpjax.wrap.per_rank import DistributedState  # noqa: F401  (its home: the per-rank state it carries)

OPS = ("mean", "sum", "adasum")


def allreduce_gradients(grads, axis_name="data", *, algorithm: str = "ring", fusion_mb: float = 64,
                        compression=None, gradient_predivide_factor: float = 1.0, op: str = "mean", **options):
    """The average (op="mean"), sum or Adasum of `grads` over `axis_name`: fused buckets,
    one allreduce per bucket (`collectives.grouped_allreduce`).

    compression: None or a method of `dpjax.compression` ("bf16", "fp16"): floating-point
    buckets travel in that dtype and are cast back (integer and bool gradients travel as
    they are; every leaf keeps its dtype, an integer mean rounding toward zero as
    Horovod's does).
    gradient_predivide_factor f (op="mean" only, as in Horovod): multiply by 1/f before
    the sum and by f/n after it (Horovod's prescale / postscale guard against fp16
    overflow in the sum).
    op="adasum": Adasum (Maleki et al.) over the butterfly, each tensor with its own
    coefficients; `algorithm` must then be "butterfly".
    """
    axis_size(axis_name, "allreduce_gradients")
    if op not in OPS:
        raise ValueError(f"unknown gradient op {op!r}; choose one of {', '.join(OPS)}")
    f = gradient_predivide_factor
    if op != "mean" and f != 1.0:
        raise ValueError(f"gradient_predivide_factor applies to op='mean' only, not to op={op!r}")
    return Exchange(algorithm, fusion_mb, compression, options).allreduce(grads, axis_name, op=op,
                                                                          prescale_factor=1 / f, postscale_factor=f)


def _named(axis_name):
    """The default axis "data" as the mesh names it: on a mesh of the user's own axis names
    (the JAX AI Stack's ('batch', 'model')) the data axes bound here, whatever they are called."""
    names = jax.sharding.get_abstract_mesh().axis_names
    if axis_name != DATA or DATA in names:
        return axis_name
    # every data axis of one device (check="reference"'s one-device run, a (1, 8) mesh): the
    # average over them is the identity, still taken over an axis that is bound
    axes = bound_data_axes() or tuple(a for a in names if a not in NOT_DATA and bound(a))
    return axes[0] if len(axes) == 1 else axes or axis_name


def DistributedOptimizer(inner: optax.GradientTransformation, axis_name="data", algorithm: str = "ring",
                         fusion_mb: float = 64, compression=None, backward_passes_per_step: int = 1,
                         gradient_predivide_factor: float = 1.0, op: str = "mean",
                         **options) -> optax.GradientTransformation:
    """Wraps `inner` so that it sees gradients averaged over `axis_name`.

    backward_passes_per_step k > 1 accumulates k local gradients and exchanges their
    mean once every k calls (in between, the updates are zero and `inner` does not
    step), so k passes over batches of b equal one pass over a batch of k*b.
    options go to the allreduce (`num_servers` for "ps", `outer_algorithm` for
    "hierarchical"). axis_name None: the gradients arrive averaged already (fully
    sharded data parallelism reduce-scatters them in the backward pass).
    op: "mean" (Horovod's Average), "sum", or "adasum" with algorithm="butterfly":
    as Horovod's Adasum optimizer, each rank's `inner` steps on its own gradient and
    the updates are combined by Adasum (Maleki et al. apply it to the optimizer's
    output). `inner`'s state is then each rank's own: replicated only for a stateless
    `inner` such as SGD.
    compression: a name of `dpjax.compression` or a spec such as "powersgd:4,start=100"
    (`dpjax.compression.grammar`). A method with error feedback keeps each rank's error
    buffer (and PowerSGD's Q) in `DistributedState.compression`: that part of the state
    differs between ranks, so it needs a per-rank layout outside the shard_map: a leading
    axis split over `axis_name`. `dpjax.shard_step` gives it one for an `nnx.Optimizer`
    (`dpjax.wrap.per_rank`); in your own shard_map, return it that way.
    """
    collectives.check_algorithm(algorithm)
    ex = Exchange(algorithm, fusion_mb, compression, options)  # a bad compression: one line here
    keeps_state = axis_name is not None and ex.keeps_state(axis_name)
    _check_arguments(compression, keeps_state, options, backward_passes_per_step, gradient_predivide_factor, op,
                     algorithm)

    def exchange(tree, comp):
        if axis_name is None:
            return tree, comp
        axis = _named(axis_name)
        if keeps_state:
            return ex.mean(tree, axis, comp)
        return allreduce_gradients(tree, axis, algorithm=algorithm, fusion_mb=fusion_mb,
                                   compression=compression, op=op,
                                   gradient_predivide_factor=gradient_predivide_factor, **options), comp

    def step(grads, inner_state, params, comp):
        if op == "adasum":  # the local step first, then Adasum of the updates
            updates, inner_state = inner.update(grads, inner_state, params)
            updates, comp = exchange(updates, comp)
            return updates, inner_state, comp
        grads, comp = exchange(grads, comp)
        return (*inner.update(grads, inner_state, params), comp)

    return _accumulating(inner, step, int(backward_passes_per_step),
                         lambda params: ex.init(params, axis_name) if keeps_state else ())


def _check_arguments(compression, keeps_state: bool, options, backward_passes_per_step, gradient_predivide_factor,
                     op: str, algorithm: str) -> None:
    """DistributedOptimizer's arguments that make no sense together: a ValueError naming them
    (keeps_state: the compression keeps per-rank state, error feedback, over the axis)."""
    if keeps_state and op != "mean":
        raise ValueError(f"compression {compression!r} averages with error feedback: op must be 'mean', not {op!r}")
    if keeps_state and options.get("groups") is not None:
        raise ValueError(f"compression {compression!r} runs its own exchange over the whole axis: it takes no "
                         "process sets (groups=)")
    if int(backward_passes_per_step) != backward_passes_per_step or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step}")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor}")
    if op not in OPS:
        raise ValueError(f"unknown gradient op {op!r}; choose one of {', '.join(OPS)}")
    if op == "adasum" and algorithm != "butterfly":
        raise ValueError(f"op='adasum' runs Adasum's own butterfly: pass algorithm='butterfly', not {algorithm!r}")
    if op != "mean" and gradient_predivide_factor != 1.0:
        raise ValueError(f"gradient_predivide_factor applies to op='mean' only, not to op={op!r}")


def _accumulating(inner, step, k: int, init_compression) -> optax.GradientTransformation:
    """The transformation around step(grads, inner_state, params, comp) -> (updates,
    inner_state, comp), the exchange and `inner`'s update: with k == 1 every call steps;
    with k > 1 the calls' gradients accumulate and every k-th steps on their mean (zero
    updates between). init_compression(params): the compression's per-rank state, or ()."""
    def init_fn(params):
        acc = jax.tree.map(jnp.zeros_like, params) if k > 1 else ()
        comp = init_compression(params)
        return DistributedState(inner.init(params), jnp.zeros((), jnp.int32), acc, comp)

    def update_fn(grads, state, params=None):
        if k == 1:
            updates, inner_state, comp = step(grads, state.inner, params, state.compression)
            return updates, DistributedState(inner_state, state.passes, (), comp)
        acc = jax.tree.map(jnp.add, state.accumulated, grads)
        passes = (state.passes + 1) % k

        def flush(_):
            updates, inner_state, comp = step(jax.tree.map(lambda a: a / k, acc), state.inner, params,
                                              state.compression)
            return updates, inner_state, jax.tree.map(jnp.zeros_like, acc), comp

        def hold(_):
            return jax.tree.map(jnp.zeros_like, grads), state.inner, acc, state.compression

        # The exchange sits in a cond, so the communication happens once per k passes.
        updates, inner_state, acc, comp = lax.cond(passes == 0, flush, hold, None)
        return updates, DistributedState(inner_state, passes, acc, comp)

    return optax.GradientTransformation(init_fn, update_fn)


@splits_nothing
def broadcast_params(params, axis_name="data", *, root: int = 0, algorithm: str = "tree",
                     fusion_mb: float = 64):
    """Every rank along `axis_name` ends with root's parameters (inside shard_map).

    Horovod's `broadcast_parameters`: run once after initialisation so that ranks
    that initialised differently (another seed, a restored checkpoint on one rank)
    start from the same point. Fused like the gradients: one broadcast per bucket.
    """
    plan = plan_buckets(params, fusion_mb * 2**20)
    bufs = [collectives.broadcast(b, axis_name, root=root, algorithm=algorithm) for b in pack(plan, params)]
    return unpack(plan, bufs)


def batch_sharding(mesh):
    """Rows split over the mesh's data axes (`node` and `data`), replicated over `model`."""
    return NamedSharding(mesh, P(data_axes(mesh)))


def shard_batch(mesh, *arrays, process_local: bool = False):
    """Places host arrays with their rows split over the mesh's data axes.

    process_local=False: each array is the whole global batch (every process passes the
    same rows; each device keeps its own). process_local=True: each array is only this
    process's rows of the global batch, `process_rows(mesh, B)` of it, and the global
    array is assembled from every process's part (`jax.make_array_from_process_local_data`):
    across hosts no process loads another's rows."""
    sharding = batch_sharding(mesh)
    if process_local:
        out = tuple(jax.make_array_from_process_local_data(sharding, np.asarray(a)) for a in arrays)
    else:
        out = tuple(jax.device_put(a, sharding) for a in arrays)
    return out if len(out) > 1 else out[0]


def process_rows(mesh, global_batch: int) -> slice:
    """The rows of a global batch of `global_batch` rows that this process's devices hold
    under `batch_sharding(mesh)`: what it loads for `shard_batch(..., process_local=True)`."""
    held = {idx[0].indices(global_batch)[:2]
            for idx in batch_sharding(mesh).addressable_devices_indices_map((global_batch,)).values()}
    starts = sorted(held)
    if any(a[1] != b[0] for a, b in zip(starts, starts[1:])):
        raise ValueError(f"this process's rows of mesh {dict(mesh.shape)} are not contiguous ({starts}); lay the "
                         "mesh out process-major (dpjax.make_mesh does)")
    return slice(starts[0][0], starts[-1][1])
