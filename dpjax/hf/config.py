"""A Llama's config.json as both transformers lines write it, read into dpjax's LlamaConfig
and written back.

transformers 4.x writes the rotary base and its scaling at the top level (`rope_theta`,
`rope_scaling: {"rope_type": ..., "factor": ...}` or null; older files say `type`); 5.x
writes one `rope_parameters` ({"rope_theta", "rope_type", the scaling's fields}). Every
key either sets a LlamaConfig field (`FIELDS`, the rope keys), must hold the value dpjax
computes (`MUST_BE`: refused otherwise), or is on `NEUTRAL`, the keys that do not change
the numbers (ids, bookkeeping); any other key is refused, so that a field which changes
the numbers is never skipped in silence. An export writes the layout its source had
(5.x's when it had none), so the file never holds both.
"""

from __future__ import annotations

import dataclasses

from dpjax.compute.rope import ROPE_TYPES, RopeScaling
from dpjax.errors import UserError
from dpjax.hf.files import HFError

# dpjax LlamaConfig field <- config.json key (and its default when the file has none)
FIELDS = {"vocab_size": ("vocab_size", None), "d_model": ("hidden_size", None),
          "n_layers": ("num_hidden_layers", None), "n_heads": ("num_attention_heads", None),
          "n_kv_heads": ("num_key_value_heads", None), "d_ff": ("intermediate_size", None),
          "norm_eps": ("rms_norm_eps", 1e-6), "tie_embeddings": ("tie_word_embeddings", False)}
# the rotary keys (either layout); max_position_embeddings: a run's default seq_len and dynamic's n0
ROPE = ("rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings", "partial_rotary_factor")
# keys dpjax reads only to refuse another value than the one it computes (head_dim: checked against D / H)
MUST_BE = {"model_type": "llama", "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
           "attention_dropout": 0.0, "partial_rotary_factor": 1.0}
# keys that do not change the numbers dpjax computes, and why
NEUTRAL = {
    "architectures": "the class transformers builds (model_type names the family)",
    "transformers_version": "the writer's version", "torch_dtype": "the files' dtype (read for export)",
    "dtype": "the files' dtype (read for export)", "_name_or_path": "where it was loaded from",
    "bos_token_id": "token ids: generation reads them", "eos_token_id": "token ids: generation reads them",
    "pad_token_id": "token ids: generation reads them", "initializer_range": "random initialisation only",
    "use_cache": "inference caching", "pretraining_tp": "transformers 4.x splits matmuls into slices (the same sums)",
    "output_attentions": "what transformers returns", "output_hidden_states": "what transformers returns",
    "return_dict": "what transformers returns", "tokenizer_class": "the tokenizer's class",
}
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor"} | {f.name for f in dataclasses.fields(RopeScaling)}


def known_keys() -> set[str]:
    """Every top-level key the reader accounts for (read, checked or neutral)."""
    return {k for k, _ in FIELDS.values()} | set(ROPE) | set(MUST_BE) | {"head_dim"} | set(NEUTRAL)


