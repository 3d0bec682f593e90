"""Megatron tensor-parallel layers as flax NNX modules, built on `dpjax.compute.tensor_parallel`
(and `sync_batchnorm`, the synchronised BatchNorm of a whole model, for data parallelism).

Shoeybi et al., "Megatron-LM" (2019), section 3: column- and row-parallel dense layers,
head-parallel self-attention (figure 3b) and the vocabulary-parallel embedding, with
the f / g operators between them. Swapping `nnx.Linear` for these layers gives a user's
own NNX model tensor parallelism over the `model` axis.

Every weight is an `nnx.Param` whose sharding metadata names the mesh axis that splits
it (`out_sharding=(None, "model")`, what `nnx.with_partitioning` writes), so that:

- created inside `jax.jit` under `jax.set_mesh(mesh)`, it is born sharded: flax constrains
  each Variable to its sharding as it is created, and XLA (with JAX's partitionable
  threefry) computes only each device's block; the whole weight never exists;
- `dpjax.shard_step` hands each device its block (it reads the same metadata);
- inside that step a layer computes with its block and dpjax's explicit collectives;
  anywhere else (one device, `nnx.jit`) the same module is the plain dense layer, so a
  model is built once and runs both ways.

Precision follows flax's convention: `param_dtype` (float32 by default) is the dtype the
weights are created and kept in, `dtype` (None: as the inputs and weights promote) the
dtype a layer computes in, its weights and inputs cast to it on use (`dpjax.compute.policy` is the
same rule for dpjax's own models).

Names carry shapes; a dimension split over `model` carries an `m` (`kernel_DxFm`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from dpjax.compute import attention as kernels
from dpjax.compute import tensor_parallel as tp
from dpjax.errors import UserError
from dpjax.nn._common import local, mesh_is_set, parallel
from dpjax.mesh import MODEL

default_init = nnx.initializers.lecun_normal()


def _param(value, sharding):
    """A Param annotated with its sharding; sharded as it is created when a mesh is set."""
    return nnx.Param(value, out_sharding=sharding, eager_sharding=mesh_is_set())


def _cast(dtype, *xs):
    """`xs` in the compute `dtype` (None: as they are, flax's dtype=None), Nones kept."""
    return xs if dtype is None else tuple(None if x is None else jnp.asarray(x, dtype) for x in xs)


class _ParallelLinear(nnx.Module):
    """A kernel (in x out) split over `axis` on dimension `split` and a bias."""

    split: int  # the kernel's dimension split over the axis: 1 columns, 0 rows

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True, axis: str = MODEL,
                 algorithm: str = "ring", kernel_init=default_init, bias_init=nnx.initializers.zeros_init(),
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.in_features, self.out_features, self.axis, self.algorithm = in_features, out_features, axis, algorithm
        self.dtype, self.param_dtype = dtype, param_dtype
        kernel_axes = (None, axis) if self.split == 1 else (axis, None)
        # the keys drawn as nnx.Linear draws them (the kernel's, then the bias's if there is
        # one): a layer swapped for nnx.Linear starts from its values, and so does every
        # layer created after it from the same rngs
        self.kernel = _param(kernel_init(rngs.params(), (in_features, out_features), param_dtype), kernel_axes)
        self.bias = _param(bias_init(rngs.params(), (out_features,), param_dtype), kernel_axes[1:]) if use_bias \
            else nnx.data(None)

    def _weights(self):
        """(kernel, bias or None): this device's blocks in the compute dtype, their shapes checked."""
        shape = [self.in_features, self.out_features]
        shape[self.split] = local(shape[self.split], self.axis, type(self).__name__)
        kernel = self.kernel[...]
        assert kernel.shape == tuple(shape), (kernel.shape, shape)
        return _cast(self.dtype, kernel, None if self.bias is None else self.bias[...])


class ColumnParallelLinear(_ParallelLinear):
    """y = x @ W + b with W (in x out) split by columns over `axis`: each device computes
    its slice of the outputs; the output stays split (feed it to a RowParallelLinear,
    or to `cross_entropy` when the columns are the vocabulary)."""

    split = 1

    def __call__(self, x_BxD):
        kernel_DxFm, bias_Fm = self._weights()
        (x_BxD,) = _cast(self.dtype, x_BxD)
        return tp.column_parallel(x_BxD, kernel_DxFm, bias_Fm, parallel(self.axis, self.algorithm))


class RowParallelLinear(_ParallelLinear):
    """y = x @ W + b with W (in x out) split by rows over `axis`: the input arrives split
    (a ColumnParallelLinear's output), each device multiplies its slice, and the partial
    outputs are summed (Megatron's g); the output and the bias are whole."""

    split = 0

    def __call__(self, h_BxFm):
        kernel_FmxD, bias_D = self._weights()
        (h_BxFm,) = _cast(self.dtype, h_BxFm)
        if h_BxFm.shape[-1] != kernel_FmxD.shape[0]:
            raise UserError(f"RowParallelLinear({self.in_features}, {self.out_features}): its input's last dimension "
                            f"is {h_BxFm.shape[-1]}, not this device's {kernel_FmxD.shape[0]} rows: feed it a "
                            "ColumnParallelLinear's output (split over the same axis), not a whole one")
        return tp.row_parallel(h_BxFm, kernel_FmxD, bias_D, parallel(self.axis, self.algorithm))


class VocabParallelEmbed(nnx.Module):
    """An embedding table (vocabulary x features) split by vocabulary rows: each device
    looks up the tokens it owns and g sums the devices. `attend(x)` gives logits split by
    vocabulary (a tied output layer) for `cross_entropy`."""

    def __init__(self, num_embeddings: int, features: int, *, axis: str = MODEL, algorithm: str = "ring",
                 embedding_init=nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0),
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.num_embeddings, self.features, self.axis, self.algorithm = num_embeddings, features, axis, algorithm
        self.dtype, self.param_dtype = dtype, param_dtype
        self.embedding = _param(embedding_init(rngs.params(), (num_embeddings, features), param_dtype), (axis, None))

    def _table(self):
        table_VmxD = self.embedding[...]
        assert table_VmxD.shape == (local(self.num_embeddings, self.axis, "VocabParallelEmbed"), self.features)
        return _cast(self.dtype, table_VmxD)[0]

    def __call__(self, tokens_BxT):
        return tp.vocab_parallel_embed(tokens_BxT, self._table(), parallel(self.axis, self.algorithm))

    def attend(self, x_BxTxD):
        (x_BxTxD,) = _cast(self.dtype, x_BxTxD)
        return tp.column_parallel(x_BxTxD, self._table().T, None, parallel(self.axis, self.algorithm))


causal_attention = kernels.naive  # the default kernel; dpjax.compute.attention.kernel("xla" | "cudnn") for the others


class ParallelSelfAttention(nnx.Module):
    """Multi-head self-attention with the heads split over `axis`: Q, K and V are
    column-parallel (each device computes its heads), the output projection is
    row-parallel (Megatron-LM, figure 3b). `attention(q, k, v)` works per head on
    B x T x heads x head_dim (default: causal softmax attention, `dpjax.compute.attention.naive`;
    `dpjax.compute.attention.kernel("cudnn")` for cuDNN's flash attention)."""

    def __init__(self, features: int, num_heads: int, *, head_dim: int | None = None, axis: str = MODEL,
                 algorithm: str = "ring", attention=causal_attention, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        K = head_dim or features // num_heads
        self.features, self.num_heads, self.head_dim = features, num_heads, K
        self.axis, self.algorithm = axis, algorithm
        self.attention, self.dtype, self.param_dtype = attention, dtype, param_dtype
        init = nnx.initializers.normal(1 / math.sqrt(features))
        self.qkv = _param(init(rngs.params(), (features, 3, num_heads, K), param_dtype), (None, None, axis, None))
        self.out = _param(nnx.initializers.normal(1 / math.sqrt(num_heads * K))(rngs.params(), (num_heads, K, features),
                                                                                param_dtype), (axis, None, None))

    def __call__(self, x_BxTxD):
        Hm = local(self.num_heads, self.axis, "ParallelSelfAttention heads")
        qkv_Dx3xHmxK, out_HmxKxD = self.qkv[...], self.out[...]
        assert qkv_Dx3xHmxK.shape == (self.features, 3, Hm, self.head_dim), qkv_Dx3xHmxK.shape
        assert out_HmxKxD.shape == (Hm, self.head_dim, self.features), out_HmxKxD.shape
        x_BxTxD, qkv_Dx3xHmxK, out_HmxKxD = _cast(self.dtype, x_BxTxD, qkv_Dx3xHmxK, out_HmxKxD)
        return tp.head_parallel_attention(x_BxTxD, qkv_Dx3xHmxK, out_HmxKxD, self.attention,
                                          parallel(self.axis, self.algorithm))


def cross_entropy(logits_BxTxVm, targets_BxT, *, axis: str = MODEL, algorithm: str = "ring"):
    """Mean softmax cross-entropy of logits split by vocabulary over `axis` (a
    ColumnParallelLinear's or VocabParallelEmbed.attend's output), never gathering them."""
    return tp.vocab_parallel_cross_entropy(logits_BxTxVm, targets_BxT, parallel(axis, algorithm))


def sync_batchnorm(model, axis_name="data"):
    """torch's `SyncBatchNorm.convert_sync_batchnorm` for NNX: every `nnx.BatchNorm` in
    `model` (however deep, however many) averages its batch statistics over `axis_name`,
    so that inside `dpjax.shard_step` each device normalises by the global batch's mean
    and variance (and the running statistics stay one copy), as on one device. Returns
    `model` (changed in place), so it wraps the constructor: one line,
    `model = sync_batchnorm(CNN(rngs=nnx.Rngs(0)))`. `axis_name`: the mesh's data axes,
    ("node", "data") on a node x data x model mesh. Outside shard_step such a BatchNorm
    runs in eval mode only (in training mode it averages over an axis that is not there)."""
    norms = [node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.BatchNorm)]
    for norm in norms:
        norm.axis_name = axis_name
    return model
