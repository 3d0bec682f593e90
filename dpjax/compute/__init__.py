"""How a layer computes: the compute policy (dtypes, remat, attention kernel: `policy`),
attention (`attention`) and its context-parallel forms over the `context` axis (`context`:
ring and all-gather), Megatron's tensor-parallel f / g and parallel layers (`tensor_parallel`),
and the layer stack (`stack`: lax.scan over layers, remat, FSDP's one-layer gather).

Above the collectives, below the models, the flax layers (`dpjax.nn`) and the layout
(`dpjax.sharding`). The package imports nothing itself: `from dpjax.compute import stack`.
"""