def config_from_hub(hub: dict, where: str) -> dict:
    """dpjax LlamaConfig fields from a config.json of either layout; a key dpjax does not
    compute, or does not know, is refused in one line naming it."""
    if hub.get("model_type") != "llama":
        raise HFError(f"{where}: model_type {hub.get('model_type')!r}; dpjax imports llama")
    unknown = sorted(set(hub) - known_keys())
    if unknown:
        raise HFError(f"{where}: config.json key(s) {', '.join(unknown)} not known to dpjax (it reads "
                      "every key that changes the numbers; docs/hf.md lists them)")
    problems = [f"{k} {hub[k]!r} (dpjax computes {v!r})" for k, v in MUST_BE.items() if k in hub
                and hub[k] is not None and hub[k] != v]
    if hub.get("head_dim") not in (None, hub["hidden_size"] // hub["num_attention_heads"]):
        problems.append(f"head_dim {hub['head_dim']} other than hidden_size / num_attention_heads")
    if problems:
        raise HFError(f"{where}: dpjax's Llama does not compute {'; '.join(problems)}")
    fields = {ours: hub.get(key, default) for ours, (key, default) in FIELDS.items()}
    fields["n_kv_heads"] = fields["n_kv_heads"] or fields["n_heads"]
    missing = [FIELDS[k][0] for k, v in fields.items() if v is None]
    if missing:
        raise HFError(f"{where}: config.json has no {', '.join(missing)}")
    theta, scaling = rope_from_hub(hub, where)
    return {**fields, "rope_theta": theta, "rope_scaling": scaling}


def rope_from_hub(hub: dict, where: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, the scaling or None) from 5.x's `rope_parameters` or 4.x's top-level
    `rope_theta` and `rope_scaling`; the two layouts disagreeing in one file is refused."""
    new, old = hub.get("rope_parameters"), hub.get("rope_scaling")
    if new is not None and old is not None and _same(new, old) is False:
        raise HFError(f"{where}: rope_parameters {new} and rope_scaling {old} disagree")
    params = dict(new if new is not None else old or {})
    if "rope_theta" in params and "rope_theta" in hub and params["rope_theta"] != hub["rope_theta"]:
        raise HFError(f"{where}: rope_theta {hub['rope_theta']} and rope_parameters' {params['rope_theta']} disagree")
    theta = float(params.pop("rope_theta", hub.get("rope_theta", 10000.0)))
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFError(f"{where}: dpjax's Llama does not compute partial_rotary_factor {params['partial_rotary_factor']}"
                      " (it rotates whole heads)")
    params.pop("partial_rotary_factor", None)
    if kind == "default":
        if params:
            raise HFError(f"{where}: rope type default with {', '.join(sorted(params))}, which dpjax does not compute")
        return theta, None
    if kind not in ROPE_TYPES:
        raise HFError(f"{where}: rope_type {kind!r} is not computed by dpjax; it computes default, "
                      f"{', '.join(ROPE_TYPES)}")
    extra = sorted(set(params) - _ROPE_KEYS)
    if extra:
        raise HFError(f"{where}: rope {kind} parameter(s) {', '.join(extra)} not computed by dpjax")
    need, may = ROPE_TYPES[kind]
    if "original_max_position_embeddings" in need:  # transformers' default: the trained context
        params.setdefault("original_max_position_embeddings", hub.get("max_position_embeddings"))
    if "max_position_embeddings" in need:
        params["max_position_embeddings"] = hub.get("max_position_embeddings")
    if kind == "yarn" and params.get("factor") is None and hub.get("max_position_embeddings") and params.get(
            "original_max_position_embeddings"):  # transformers 5: the ratio of the two contexts
        params["factor"] = hub["max_position_embeddings"] / params["original_max_position_embeddings"]
    try:
        return theta, RopeScaling(type=kind, **{k: v for k, v in params.items() if k in (*need, *may, "factor")
                                                or v is not None})
    except TypeError as e:  # a required argument missing (factor)
        raise HFError(f"{where}: rope {kind} without {str(e).split('argument: ')[-1]}") from None
    except UserError as e:  # RopeScaling's own check: one line, with the folder
        raise HFError(f"{where}: {e}") from None


def _same(a: dict, b: dict) -> bool:
    strip = ("rope_theta",)
    return {k: v for k, v in a.items() if k not in strip} == {k: v for k, v in b.items() if k not in strip}


def config_to_hub(config, dtype: str, base: dict | None = None) -> dict:
    """A config.json for dpjax's Llama `config` in `base`'s layout (the imported file,
    whose other keys, token ids among them, are kept), or 5.x's when there is none.
    The rope keys of `base` are kept as written when they read as `config`'s."""
    base = dict(base or {})
    old = "rope_parameters" not in base and ("rope_theta" in base or "rope_scaling" in base)
    hub = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "attention_bias": False, "mlp_bias": False, **base}
    hub.update({key: getattr(config, ours) for ours, (key, _) in FIELDS.items()})
    hub.update(head_dim=config.d_model // config.n_heads)
    hub["torch_dtype" if "torch_dtype" in base else "dtype"] = dtype
    s = config.rope_scaling
    hub.setdefault("max_position_embeddings", s.max_position_embeddings if s and s.max_position_embeddings
                   else config.seq_len)
    if base and _rope_unchanged(base, config):
        return hub
    scaling = None if s is None else {"rope_type": s.type, **{k: v for k, v in s.fields().items()
                                                               if k != "max_position_embeddings"}}
    for k in ("rope_parameters", "rope_scaling", "rope_theta"):
        hub.pop(k, None)
    if old:
        hub.update(rope_theta=config.rope_theta, rope_scaling=scaling)
    else:
        hub["rope_parameters"] = {"rope_theta": config.rope_theta, **(scaling or {"rope_type": "default"})}
    return hub


def _rope_unchanged(base: dict, config) -> bool:
    try:
        return rope_from_hub(base, "") == (config.rope_theta, config.rope_scaling)
    except HFError:
        return False
