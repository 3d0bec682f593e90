"""The mixtures of experts (`MixtralForCausalLM`, `Qwen3MoeForCausalLM`): entries of
`dpjax.hf.family` that build dpjax's Mixtral and Qwen3-MoE (`models/mixtral.py`, dropless
by default, so that the logits equal HuggingFace's at any load).

Each expert's three matrices are their own Hub tensors (`{e}` in a name: one per expert,
`Family.layer_names`), each [out, in] like every `nn.Linear`; dpjax stacks them per
layer, E x D x F (`wgate_LsxXexDxF`, split over `expert`). The router (`gate`, E x D)
is dpjax's `router_LsxDxX` transposed.
"""

from __future__ import annotations

from dpjax.hf import llama, qwen
from dpjax.hf.family import Family, register

MIXTURE = {"experts": ("num_local_experts", None), "top_k": ("num_experts_per_tok", None),
           "router_aux_weight": ("router_aux_loss_coef", 0.0)}
NEUTRAL = {"output_router_logits": "whether transformers returns the router's logits and adds the balance loss to "
                                   "its own loss; dpjax's loss adds router_aux_loss_coef x its balance loss"}
_ATTENTION = {k: v for k, v in llama.LAYER.items() if k[0] != "mlp"}  # the Llama's block without its dense MLP

MIXTRAL = register(Family(
    name="mixtral", architecture="MixtralForCausalLM", model_type="mixtral", fields={**llama.FIELDS, **MIXTURE},
    must_be={**llama.MUST_BE, "sliding_window": None, "router_jitter_noise": 0.0}, neutral=NEUTRAL,
    layer={**_ATTENTION, ("mlp", "router_LsxDxX"): ("block_sparse_moe.gate.weight",),
           ("mlp", "wgate_LsxXexDxF"): ("block_sparse_moe.experts.{e}.w1.weight",),
           ("mlp", "wdown_LsxXexFxD"): ("block_sparse_moe.experts.{e}.w2.weight",),
           ("mlp", "wup_LsxXexDxF"): ("block_sparse_moe.experts.{e}.w3.weight",)}))

# Qwen3-MoE: Qwen3's attention; every layer a mixture (decoder_sparse_step 1, no mlp_only_layers), so the
# dense MLP's width (intermediate_size) is never used. transformers 4.x names the experts num_experts.
QWEN3_MOE = register(Family(
    name="qwen3_moe", architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe",
    fields={**qwen.QWEN3.fields, **MIXTURE, "d_ff": ("moe_intermediate_size", None),
            "norm_topk_prob": ("norm_topk_prob", False)},
    must_be={**qwen.QWEN3.must_be, "decoder_sparse_step": 1, "mlp_only_layers": []},
    neutral={**qwen.QWEN3.neutral, **NEUTRAL, "intermediate_size": "the dense MLP's width, for mlp_only_layers and "
             "decoder_sparse_step > 1 (refused: every layer here is a mixture)"},
    layer={**{k: v for k, v in qwen.QWEN3.layer.items() if k[0] != "mlp"},
           ("mlp", "router_LsxDxX"): ("mlp.gate.weight",),
           ("mlp", "wgate_LsxXexDxF"): ("mlp.experts.{e}.gate_proj.weight",),
           ("mlp", "wup_LsxXexDxF"): ("mlp.experts.{e}.up_proj.weight",),
           ("mlp", "wdown_LsxXexFxD"): ("mlp.experts.{e}.down_proj.weight",)},
    older={"num_local_experts": "num_experts"}))
