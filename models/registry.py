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
    """Every member dpjax reads of a model, read as a plain attribute (never probed with
    getattr). `models/base.py` gives each a default: `ByteModel` for any model, `Decoder`
    for a stack of layers between an embedding and a head (the GPT, the Llama).

    The attributes are read-only properties here because dpjax only reads them: a model may
    give each as a class attribute or as a property (GPT's `experts` reads its config), and
    a subclass may narrow the type (a Decoder's LAYERS is a str)."""

    @property
    def name(self) -> str:
        """The registered name (`--model`), in messages and the run record."""

    @property
    def config(self) -> Any:
        """Its config dataclass: the options a run may set, with vocab_size and seq_len (each
        model's own class: Any here)."""

    @property
    def SPECS(self) -> dict:
        """Its one sharding table: leaf name -> PartitionSpec over `model` (and `stage`, `expert`)."""

    @property
    def CONTEXT(self) -> bool:
        """Its loss splits each sequence over a context axis (dpjax.compute.context)."""

    @property
    def LAYERS(self) -> str | None:
        """The key of its stacked layers, which a pipeline divides over `stage`; None: no stack."""

    @property
    def has_stats(self) -> bool:
        """`loss_and_stats` gives statistics the train step reports (a mixture's router)."""

    @property
    def experts(self) -> int:
        """E > 0: a mixture of E experts, which an `expert` axis splits."""

    @property
    def head_dim(self) -> int | None:
        """The attention heads' width (the compute policy's kernel choice); None: no attention."""

    @property
    def dropout_rate(self) -> float:
        """> 0: its layers drop values in training at this rate (the step then draws masks)."""

    @property
    def attention_softcap(self) -> float:
        """> 0: its attention scores are soft-capped (the kernel choice: not cuDNN's)."""

    def init(self, key) -> Any:
        """The parameters: a dict of arrays, each leaf named for a SPECS entry."""

    def loss(self, params, batch_BxT1, par=...) -> Any:
        """The mean next-token loss of int32 tokens (B, T+1); `par` names the model axis in a step."""

    def loss_and_stats(self, params, batch_BxT1, par=...) -> tuple[Any, dict | None]:
        """(`loss`, its statistics by name, or None) of one forward."""

    def apply(self, params, tokens_BxT, par=...) -> Any:
        """The full logits, B x T x V (generation, inspection)."""

    def sharding_table(self, mesh) -> dict:
        """The sharding table on `mesh` (SPECS, or another where it depends on the mesh)."""

    def activation_bytes(self, rows: int, *, remat: str, attention: str, width: int, split: int,
                         context: int) -> int:
        """The activations' bytes a device keeps for the backward pass of `rows` sequences."""

    def flops_per_token(self) -> float:
        """Training FLOPs per token (MFU)."""

    def model_splits(self) -> tuple[int, ...]:
        """The sizes a model axis must divide (`dpjax.hf`'s default mesh)."""

    def num_params(self, params) -> int: ...

    def describe(self) -> dict:
        """{'model': name, **config fields}: the run record's, from which a checkpoint rebuilds it."""

    # With LAYERS (a `Decoder`), the pipeline's pieces and the context lines read too:
    # embed(params, tokens, par), layer(blk, x, par), head_loss(params, x, targets, par),
    # kv_heads (the K/V heads a context axis's ring carries), INDEXED_LAYERS (`layer` takes index=: the
    # layer's place in the whole stack, which the stack runner and a pipeline's stages hand it),
    # LORA_LAYERS (its linear layers are the ones `dpjax.models.lora` adapts, `Decoder.LORA_LAYERS`).


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
