"""Models for dpjax, imported as `dpjax.models`.

A model is a `ByteModel` (`base.py`) with `config`, `init(key) -> params`, `loss(params,
batch, par=DENSE)` (`batch`: int32 tokens of shape (B, T+1); the loss predicts tokens[:, 1:]
from tokens[:, :-1]; `par`, a `dpjax.compute.tensor_parallel.Parallel`, names the model axis
inside a sharded step), `SPECS` (its one sharding table: leaf name -> PartitionSpec over
`model`), `flops_per_token()`, `activation_bytes(...)` and its declared capabilities
(`registry.Model` lists every member dpjax reads). A stack of layers between an embedding
and a head is a `Decoder`: a new architecture is a config, a block (`embed`, `layer`,
`head`), a weight init and its SPECS; the loss, the forward over the stack, the pipeline's
pieces, the context split and the memory estimate are the base's. Each model registers
itself at the end of its file (`registry.py`).
"""

from __future__ import annotations

import dataclasses

from dpjax.errors import UserError
from dpjax.models import gemma, gpt, llama, mistral, mixtral, mlp, qwen
from dpjax.models.base import ByteModel, Decoder
from dpjax.models.gpt import GPT, GPTConfig
from dpjax.models.llama import Llama, LlamaConfig
from dpjax.models.mlp import MLP, MLPConfig
from dpjax.models.registry import MODELS, Entry, Model, register, registered, unregister

REGISTERED_BY = (gpt, llama, mistral, gemma, mixtral, mlp, qwen)  # importing a model's module registers it
# Set by the data, not chosen per model; rope scaling comes with a checkpoint or a preset
# (a structure, not one number a flag could give).
_NOT_OPTIONS = ("vocab_size", "seq_len", "rope_scaling")


def model_options() -> dict[str, dict[str, object]]:
    """Each model's settable options and their defaults: {model: {field: default}}."""
    return {name: {f.name: f.default for f in dataclasses.fields(m.config) if f.name not in _NOT_OPTIONS}
            for name, m in MODELS.items()}


def option_types() -> dict[str, type]:
    """Each model option's type, read from the configs (the command line parses with it)."""
    return {k: t for m in MODELS.values() for k, t in m.option_types().items() if k not in _NOT_OPTIONS}


def presets() -> dict[str, tuple[str, dict]]:
    """Every model's named shapes: {preset: (model, {field: value})} (`--preset`)."""
    return {p: (name, fields) for name, m in MODELS.items() for p, fields in m.presets.items()}


def get_model(name: str, **overrides):
    """Builds a model by name; `overrides` set config fields (None: the default). An
    option the model does not have is an error naming the ones it has."""
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    cls, cfg_cls = MODELS[name].build, MODELS[name].config
    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    given = {k: v for k, v in overrides.items() if v is not None}
    wrong = sorted(set(given) - fields)
    if wrong:
        has = ", ".join(model_options()[name])
        raise UserError(f"model {name!r} has no option {', '.join(wrong)}; its options are {has}")
    return cls(cfg_cls(**given))


__all__ = ["ByteModel", "Decoder",
           "GPT", "GPTConfig", "Llama", "LlamaConfig", "MLP", "MLPConfig", "MODELS", "Entry", "Model", "get_model",
           "model_options", "option_types", "presets", "register", "registered", "unregister"]
