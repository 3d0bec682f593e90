"""Tensor (model) parallelism for huge layers, Megatron-LM style.

Shoeybi et al., "Megatron-LM: Training multi-billion parameter language models using
model parallelism" (2019), section 3. Inside `shard_map`, each device along the model
axis holds a slice of a layer's weight, never the whole of it:

- column-parallel dense: W split by output columns; the output stays split;
- row-parallel dense: W split by input rows; the partial outputs are summed;
- attention: Q, K, V (column-parallel) and the output projection (row-parallel)
  split by heads, so every head lives on one device;
- vocabulary-parallel embedding and softmax cross-entropy: the V x D table split by
  rows; the loss is assembled from per-shard maxima and sums, so the full B x T x V
  logits are never gathered.

Names carry shapes, and a dimension split over a mesh axis carries that axis's initial:
`w_DxFm` is D x F with F split over `model`, `x_BdxTxD` has its batch split over the data
axes; inside a shard_map the name is this device's block of that global array.

Two conjugate operators carry the communication (Megatron's f and g):
`copy_to_model` is the identity forward and an allreduce backward (a replicated input
fans out to every shard, so its gradient is the sum of theirs); `reduce_from_model` is
an allreduce forward and the identity backward. Both are custom VJPs, so autodiff never
differentiates through the allreduce itself; every allreduce is dpjax's explicit one
with the algorithm the caller chooses.

`Parallel` carries what a model needs inside the step: the model axis (None: the plain
dense computation, used for the unsharded reference), under fully sharded data
parallelism which dimension of each parameter to all-gather just before use, and the
compute policy (`dpjax.compute.policy.Policy`: dtype, remat, attention kernel, scan) that
`dpjax.compute.stack` runs the layers by; with a context axis, the axis each sequence is split
over (`dpjax.compute.context`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Union

import jax
import jax.numpy as jnp
from jax import lax

from dpjax import collectives
from dpjax.collectives.ranks import Subgroups, axis_size
from dpjax.collectives.ops import Wire, finish, on_wire
from dpjax.compute.dropout import Draw
from dpjax.compute.policy import Policy
from dpjax.mesh import bound

# A mesh axis (or axes) a collective runs over: a name, a tuple of names, or groups along one.
Axis = Union[str, tuple[str, ...], Subgroups]
# A pytree like the parameters: nested dicts (and lists) whose leaves are arrays, or ints
# (gather_dims: the dimension each leaf is split along, -1 replicated).
Tree = Union[dict[str, "Tree"], list["Tree"], tuple["Tree", ...], jax.Array, int]


def _active(axis) -> bool:
    """Whether `axis` needs communication: a named axis of size > 1, bound here (inside a
    shard_map over it). Where it is not bound (one device, `nnx.jit`, `jax.jit` under
    `jax.set_mesh`) every array is whole, so f, g and the parallel layers are the dense
    computation: a model written with them evaluates anywhere without a change."""
    return axis is not None and bound(axis.axis if isinstance(axis, Subgroups) else axis) and axis_size(axis) > 1


def _on_wire(reduce, g, wire, n: int, op: str):
    """reduce(g) (a sum over n ranks) with g encoded by `wire` (a `dpjax.compression`
    method, or None) on the way (`collectives.ops.on_wire`), then decoded and, for
    op="mean", divided by n in the gradient's own precision: the recipe of the grouped
    allreduce's compression (`collectives.grouped`)."""
    compress = wire is not None and wire.compresses(g.dtype)
    out = on_wire(wire, g, lambda v: reduce(v, "sum" if compress else op))
    return finish(out, op, n) if compress else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _copy(x, axis, algorithm, op, wire):
    return x


def _copy_fwd(x, axis, algorithm, op, wire):
    return x, None


def _copy_bwd(axis, algorithm, op, wire, _, g):
    def allreduce(v, how):
        return collectives.allreduce(v, axis, algorithm=algorithm, op=how)
    return (_on_wire(allreduce, g, wire, axis_size(axis), op),)


