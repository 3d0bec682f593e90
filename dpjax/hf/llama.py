"""The Llama family (`LlamaForCausalLM`): the first entry of `dpjax.hf.family`, whose
tables the others extend.

config.json's keys read into dpjax's LlamaConfig (`FIELDS`), the values dpjax computes
(`MUST_BE`) and the weight map (`LAYER`: each stacked leaf beside its Hub names in
`model.layers.{i}.`); `dpjax.hf.layouts` converts each leaf by its name.
"""

from __future__ import annotations

from dpjax.hf.family import Family, register

# dpjax LlamaConfig field <- config.json key (and its default when the file has none)
FIELDS = {"vocab_size": ("vocab_size", None), "d_model": ("hidden_size", None),
          "n_layers": ("num_hidden_layers", None), "n_heads": ("num_attention_heads", None),
          "n_kv_heads": ("num_key_value_heads", None), "d_ff": ("intermediate_size", None),
          "norm_eps": ("rms_norm_eps", 1e-6), "tie_embeddings": ("tie_word_embeddings", False)}
# keys dpjax reads only to refuse another value than the one it computes
MUST_BE = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0}
# dpjax leaf (its path under the stack) -> Hub names
LAYER = {("attn_norm", "scale_LsxD"): ("input_layernorm.weight",),
         ("mlp_norm", "scale_LsxD"): ("post_attention_layernorm.weight",),
         ("attn", "wq_LsxDxHmxK"): ("self_attn.q_proj.weight",),
         ("attn", "wkv_LsxDx2xYmxK"): ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         ("attn", "wo_LsxHmxKxD"): ("self_attn.o_proj.weight",),
         ("mlp", "wgate_LsxDxFm"): ("mlp.gate_proj.weight",), ("mlp", "wup_LsxDxFm"): ("mlp.up_proj.weight",),
         ("mlp", "wdown_LsxFmxD"): ("mlp.down_proj.weight",)}

LLAMA = register(Family(
    name="llama", architecture="LlamaForCausalLM", model_type="llama", fields=FIELDS, must_be=MUST_BE, layer=LAYER,
    neutral={"pretraining_tp": "transformers 4.x splits matmuls into slices (the same sums)"}))
