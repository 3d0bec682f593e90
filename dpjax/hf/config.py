"""config.json as both transformers lines write it, read into the dpjax config of its
family (`dpjax.hf.family`) and written back.

transformers 4.x writes the rotary base and its scaling at the top level (`rope_theta`,
`rope_scaling: {"rope_type": ..., "factor": ...}` or null; older files say `type`); 5.x
writes one `rope_parameters` ({"rope_theta", "rope_type", the scaling's fields}). Every
key either sets a config field (the family's `fields`, the rope keys), must hold the value
dpjax computes (the family's `must_be`, `COMMON_MUST_BE`: refused otherwise), or is on
`NEUTRAL` or the family's `neutral`, the keys that do not change the numbers (ids,
bookkeeping); any other key is refused, so that a field which changes the numbers is
never skipped in silence. An export writes the layout its source had (5.x's when it had
none), so the file never holds both.
"""

from __future__ import annotations

import dataclasses

from dpjax.compute.rope import ROPE_TYPES, RopeScaling
from dpjax.errors import UserError
from dpjax.hf.family import FAMILIES, Family, of_config, of_hub
from dpjax.hf.files import HFError

# the rotary keys (either layout); max_position_embeddings: a run's default seq_len and dynamic's n0
ROPE = ("rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings", "partial_rotary_factor")
# keys every family reads only to refuse another value than the one dpjax computes
COMMON_MUST_BE = {"partial_rotary_factor": 1.0}
# keys that do not change the numbers dpjax computes, for every family, and why
NEUTRAL = {
    "architectures": "the class transformers builds (the family's name)", "model_type": "the family's name",
    "transformers_version": "the writer's version", "torch_dtype": "the files' dtype (read for export)",
    "dtype": "the files' dtype (read for export)", "_name_or_path": "where it was loaded from",
    "bos_token_id": "token ids: generation reads them", "eos_token_id": "token ids: generation reads them",
    "pad_token_id": "token ids: generation reads them", "initializer_range": "random initialisation only",
    "use_cache": "inference caching", "output_attentions": "what transformers returns",
    "output_hidden_states": "what transformers returns", "return_dict": "what transformers returns",
    "tokenizer_class": "the tokenizer's class",
}
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor"} | {f.name for f in dataclasses.fields(RopeScaling)}


def known_keys(family: Family | None = None) -> set[str]:
    """Every top-level key the reader accounts for (read, checked or neutral) in `family`'s
    config.json (default: the Llama's)."""
    f = family or FAMILIES["llama"]
    return ({k for k, _ in f.fields.values()} | set(ROPE) | set(COMMON_MUST_BE) | set(f.must_be) | {"head_dim"}
            | {"layer_types"} | set(NEUTRAL) | set(f.neutral) | set(f.reads) | set(f.older.values()))


def config_from_hub(hub: dict, where: str) -> dict:
    """The dpjax config fields of the family config.json names, from either layout; a key
    dpjax does not compute, or does not know, is refused in one line naming it."""
    f = of_hub(hub, where)
    unknown = sorted(set(hub) - known_keys(f))
    if unknown:
        raise HFError(f"{where}: config.json key(s) {', '.join(unknown)} not known to dpjax's {f.architecture} (it "
                      "reads every key that changes the numbers; docs/hf.md lists them)")
    must_be = {**COMMON_MUST_BE, **f.must_be}
    problems = [f"{k} {hub[k]!r} (dpjax computes {v!r})" for k, v in must_be.items() if k in hub
                and hub[k] is not None and hub[k] != v]
    if "head_dim" not in {k for k, _ in f.fields.values()} and hub.get("head_dim") not in (
            None, hub["hidden_size"] // hub["num_attention_heads"]):
        problems.append(f"head_dim {hub['head_dim']} other than hidden_size / num_attention_heads")
    problems += [f"{new} {hub[new]!r} beside {old} {hub[old]!r}" for new, old in f.older.items()
                 if new in hub and old in hub and hub[new] != hub[old]]  # one value, under either name
    other = sorted(set(hub.get("layer_types") or ()) - set(f.layer_types))
    if other:
        problems.append(f"layer_types {', '.join(other)} (dpjax computes {', '.join(f.layer_types)})")
    if problems:
        raise HFError(f"{where}: dpjax's {f.architecture} does not compute {'; '.join(problems)}")
    fields = {ours: hub.get(f.key_in(key, hub), default) for ours, (key, default) in f.fields.items()}
    fields["n_kv_heads"] = fields["n_kv_heads"] or fields["n_heads"]
    missing = [f.fields[k][0] for k, v in fields.items() if v is None]
    if missing:
        raise HFError(f"{where}: config.json has no {', '.join(missing)}")
    if f.read is not None:
        return f.read(hub, fields, where)
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
        raise HFError(f"{where}: dpjax does not compute partial_rotary_factor {params['partial_rotary_factor']}"
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
    """A config.json for the dpjax `config` (of a family's model) in `base`'s layout (the
    imported file, whose other keys, token ids among them, are kept), or 5.x's when there
    is none. The rope keys of `base` are kept as written when they read as `config`'s."""
    base, f = dict(base or {}), of_config(config)
    old = "rope_parameters" not in base and ("rope_theta" in base or "rope_scaling" in base)
    hub = {"architectures": [f.architecture], "model_type": f.model_type, **f.must_be, **base}
    hub.update({f.key_in(key, base): getattr(config, ours) for ours, (key, _) in f.fields.items()})
    hub.update(head_dim=config.head_width)
    hub["torch_dtype" if "torch_dtype" in base else "dtype"] = dtype
    s = config.rope_scaling
    hub.setdefault("max_position_embeddings", s.max_position_embeddings if s and s.max_position_embeddings
                   else config.seq_len)
    hub = _rope_keys(hub, config, base, old)
    return hub if f.write is None else f.write(config, hub, base)  # what is not one key a field


def _rope_keys(hub: dict, config, base: dict, old: bool) -> dict:
    """`hub` with `config`'s rope keys: `base`'s when they read as `config`'s, else written
    in `base`'s layout (`old`: 4.x's)."""
    s = config.rope_scaling
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
