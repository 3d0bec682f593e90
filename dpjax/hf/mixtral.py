"""The mixtures of experts (`MixtralForCausalLM`): entries of `dpjax.hf.family` that
build dpjax's Mixtral (`models/mixtral.py`, dropless by default, so that the logits
equal HuggingFace's at any load).

Each expert's three matrices are their own Hub tensors (`{e}` in a name: one per expert,
`Family.layer_names`), each [out, in] like every `nn.Linear`; dpjax stacks them per
layer, E x D x F (`wgate_LsxXexDxF`, split over `expert`). The router (`gate`, E x D)
is dpjax's `router_LsxDxX` transposed.
"""

from __future__ import annotations

from dpjax.hf import llama
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
