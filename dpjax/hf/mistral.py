"""The Mistral family (`MistralForCausalLM`): the Llama's tables and a sliding window
(`models/mistral.py`).

config.json's `sliding_window` is W (each position attends to the last W) or null (full
attention, Mistral 7B v0.2 onwards); dpjax's config holds 0 for null, and the export
writes null back. A `head_dim` other than hidden_size / num_attention_heads (Mistral Nemo)
is refused, as for the Llama.
"""

from __future__ import annotations

from dpjax.hf import llama
from dpjax.hf.config import rope_from_hub
from dpjax.hf.family import Family, register


def _read(hub: dict, fields: dict, where: str) -> dict:
    theta, scaling = rope_from_hub(hub, where)
    return {**fields, "rope_theta": theta, "rope_scaling": scaling, "sliding_window": hub.get("sliding_window") or 0}


def _write(config, hub: dict, base: dict) -> dict:
    return {**hub, "sliding_window": config.sliding_window or None}


MISTRAL = register(Family(
    name="mistral", architecture="MistralForCausalLM", model_type="mistral", fields=llama.FIELDS,
    must_be={"hidden_act": "silu", "attention_dropout": 0.0}, layer=llama.LAYER,
    read=_read, write=_write, reads=("sliding_window",)))
