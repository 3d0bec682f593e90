"""The Gemma families: `Gemma2ForCausalLM` and `Gemma3ForCausalLM` (the text model), entries
of `dpjax.hf.family` for `models/gemma.py`.

What is not one key a field, read by `_read` and written back by `_write`:

- the layer kinds: 5.x's `layer_types` (and 4.57's), else `sliding_window_pattern` (older
  Gemma 3 files), else the family's own pattern (older Gemma 2 files alternate); dpjax
  computes "every P-th layer global", so `layer_types` must follow one P
  (`_sliding_window_pattern`, which transformers 5 writes beside `layer_types`, changes
  nothing then);
- the rotary bases: Gemma 2 has one (`rope_parameters` or `rope_theta`, no scaling: its
  rotation is the same in both kinds of layer); Gemma 3 has one per kind, 5.x's
  `rope_parameters: {"sliding_attention": {...}, "full_attention": {...}}` or 4.x's
  `rope_local_base_freq` beside the global `rope_theta` and `rope_scaling` (gemma3-4b's
  linear 8 applies to the global layers only);
- the soft caps (`attn_logit_softcapping`, `final_logit_softcapping`: null is none);
- `tie_word_embeddings` (Gemma ties; false is refused), `hidden_act` beside
  `hidden_activation` in older files, `use_bidirectional_attention` (must be false).
"""

from __future__ import annotations

from dpjax.hf.config import rope_from_hub
from dpjax.hf.family import Family, register
from dpjax.hf.files import HFError

FIELDS = {"vocab_size": ("vocab_size", None), "d_model": ("hidden_size", None),
          "n_layers": ("num_hidden_layers", None), "n_heads": ("num_attention_heads", None),
          "n_kv_heads": ("num_key_value_heads", None), "d_ff": ("intermediate_size", None),
          "norm_eps": ("rms_norm_eps", 1e-6), "head_dim": ("head_dim", None),
          "sliding_window": ("sliding_window", None), "query_pre_attn_scalar": ("query_pre_attn_scalar", None)}
MUST_BE = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "attention_dropout": 0.0}
LAYER = {("attn_norm", "scale_LsxD"): ("input_layernorm.weight",),
         ("attn_post_norm", "scale_LsxD"): ("post_attention_layernorm.weight",),
         ("mlp_norm", "scale_LsxD"): ("pre_feedforward_layernorm.weight",),
         ("mlp_post_norm", "scale_LsxD"): ("post_feedforward_layernorm.weight",),
         ("attn", "wq_LsxDxHmxK"): ("self_attn.q_proj.weight",),
         ("attn", "wkv_LsxDx2xYmxK"): ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         ("attn", "wo_LsxHmxKxD"): ("self_attn.o_proj.weight",),
         ("mlp", "wgate_LsxDxFm"): ("mlp.gate_proj.weight",), ("mlp", "wup_LsxDxFm"): ("mlp.up_proj.weight",),
         ("mlp", "wdown_LsxFmxD"): ("mlp.down_proj.weight",)}
QK_NORMS = {("attn", "qnorm_LsxK"): ("self_attn.q_norm.weight",), ("attn", "knorm_LsxK"): ("self_attn.k_norm.weight",)}
_READS = ("sliding_window_pattern", "_sliding_window_pattern", "rope_local_base_freq", "attn_logit_softcapping",
          "final_logit_softcapping", "tie_word_embeddings", "hidden_act", "use_bidirectional_attention")
_KINDS = ("sliding_attention", "full_attention")


def kinds(pattern: int, n_layers: int) -> list[str]:
    """HuggingFace's `layer_types` of every `pattern`-th layer global."""
    return [_KINDS[(i + 1) % pattern == 0] for i in range(n_layers)]


def _pattern(hub: dict, n_layers: int, default: int, where: str) -> int:
    types = hub.get("layer_types")
    if not types:
        return int(hub.get("sliding_window_pattern") or default)
    if len(types) != n_layers:
        raise HFError(f"{where}: layer_types has {len(types)} entries for {n_layers} layers")
    pattern = types.index("full_attention") + 1 if "full_attention" in types else n_layers + 1
    if kinds(pattern, n_layers) != list(types):
        raise HFError(f"{where}: dpjax's Gemma does not compute layer_types {types} (it computes every P-th layer "
                      "full_attention, the others sliding_attention)")
    return pattern


