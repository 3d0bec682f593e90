"""Tensor-parallel flax layers: `dpjax.nn.nnx` (NNX modules) and `dpjax.nn.linen` (Linen).

    from dpjax.nn import nnx as pnn          # ColumnParallelLinear, RowParallelLinear,
                                             # VocabParallelEmbed, ParallelSelfAttention
    from dpjax.nn import linen as pnn        # ColumnParallelDense, RowParallelDense, ...

A user's own flax model gets Megatron tensor parallelism over the `model` axis by
swapping its dense layers for these; their parameters carry the sharding that
`dpjax.shard_step` and born-sharded initialisation read.
"""
