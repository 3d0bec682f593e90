"""The Qwen families: `Qwen2ForCausalLM` (Qwen2 and Qwen2.5: q/k/v biases) and
`Qwen3ForCausalLM` (per-head q/k RMSNorm, an explicit `head_dim`), entries of
`dpjax.hf.family` that extend the Llama's tables with what differs (`models/qwen.py`).

Both configs carry the sliding-window keys of transformers' Qwen2 attention; dpjax
computes full attention in every layer, so `use_sliding_window` must be false (and
`layer_types` all `full_attention`), and then the window's size and the number of layers
it would skip change nothing.
"""

from __future__ import annotations

from dpjax.hf import llama
from dpjax.hf.family import Family, register

_WINDOW = {"sliding_window": "the window's size: read only with use_sliding_window, which must be false",
           "max_window_layers": "the layers a window skips: read only with use_sliding_window, which must be false"}
_MUST_BE = {"hidden_act": "silu", "attention_dropout": 0.0, "use_sliding_window": False}

QWEN2 = register(Family(
    name="qwen2", architecture="Qwen2ForCausalLM", model_type="qwen2", fields=llama.FIELDS, must_be=_MUST_BE,
    neutral=_WINDOW,
    layer={**llama.LAYER, ("attn", "bq_LsxHmxK"): ("self_attn.q_proj.bias",),
           ("attn", "bkv_Lsx2xYmxK"): ("self_attn.k_proj.bias", "self_attn.v_proj.bias")}))

QWEN3 = register(Family(
    name="qwen3", architecture="Qwen3ForCausalLM", model_type="qwen3", fields={**llama.FIELDS, "head_dim": (
        "head_dim", None)}, must_be={**_MUST_BE, "attention_bias": False}, neutral=_WINDOW,
    layer={**llama.LAYER, ("attn", "qnorm_LsxK"): ("self_attn.q_norm.weight",),
           ("attn", "knorm_LsxK"): ("self_attn.k_norm.weight",)}))