_copy.defvjp(_copy_fwd, _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _reduce(x, axis, algorithm):
    return collectives.allreduce(x, axis, algorithm=algorithm)


def _reduce_fwd(x, axis, algorithm):
    return _reduce(x, axis, algorithm), None


def _reduce_bwd(axis, algorithm, _, g):
    return (g,)


_reduce.defvjp(_reduce_fwd, _reduce_bwd)


def copy_to_model(x, axis="model", algorithm: str = "ring"):
    """Megatron's f: identity forward, allreduce (sum) of the gradient backward. Before a
    column-parallel matmul whose input depends on parameters (its gradient is the sum of
    every model rank's). The identity where `axis` is not bound (outside shard_step)."""
    return _copy(x, axis, algorithm, "sum", None) if _active(axis) else x


def reduce_from_model(x, axis="model", algorithm: str = "ring"):
    """Megatron's g: allreduce (sum) forward, identity backward. After a row-parallel
    matmul (each model rank holds a partial product); add that layer's bias after it, once.
    The identity where `axis` is not bound (outside shard_step)."""
    return _reduce(x, axis, algorithm) if _active(axis) else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather(x, dim, axis, algorithm, wire):
    x0 = jnp.moveaxis(x, dim, 0)
    return jnp.moveaxis(collectives.all_gather(x0, axis, algorithm=algorithm), 0, dim)


def _gather_fwd(x, dim, axis, algorithm, wire):
    return _gather(x, dim, axis, algorithm, wire), None


def _gather_bwd(dim, axis, algorithm, wire, _, g):
    def reduce_scatter(v, how):
        return collectives.reduce_scatter(v, axis, algorithm=algorithm, op=how)
    g0 = jnp.moveaxis(g, dim, 0)
    return (jnp.moveaxis(_on_wire(reduce_scatter, g0, wire, axis_size(axis), "mean"), 0, dim),)


_gather.defvjp(_gather_fwd, _gather_bwd)


# A leaf's FSDP gather dimension when FSDP leaves it alone: neither gathered nor averaged
# over the data axes (a mixture's experts, each device's own: dpjax.step averages them)
NOT_FSDP = -2


def gather_param(x, dim: int, axis, algorithm: str = "ring", wire=None):
    """ZeRO-3 (Rajbhandari et al., "ZeRO", SC 2020): the full parameter from its shards
    along `dim` (an explicit all-gather over the data axes); backward, the gradient is
    reduce-scattered back to the shards and averaged over the data ranks (encoded by
    `wire`, a `dpjax.compression` method, if given: gradient compression). dim=-1: the
    parameter is replicated over the data axes (too small to split); its gradient is
    allreduce-averaged instead. dim=NOT_FSDP: x as it is, its gradient too."""
    if not _active(axis) or dim == NOT_FSDP:
        return x
    if dim < 0:
        return _copy(x, axis, algorithm, "mean", wire)  # f over the data axes, averaging
    return _gather(x, dim, axis, algorithm, wire)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _gather_local(x, probe, dim, axis, algorithm):
    """The full parameter as `gather_param` gives it; backward, the gradient is not
    reduced: this device's full-size cotangent goes to `probe` (a zero array of the
    gathered shape) and x gets none. `dpjax.compression.sharded` reduces it afterwards,
    compressed, once per step."""
    if dim < 0:
        return x
    return jnp.moveaxis(collectives.all_gather(jnp.moveaxis(x, dim, 0), axis, algorithm=algorithm), 0, dim)


def _gather_local_fwd(x, probe, dim, axis, algorithm):
    return _gather_local(x, probe, dim, axis, algorithm), x


def _gather_local_bwd(dim, axis, algorithm, x, g):
    assert g.shape[:dim] + g.shape[dim + 1:] == x.shape[:dim] + x.shape[dim + 1:] if dim >= 0 else g.shape == x.shape
    return jnp.zeros_like(x), g


_gather_local.defvjp(_gather_local_fwd, _gather_local_bwd)


@dataclass(frozen=True)
class Parallel:
    """What a model sees inside the step. model_axis None: the dense computation.

    gather_dims (FSDP): a pytree like the parameters holding, per leaf, the dimension
    split over `data_axis` (-1: replicated). `use` gathers a subtree just before use.
    """

    model_axis: Axis | None = None
    algorithm: str = "ring"
    data_axis: Axis | None = None
    gather_dims: Tree | None = None
    fsdp_algorithm: str = "ring"
    fsdp_wire: Wire | None = None  # the compression method FSDP's gradients travel in, None: as they are
    # FSDP through a compression with error feedback (dpjax.compression.sharded): zero arrays
    # shaped like the gathered parameters, which receive each device's unreduced gradient
    probes: Tree | None = None
    policy: Policy = Policy()  # the compute dtype, remat, attention kernel and scan (dpjax.compute.stack runs by it)
    context_axis: Axis | None = None  # each sequence split over it (dpjax.compute.context), None: whole sequences
    expert_axis: Axis | None = None  # the experts split over it (dpjax.models.moe), None: all here
    # a training step's dropout draw (dpjax.compute.dropout.Draw: traced key and row ids, set by
    # dpjax.step.builder for a model with dropout); None: no dropout (evaluation, generation)
    dropout: Draw | None = None

    def _gather(self, x, d, probe):
        if probe is not None:
            return _gather_local(x, probe, d, self.data_axis, self.fsdp_algorithm)
        return gather_param(x, d, self.data_axis, self.fsdp_algorithm, self.fsdp_wire)

    def _probes(self, path):
        probes = self.probes
        for key in path:
            probes = probes[key]
        return probes

    def use(self, tree, *path):
        """The parameters `tree`, found at `path` in the full parameter tree, ready to
        compute with: all-gathered over the data axes under FSDP, else as they are."""
        if self.gather_dims is None:
            return tree
        dims = self.gather_dims
        for key in path:
            dims = dims[key]
        if self.probes is None:
            return jax.tree.map(lambda x, d: self._gather(x, d, None), tree, dims)
        return jax.tree.map(self._gather, tree, dims, self._probes(path))

    def use_layer(self, stack, i: int, *path):
        """Layer `i` of `stack` (a tree of layers stacked on each leaf's leading axis, found
        at `path`), ready to compute with: sliced out, then gathered under FSDP, one layer at
        a time. The layer axis itself is never split over the data axes (`make_layout`)."""
        probes = self.layer_probes(path)
        return self.gather_layer(jax.tree.map(lambda x: x[i], stack), path,
                                 None if probes is None else jax.tree.map(lambda p: p[i], probes))

    def layer_probes(self, path):
        """The probes (stacked like the layers at `path`) of FSDP through error feedback, or None."""
        return None if self.probes is None or self.gather_dims is None else self._probes(path)

    def gather_layer(self, layer, path, probes=None):
        """One layer of the stack at `path` (its leaves without the layer axis) ready to
        compute with, in the policy's compute dtype: under FSDP all-gathered, cast first
        so that the gather moves compute-dtype bytes (after it when error feedback's
        probes take each device's gradient in the parameters' own dtype)."""
        if self.gather_dims is None:
            return self.policy.cast(layer)
        dims = self.gather_dims
        for key in path:
            dims = dims[key]
        assert all(d != 0 for d in jax.tree.leaves(dims)), "FSDP split a layer axis"
        if probes is None:
            return jax.tree.map(lambda x, d: self._gather(x, d - 1 if d > 0 else d, None), self.policy.cast(layer),
                                dims)
        return self.policy.cast(jax.tree.map(lambda x, d, probe: self._gather(x, d - 1 if d > 0 else d, probe),
                                             layer, dims, probes))

    def f(self, x):
        return copy_to_model(x, self.model_axis, self.algorithm)

    def g(self, x):
        return reduce_from_model(x, self.model_axis, self.algorithm)

    def rank(self):
        return lax.axis_index(self.model_axis) if _active(self.model_axis) else 0

    def size(self) -> int:
        """The model axis's size (1 when dense): a dimension split over `model` is its
        global size over this, where the blocks are local."""
        return axis_size(self.model_axis) if _active(self.model_axis) else 1


DENSE = Parallel()


def column_parallel(x_BdxTxD, w_DxFm, b_Fm=None, par: Parallel = DENSE):
    """x @ W[:, cols] (+ b[cols]): W split by columns; the output is this shard's columns."""
    assert x_BdxTxD.shape[-1] == w_DxFm.shape[0] and (b_Fm is None or b_Fm.shape == w_DxFm.shape[1:]), (
        x_BdxTxD.shape, w_DxFm.shape, None if b_Fm is None else b_Fm.shape)  # this device's blocks
    y_BdxTxFm = par.policy.matmul(par.f(x_BdxTxD), w_DxFm)  # fp8 under --dtype fp8
    return y_BdxTxFm if b_Fm is None else y_BdxTxFm + b_Fm


def row_parallel(h_BdxTxFm, w_FmxD, b_D=None, par: Parallel = DENSE):
    """sum over shards of h[:, rows] @ W[rows, :] (+ b): input split, output whole."""
    assert h_BdxTxFm.shape[-1] == w_FmxD.shape[0] and (b_D is None or b_D.shape == w_FmxD.shape[1:]), (
        h_BdxTxFm.shape, w_FmxD.shape, None if b_D is None else b_D.shape)  # this device's blocks
    y_BdxTxD = par.g(par.policy.matmul(h_BdxTxFm, w_FmxD))
    return y_BdxTxD if b_D is None else y_BdxTxD + b_D


def head_parallel_attention(x_BdxTxD, wqkv_Dx3xHmxK, wo_HmxKxD, core, par: Parallel = DENSE):
    """Multi-head attention with this shard's heads: QKV column-parallel, the output
    projection row-parallel (Megatron-LM, figure 3b). `core(q, k, v)` is the per-head
    attention, Bd x T x Hm x K in and out."""
    D = x_BdxTxD.shape[-1]
    assert wqkv_Dx3xHmxK.shape[:2] == (D, 3) and wo_HmxKxD.shape == (*wqkv_Dx3xHmxK.shape[2:], D), (
        x_BdxTxD.shape, wqkv_Dx3xHmxK.shape, wo_HmxKxD.shape)  # this device's heads
    qkv = par.policy.einsum("btd,dihk->ibthk", par.f(x_BdxTxD), wqkv_Dx3xHmxK)
    a_BdxTxHmxK = core(qkv[0], qkv[1], qkv[2])
    return par.g(par.policy.einsum("bthk,hkd->btd", a_BdxTxHmxK, wo_HmxKxD))


def _local_ids(ids, n_local: int, par: Parallel):
    """ids relative to this shard's vocabulary slice, and whether they fall inside it."""
    local = ids - par.rank() * n_local
    inside = (local >= 0) & (local < n_local)
    return jnp.clip(local, 0, n_local - 1), inside


def vocab_parallel_embed(tokens_BdxT, embed_VmxD, par: Parallel = DENSE):
    """Rows of an embedding table split by vocabulary: each shard looks up the tokens it
    owns (zeros elsewhere) and g sums the shards (Megatron-LM, section 3)."""
    assert embed_VmxD.ndim == 2 and jnp.issubdtype(tokens_BdxT.dtype, jnp.integer), (embed_VmxD.shape,
                                                                                      tokens_BdxT.dtype)
    local, inside = _local_ids(tokens_BdxT, embed_VmxD.shape[0], par)
    e_BdxTxD = jnp.where(inside[..., None], embed_VmxD[local], 0)
    return par.g(e_BdxTxD)


def vocab_parallel_nll(logits_BdxTxVm, targets_BdxT, par: Parallel = DENSE):
    """Each target's softmax cross-entropy (-log p), float32 B x T, from logits split by
    vocabulary, without gathering them: log sum_v exp(z_v - m) - (z_target - m), with m the
    global maximum (from the shards' maxima), the sum of exponentials and the target logit
    each assembled by g. The gradient w.r.t. this shard's logits is softmax - onehot on its
    slice. Every model rank holds the same values (a task sums them per sequence: `dpjax.tasks.dpo`)."""
    assert logits_BdxTxVm.shape[:-1] == targets_BdxT.shape, (logits_BdxTxVm.shape, targets_BdxT.shape)
    z_BdxTxVm = logits_BdxTxVm.astype(jnp.float32)
    m_BdxT = lax.stop_gradient(z_BdxTxVm.max(-1))
    if _active(par.model_axis):  # the max of the shards' maxima: an explicit all-gather of Bd x T
        m_BdxT = collectives.all_gather(m_BdxT[None], par.model_axis, algorithm=_gather_algorithm(par)).max(0)
    z_BdxTxVm = z_BdxTxVm - m_BdxT[..., None]
    sumexp_BdxT = par.g(jnp.exp(z_BdxTxVm).sum(-1))
    local, inside = _local_ids(targets_BdxT, z_BdxTxVm.shape[-1], par)
    picked_BdxT = jnp.where(inside, jnp.take_along_axis(z_BdxTxVm, local[..., None], axis=-1)[..., 0], 0.0)
    return jnp.log(sumexp_BdxT) - par.g(picked_BdxT)


def vocab_parallel_cross_entropy(logits_BdxTxVm, targets_BdxT, par: Parallel = DENSE, weights_BdxT=None):
    """Mean softmax cross-entropy of logits split by vocabulary (`vocab_parallel_nll`'s mean).
    weights_BdxT: each target's weight in the mean (`dpjax.tasks.sft`), float32."""
    nll_BdxT = vocab_parallel_nll(logits_BdxTxVm, targets_BdxT, par)
    return nll_BdxT.mean() if weights_BdxT is None else (nll_BdxT * weights_BdxT.astype(jnp.float32)).mean()


def _gather_algorithm(par: Parallel) -> str:
    return par.algorithm if par.algorithm in collectives.ALL_GATHER_ALGORITHMS else "ring"
