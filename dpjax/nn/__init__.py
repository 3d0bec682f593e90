"""Tensor-parallel flax layers: `dpjax.nn.nnx` (NNX modules) and `dpjax.nn.linen` (Linen).

    from dpjax.nn import nnx as pnn          # ColumnParallelLinear, RowParallelLinear,
                                             # VocabParallelEmbed, ParallelSelfAttention
    from dpjax.nn import linen as pnn        # ColumnParallelDense, RowParallelDense, ...

A user's own flax model gets Megatron tensor parallelism over the `model` axis by
swapping its dense layers for these; their parameters carry the sharding that
`dpjax.shard_step` and born-sharded initialisation read.
"""

import importlib


def __getattr__(name: str):
    """`dpjax.nn.nnx` and `dpjax.nn.linen` without their own import (after `import dpjax`):
    flax is loaded when they are first asked for, not by `import dpjax`."""
    if name in ("nnx", "linen"):
        return importlib.import_module(f"dpjax.nn.{name}")
    raise AttributeError(f"module 'dpjax.nn' has no attribute {name!r}")
