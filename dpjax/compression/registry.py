"""Compression methods by name: what a tensor becomes on the wire, and back.

A method is one module that ends with one `register(Method(...))`; the exchange
(`collectives.grouped_allreduce`, and through it `allreduce_gradients`, the update
rules and `DistributedOptimizer`), FSDP's and tensor parallelism's gradient reductions
(`tensor_parallel`), Horovod's `hvd.Compression` and the `--compression` names all
read it from here.

    encode(x) -> wire          what travels (x of any dtype: a method leaves alone the
                               tensors it does not `compress`, such as integers)
    decode(wire, like) -> x    back to `like`'s dtype and shape
    compresses(dtype) -> bool  whether encode changes a tensor of this dtype
    wire_dtype                 the dtype of what travels
    linear                     whether sum(encode(x_i)) decodes to (about) sum(x_i), so an
                               allreduce may sum the encoded values on the wire; a method
                               that is not (sign, top-k, PowerSGD's factors) needs an
                               exchange of its own, and the allreduce refuses it

A method with error feedback (`exchange` given: sign, int8, int4, powersgd, topk, randk)
keeps state between steps and runs its own exchange (`dpjax.compression.feedback` wraps
it with the error buffer, the start step and the state's layout):

    exchange(tree, mstate, axis_name, spec, t, allreduce) -> (mean, residual, mstate)
                               the mean over the axis of what each rank sends for `tree`
                               (already error-corrected), what this rank's error buffer
                               becomes (tree minus what it contributed; for int8 / int4
                               also the error of its requantised ring hops), and the
                               method's own state; t: exchanges so far (randk's seed)
    init(params, spec) -> mstate   the method's own state (PowerSGD's Q), () if none
    state_specs(param_specs, spec) -> the PartitionSpecs of mstate
    wire_bytes(sizes, n, spec, allreduce) -> what the busiest rank sends for tensors of
                               `sizes` (shapes) over n ranks: the formula the compiled
                               program is checked against (`accounting.compressed_bytes`)
    gather                     whether the exchange all-gathers every rank's message
                               (sign, top-k) rather than summing on the ring
    reduce_scatter(rows_IxN, axis_name, spec, key, algorithm) -> (mean_N, resid_IxN)
                               FSDP's reduce-scatter (`dpjax.compression.sharded`) of one
                               tensor's error-corrected local gradient cut into the n
                               destination shards (rows): what every rank sends of row r is
                               summed onto rank r and averaged; resid: what this rank's
                               compression dropped. Only a linear method (random-k: the
                               same indices on every rank) has one
    reduce_scatter_bytes(c, n, spec, algorithm) -> what the busiest rank sends for one
                               tensor of n shards of c values
    nonlinear                  for a stateful method without `reduce_scatter`: why it is not
                               linear (the refusal of FSDP without --workers says it)
    under_adam                 why error feedback through it misbehaves under Adam, measured
                               ("" if it does not): the run's start warning says it
    number                     what N in `name:N` means ("the rank R"), None if it takes none;
                               number_type / number_ok / number_must: its type and bounds
Encode and decode of these methods are one rank's message (for `hvd.Compression` and the
tests); their own exchange, not the allreduce, puts it on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from dpjax.registry import Registry


@dataclass(frozen=True)
class Method:
    """One compression method (see the module docstring for each field)."""

    name: str
    encode: Callable
    decode: Callable
    compresses: Callable
    wire_dtype: Any
    linear: bool
    exchange: Callable | None = None
    init: Callable | None = None
    state_specs: Callable | None = None
    wire_bytes: Callable | None = None
    gather: bool = False
    reduce_scatter: Callable | None = None
    reduce_scatter_bytes: Callable | None = None
    nonlinear: str = ""
    under_adam: str = ""
    number: str | None = None
    number_type: Callable = int
    number_ok: Callable = lambda v: v >= 1
    number_must: str = "at least 1"

    @property
    def stateful(self) -> bool:
        """Whether the method keeps state (error feedback) and runs its own exchange."""
        return self.exchange is not None


NONE = (None, "none")  # the names of no compression: the tensor travels as it is
_METHODS: Registry[Method] = Registry("compression method", reserved=NONE)
register, unregister, registered = _METHODS.register, _METHODS.unregister, _METHODS.registered


def names() -> tuple[str, ...]:
    """Every registered method, in registration order."""
    return tuple(_METHODS)


def get(name: str) -> Method | None:
    """The registered method called exactly `name`, or None."""
    return _METHODS.get(name)


class Compressions(Mapping):
    """{None: None, "none": None, name: Method, ...} read from the registry at every use,
    so a method registered later shows in it (`--compression` names, `Exchange.wire`)."""

    def __getitem__(self, name):
        if name in NONE:
            return None
        return _METHODS[name]

    def __iter__(self):
        return iter((*NONE, *_METHODS))

    def __len__(self) -> int:
        return len(NONE) + len(_METHODS)

    def __repr__(self) -> str:
        return repr(dict(self))
