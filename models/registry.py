"""The models by name: one registration per model, at the end of its own file.

A model file ends with `register(Entry("name", ModelClass, ConfigClass))`; `--model`'s
choices, its options on the command line (each with the type its config field has), the
plan and `get_model` read them from here, so no list of model names is kept anywhere else.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Protocol

from dpjax.registry import Registry


class Model(Protocol):
    """What dpjax reads from a model (see `dpjax.models`)."""

    config: Any  # its config dataclass: the options a run may set, besides vocab_size and seq_len
    SPECS: dict  # its one sharding table: leaf name -> PartitionSpec over `model`

    def init(self, key) -> Any: ...

    def loss(self, params, batch_BxT1, par=...) -> Any: ...

    def flops_per_token(self) -> float: ...


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered model: its name, the class (called with a config, giving a `Model`),
    its config dataclass and its named shapes."""

    name: str
    build: Callable[[Any], Model]
    config: type
    presets: dict = dataclasses.field(default_factory=dict)  # named shapes (`--preset`): {name: {field: value}}

    def option_types(self) -> dict[str, type]:
        """Each config field's type (the command line parses an option with it)."""
        hints = typing.get_type_hints(self.config)
        return {f.name: hints[f.name] for f in dataclasses.fields(self.config)}


_MODELS: Registry[Entry] = Registry("model")
register, unregister, registered = _MODELS.register, _MODELS.unregister, _MODELS.registered
MODELS = _MODELS  # name -> Entry, a read-only view, live: a model registered later shows in it
