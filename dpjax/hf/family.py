"""The architectures dpjax imports from and exports to the Hub: one `Family` entry each.

An entry is small and declarative: what config.json calls it, how its keys read into the
dpjax model's config, which keys it refuses other values of, which keys do not change the
numbers, and its weight map (dpjax leaf <-> Hub tensor names). It ends the family's own
module (`dpjax/hf/llama.py`, `dpjax/hf/qwen.py`, ...) as `register(Family(...))`, and
`dpjax/hf/__init__.py` imports that module. For example Qwen2 (q/k/v biases) is:

    register(Family(
        name="qwen2", architecture="Qwen2ForCausalLM", model_type="qwen2",   # dpjax --model; config.json's
        fields=llama.FIELDS,                       # dpjax config field <- (config.json key, default)
        must_be={"hidden_act": "silu", "use_sliding_window": False},  # other values are refused
        neutral={"max_window_layers": "..."},      # this family's keys that change nothing, and why
        layer={**llama.LAYER, ("attn", "bq_LsxHmxK"): ("self_attn.q_proj.bias",), ...}))

`name` is the registered dpjax model (`dpjax.models`: a config, a block and what differs)
that the entry builds. The keys every family shares (token ids, bookkeeping: `config.NEUTRAL`)
and the rotary keys (`config.ROPE`) are read for all. `dpjax.hf.layouts` converts each
leaf by its name, so a weight map pairs names only. An architecture no entry names is
refused in one line naming it and the supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from dpjax.hf.files import HFError
from dpjax.models import MODELS
from dpjax.registry import Registry

# Outer (not stacked) leaves: the same Hub names for every family here
OUTER = {("embed_VmxD",): "model.embed_tokens.weight", ("unembed_VmxD",): "lm_head.weight",
         ("norm", "scale_D"): "model.norm.weight"}


@dataclass(frozen=True)
class Family:
    """One Hub architecture and the dpjax model it imports into."""

    name: str  # the dpjax model it builds (`--model`, the run record), registered in dpjax.models
    architecture: str  # config.json's `architectures` entry ("LlamaForCausalLM")
    model_type: str  # config.json's `model_type` ("llama")
    fields: dict  # dpjax config field -> (config.json key, its default when absent; None: required)
    must_be: dict  # config.json key -> the one value dpjax computes; another is refused
    layer: dict  # weight map: leaf path under the stack -> its Hub names under model.layers.{i}.
    neutral: dict = field(default_factory=dict)  # this family's keys that do not change the numbers -> why
    layer_types: tuple = ("full_attention",)  # the values `layer_types` (5.x) may hold
    outer: dict = field(default_factory=lambda: dict(OUTER))  # outer leaf path -> Hub name
    # What is not one key a field (a null that means "none", Gemma's layer pattern and rope per
    # layer kind): read(hub, fields, where) -> the config's fields, in place of the rope reading
    # (`config.rope_from_hub`); write(config, hub, base) -> config.json, after the common
    # writing; `reads`: the top-level keys these two read and write
    read: Callable | None = None
    write: Callable | None = None
    reads: tuple = ()
    # a field's 5.x key -> the name transformers 4.x wrote it under (Qwen3-MoE's num_local_experts was
    # num_experts): read when the file has the older name only, and written back under the name it had
    older: dict = field(default_factory=dict)

    def key_in(self, key: str, hub: dict) -> str:
        """Config key `key` as the file `hub` names it: its 4.x name when the file has that one only."""
        old = self.older.get(key)
        return old if old is not None and old in hub and key not in hub else key

    def layer_names(self, key: tuple, i: int, experts: int = 0) -> list[str]:
        """Leaf `key`'s Hub names in layer i; a name with `{e}` stands for one tensor per
        expert, e = 0 .. experts-1 (a mixture's: `dpjax.hf.mixtral`)."""
        return [f"model.layers.{i}." + n.format(e=e) for n in self.layer[key]
                for e in (range(experts) if "{e}" in n else (None,))]


_FAMILIES: Registry[Family] = Registry("HuggingFace architecture")
register, registered = _FAMILIES.register, _FAMILIES.registered
FAMILIES = _FAMILIES  # dpjax model name -> Family, read-only and live


def supported() -> str:
    return ", ".join(f.architecture for f in FAMILIES.values())


def of_hub(hub: dict, where: str) -> Family:
    """The family config.json names (`architectures`, else `model_type`); one that no
    entry names is one line, with the list."""
    archs = hub.get("architectures") or []
    for f in FAMILIES.values():
        if f.architecture in archs or (not archs and hub.get("model_type") == f.model_type):
            if hub.get("model_type") not in (None, f.model_type):
                raise HFError(f"{where}: architectures {archs} with model_type {hub.get('model_type')!r} "
                              f"({f.architecture} is {f.model_type!r})")
            return f
    named = ", ".join(archs) or f"model_type {hub.get('model_type')!r}"
    raise HFError(f"{where}: {named} is not supported by dpjax; it imports {supported()}")


def of_model(name: str) -> Family:
    """The family of dpjax model `name` (export); a model with none is one line."""
    if name not in FAMILIES:
        raise HFError(f"a {name} model has no HuggingFace layout; the export writes {', '.join(FAMILIES)}")
    return FAMILIES[name]


def of_config(config) -> Family:
    """The family whose dpjax model takes `config` (a config dataclass)."""
    for f in FAMILIES.values():
        if MODELS[f.name].config is type(config):
            return f
    raise HFError(f"a {type(config).__name__} has no HuggingFace layout; the export writes {', '.join(FAMILIES)}")
