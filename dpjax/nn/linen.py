"""Megatron tensor-parallel layers as flax Linen modules, built on `dpjax.compute.tensor_parallel`.

The Linen twins of `dpjax.nn.nnx` (see there for the layers and Megatron-LM's
references). Linen creates a parameter from a shape the module computes, and refuses a
stored value of another shape, which is why `nn.Dense` cannot take a split kernel. These
modules ask for their local block's shape where their mesh axis is bound (inside
`dpjax.shard_step`) and for the whole shape elsewhere (`model.init`, one device), and
annotate each parameter with `nn.with_partitioning` and the mesh axis that splits it:
`nn.get_partition_spec(variables)` is then the spec tree for `shard_step`'s `in_specs`,
and `jax.jit(model.init, out_shardings=nn.get_sharding(abstract, mesh))` creates the
parameters born sharded. Precision follows flax's `dtype` (compute; None: as the inputs
and weights promote) and `param_dtype` (the stored weights, float32), as in `nn.Dense`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax.numpy as jnp
from flax import linen as nn

from dpjax.compute import tensor_parallel as tp
from dpjax.mesh import MODEL
from dpjax.nn._common import local, parallel
from dpjax.nn.nnx import _cast, causal_attention


class _ParallelDense(nn.Module):
    features: int
    use_bias: bool = True
    axis: str = MODEL
    algorithm: str = "ring"
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def _weights(self, rows: int, cols: int, kernel_axes: tuple):
        kernel = self.param("kernel", nn.with_partitioning(self.kernel_init, kernel_axes), (rows, cols),
                            self.param_dtype)
        bias = self.param("bias", nn.with_partitioning(self.bias_init, kernel_axes[1:]), (cols,),
                          self.param_dtype) if self.use_bias else None
        return _cast(self.dtype, kernel, bias)


class ColumnParallelDense(_ParallelDense):
    """x @ W + b, W split by columns over `axis`; the output stays split."""

    @nn.compact
    def __call__(self, x_BxD):
        Fm = local(self.features, self.axis, "ColumnParallelDense")
        kernel_DxFm, bias_Fm = self._weights(x_BxD.shape[-1], Fm, (None, self.axis))
        (x_BxD,) = _cast(self.dtype, x_BxD)
        return tp.column_parallel(x_BxD, kernel_DxFm, bias_Fm, parallel(self.axis, self.algorithm))


class RowParallelDense(_ParallelDense):
    """x @ W + b, W split by rows over `axis`: the input arrives split, the partial
    outputs are summed (g); the output and the bias are whole."""

    @nn.compact
    def __call__(self, h_BxFm):
        # the input's last dimension is already this device's block of the rows
        kernel_FmxD, bias_D = self._weights(h_BxFm.shape[-1], self.features, (self.axis, None))
        (h_BxFm,) = _cast(self.dtype, h_BxFm)
        return tp.row_parallel(h_BxFm, kernel_FmxD, bias_D, parallel(self.axis, self.algorithm))


class VocabParallelEmbed(nn.Module):
    """An embedding table split by vocabulary rows; `attend` gives vocabulary-split logits."""

    num_embeddings: int
    features: int
    axis: str = MODEL
    algorithm: str = "ring"
    embedding_init: Callable = nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        Vm = local(self.num_embeddings, self.axis, "VocabParallelEmbed")
        self.embedding = self.param("embedding", nn.with_partitioning(self.embedding_init, (self.axis, None)),
                                    (Vm, self.features), self.param_dtype)

    def __call__(self, tokens_BxT):
        (table_VmxD,) = _cast(self.dtype, self.embedding)
        return tp.vocab_parallel_embed(tokens_BxT, table_VmxD, parallel(self.axis, self.algorithm))

    def attend(self, x_BxTxD):
        x_BxTxD, table_VmxD = _cast(self.dtype, x_BxTxD, self.embedding)
        return tp.column_parallel(x_BxTxD, table_VmxD.T, None, parallel(self.axis, self.algorithm))


class ParallelSelfAttention(nn.Module):
    """Self-attention with the heads split over `axis` (QKV column-, output row-parallel)."""

    num_heads: int
    head_dim: int | None = None
    axis: str = MODEL
    algorithm: str = "ring"
    attention: Callable = causal_attention
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_BxTxD):
        D = x_BxTxD.shape[-1]
        K = self.head_dim or D // self.num_heads
        Hm = local(self.num_heads, self.axis, "ParallelSelfAttention heads")
        qkv_Dx3xHmxK = self.param("qkv", nn.with_partitioning(nn.initializers.normal(1 / math.sqrt(D)),
                                                              (None, None, self.axis, None)), (D, 3, Hm, K),
                                  self.param_dtype)
        out_HmxKxD = self.param("out", nn.with_partitioning(nn.initializers.normal(1 / math.sqrt(self.num_heads * K)),
                                                            (self.axis, None, None)), (Hm, K, D), self.param_dtype)
        x_BxTxD, qkv_Dx3xHmxK, out_HmxKxD = _cast(self.dtype, x_BxTxD, qkv_Dx3xHmxK, out_HmxKxD)
        return tp.head_parallel_attention(x_BxTxD, qkv_Dx3xHmxK, out_HmxKxD, self.attention,
                                          parallel(self.axis, self.algorithm))


def cross_entropy(logits_BxTxVm, targets_BxT, *, axis: str = MODEL, algorithm: str = "ring"):
    """Mean softmax cross-entropy of vocabulary-split logits, never gathering them."""
    return tp.vocab_parallel_cross_entropy(logits_BxTxVm, targets_BxT, parallel(axis, algorithm))

