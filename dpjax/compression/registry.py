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

Encode and decode are pure: a method that keeps state between steps (error-feedback
residuals, PowerSGD's Q) keeps it outside, in the exchange's per-worker state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Method:
    """One compression method (see the module docstring for each field)."""

    name: str
    encode: Callable
    decode: Callable
    compresses: Callable
    wire_dtype: Any
    linear: bool


_METHODS: dict[str, Method] = {}
NONE = (None, "none")  # the names of no compression: the tensor travels as it is


def register(method: Method) -> Method:
    """Adds `method` under its name (a name is registered once: a second is a bug)."""
    if method.name in _METHODS or method.name in NONE:
        raise ValueError(f"compression method {method.name!r} is registered already")
    _METHODS[method.name] = method
    return method


def unregister(name: str) -> Method:
    """Removes the method `name` and returns it."""
    return _METHODS.pop(name)


@contextlib.contextmanager
def registered(method: Method):
    """`method` registered for the duration of a `with` block (a test's toy method)."""
    register(method)
    try:
        yield method
    finally:
        unregister(method.name)


def names() -> tuple[str, ...]:
    """Every registered method, in registration order."""
    return tuple(_METHODS)


def check(name) -> Method | None:
    """The method `name`, None for no compression (None or "none"); else a one-line ValueError."""
    if name in NONE:
        return None
    if name not in _METHODS:
        choices = ("none", *names())
        raise ValueError(f"unknown compression {name!r}; choose {', '.join(choices[:-1])} or {choices[-1]}")
    return _METHODS[name]


def summable(name) -> Method | None:
    """`check(name)`, for an exchange that sums the encoded values on the wire (an
    allreduce, a reduce-scatter): the method must be linear."""
    method = check(name)
    if method is not None and not method.linear:
        raise ValueError(f"compression {name!r} is not linear: a reduction cannot sum it on the wire")
    return method


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
