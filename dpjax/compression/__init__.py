"""Gradient compression on the wire: one module per method, registered by name.

`registry.py` says what a method is; `casts.py` registers "bf16" and "fp16"; the methods
with error feedback (`feedback.py`: the error buffer, the start step, their state) are
`sign.py`, `quantise.py` (int8, int4), `powersgd.py`, `topk.py`, `randk.py` and `onebit.py`
(1-bit Adam's sign with worker and server error), each
running its own exchange; `grammar.py` parses `name[:N][,ef=0][,start=S]`. Pass a
name as `compression=` to `allreduce_gradients`, `DistributedOptimizer`,
`collectives.grouped_allreduce`, `make_update_step`'s exchange or `--compression`;
`COMPRESSIONS` maps every accepted name to its method (None for none).

`Exchange` (`exchange.py`) is the gradient exchange the plan builds and every rule calls,
`Form` the form it takes: both are imported from here, `from dpjax.compression import
Exchange` (the `dpjax` face re-exports it as `dpjax.Exchange`).
"""

from dpjax.compression import casts, onebit, powersgd, quantise, randk, sign, topk
from dpjax.compression.grammar import Spec, check, parse, stateful, summable
from dpjax.compression.registry import NONE, Compressions, Method, names, register, registered, unregister
from dpjax.compression.exchange import Exchange, Form  # after the methods: the exchange reads the registry

REGISTERED_BY = (casts, sign, quantise, powersgd, topk, randk, onebit)  # importing a method's module registers it
COMPRESSIONS = Compressions()

__all__ = ["COMPRESSIONS", "Exchange", "Form", "Method", "NONE", "Spec", "check", "parse", "stateful", "names",
           "register", "registered", "summable", "unregister"]