def _ropes(hub: dict, gemma3: bool, where: str) -> dict:
    """The config's rope fields: the global base and scaling, the local base."""
    nested = hub.get("rope_parameters")
    if gemma3 and isinstance(nested, dict) and set(nested) <= set(_KINDS):
        n = {"max_position_embeddings": hub.get("max_position_embeddings")}
        theta, scaling = rope_from_hub({"rope_parameters": nested.get("full_attention") or {}, **n}, where)
        local, local_scaling = rope_from_hub({"rope_parameters": nested.get("sliding_attention") or {}, **n}, where)
    else:
        theta, scaling = rope_from_hub(hub, where)
        local, local_scaling = (hub.get("rope_local_base_freq", 10000.0) if gemma3 else theta), None
        if scaling is not None and not gemma3:
            raise HFError(f"{where}: dpjax's Gemma 2 does not compute rope scaling {scaling.type} (its local and "
                          "global layers share one rotation there)")
    if local_scaling is not None:
        raise HFError(f"{where}: dpjax's Gemma does not compute rope scaling on the local (sliding) layers")
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": float(local)}


def _read(hub: dict, fields: dict, where: str, gemma3: bool) -> dict:
    problems = []
    if hub.get("tie_word_embeddings", True) is not True:
        problems.append("untied embeddings (tie_word_embeddings false)")
    if hub.get("hidden_act") not in (None, "gelu_pytorch_tanh"):
        problems.append(f"hidden_act {hub['hidden_act']!r}")
    if hub.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention")
    if problems:
        raise HFError(f"{where}: dpjax's Gemma does not compute {'; '.join(problems)}")
    return {**fields, **_ropes(hub, gemma3, where),
            "sliding_window_pattern": _pattern(hub, fields["n_layers"], 6 if gemma3 else 2, where),
            "query_pre_attn_scalar": float(fields["query_pre_attn_scalar"]),
            "attn_softcap": float(hub.get("attn_logit_softcapping") or 0.0),
            "final_softcap": float(hub.get("final_logit_softcapping") or 0.0)}


def _write(config, hub: dict, base: dict, gemma3: bool) -> dict:
    hub = dict(hub)
    hub.update(attn_logit_softcapping=config.attn_softcap or None, final_logit_softcapping=config.final_softcap or None)
    if not base or "layer_types" in base:
        hub["layer_types"] = kinds(config.sliding_window_pattern, config.n_layers)
    if "sliding_window_pattern" in base:
        hub["sliding_window_pattern"] = config.sliding_window_pattern
    if not base:  # a model from scratch: say it ties (4.57 leaves the default out)
        hub["tie_word_embeddings"] = True
    if not gemma3:
        return hub  # one rotation: the common writer's keys
    if base and _ropes(base, True, "") == _ropes({**hub, "rope_local_base_freq": config.rope_local_theta}, True, "") \
            and "rope_parameters" in base:
        hub["rope_parameters"] = base["rope_parameters"]  # the rope keys as they were written
        return hub
    if "rope_theta" in base or "rope_local_base_freq" in base:  # 4.x's layout: the common writer's, and the local base
        return {**hub, "rope_local_base_freq": config.rope_local_theta}
    s = config.rope_scaling
    scaling = {"rope_type": "default"} if s is None else {"rope_type": s.type, **s.fields()}
    hub["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": config.rope_local_theta},
                              "full_attention": {**scaling, "rope_theta": config.rope_theta}}
    return hub


def _family(name: str, architecture: str, model_type: str, gemma3: bool) -> Family:
    return Family(
        name=name, architecture=architecture, model_type=model_type, fields=FIELDS, must_be=MUST_BE,
        layer={**LAYER, **(QK_NORMS if gemma3 else {})}, layer_types=_KINDS, reads=_READS,
        neutral={"cache_implementation": "transformers' cache for generation"},
        read=lambda hub, fields, where: _read(hub, fields, where, gemma3),
        write=lambda config, hub, base: _write(config, hub, base, gemma3))


GEMMA2 = register(_family("gemma2", "Gemma2ForCausalLM", "gemma2", gemma3=False))
GEMMA3 = register(_family("gemma3", "Gemma3ForCausalLM", "gemma3_text", gemma3=True))
