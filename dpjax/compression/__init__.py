"""Gradient compression on the wire: one module per method, registered by name.

`registry.py` says what a method is; `casts.py` registers "bf16" and "fp16". Pass a
name as `compression=` to `allreduce_gradients`, `DistributedOptimizer`,
`collectives.grouped_allreduce`, `make_update_step`'s exchange or `--compression`;
`COMPRESSIONS` maps every accepted name to its method (None for none).
"""

from dpjax.compression import casts
from dpjax.compression.registry import (NONE, Compressions, Method, check, names, register, registered, summable,
                                        unregister)

REGISTERED_BY = (casts,)  # importing a method's module registers it
COMPRESSIONS = Compressions()

__all__ = ["COMPRESSIONS", "Method", "NONE", "check", "names", "register", "registered", "summable",
           "unregister"]
