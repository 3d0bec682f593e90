"""HuggingFace's Llama names and layouts beside dpjax's: the one table of the conversion.

A Hub checkpoint (`LlamaForCausalLM`) stores PyTorch's `nn.Linear` weights, [out, in],
with the heads flattened into `out` (q_proj: H*K x D). dpjax's Llama keeps [in, out]
with the heads as their own dimension (`wq_LsxDxHmxK`: D x H x K per layer) and K and V
stacked (`wkv_LsxDx2xYmxK`). Both use the rotate-half rotary convention, so no weight
is permuted: every conversion is a transpose and a reshape, exact in any dtype.

`read_block` gives one device's block of a leaf by reading only the rows and columns of
the (memory-mapped) Hub tensors that hold it; `hub_tensors` gives one layer's Hub tensors
from dpjax's leaves for export.
"""

from __future__ import annotations

import numpy as np

from dpjax.hf.files import HFError

# dpjax LlamaConfig field <- config.json key (and its default when the file has none)
CONFIG = {"vocab_size": ("vocab_size", None), "d_model": ("hidden_size", None),
          "n_layers": ("num_hidden_layers", None), "n_heads": ("num_attention_heads", None),
          "n_kv_heads": ("num_key_value_heads", None), "d_ff": ("intermediate_size", None),
          "rope_theta": ("rope_theta", 10000.0), "norm_eps": ("rms_norm_eps", 1e-6),
          "tie_embeddings": ("tie_word_embeddings", False)}


def config_from_hub(hub: dict, where: str) -> dict:
    """dpjax LlamaConfig fields from a config.json; what dpjax's Llama does not compute
    (biases, rope scaling, another activation, a head width other than D/H) is refused."""
    if hub.get("model_type") != "llama":
        raise HFError(f"{where}: model_type {hub.get('model_type')!r}; dpjax imports llama")
    problems = []
    if hub.get("attention_bias") or hub.get("mlp_bias"):
        problems.append("biases in attention or MLP")
    if hub.get("rope_scaling") not in (None, {}) and (hub["rope_scaling"] or {}).get("rope_type") != "default":
        problems.append(f"rope_scaling {hub['rope_scaling']}")
    if hub.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hub['hidden_act']}")
    if hub.get("head_dim") not in (None, hub["hidden_size"] // hub["num_attention_heads"]):
        problems.append(f"head_dim {hub['head_dim']} other than hidden_size / num_attention_heads")
    if problems:
        raise HFError(f"{where}: dpjax's Llama does not compute {'; '.join(problems)}")
    fields = {ours: hub.get(key, default) for ours, (key, default) in CONFIG.items()}
    fields["n_kv_heads"] = fields["n_kv_heads"] or fields["n_heads"]
    missing = [CONFIG[k][0] for k, v in fields.items() if v is None]
    if missing:
        raise HFError(f"{where}: config.json has no {', '.join(missing)}")
    return fields


def config_to_hub(config, dtype: str, base: dict | None = None) -> dict:
    """A config.json for dpjax's Llama `config` (`base`: the imported one, whose other
    keys, token ids among them, are kept)."""
    hub = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "attention_bias": False, "mlp_bias": False, "rope_scaling": None, **(base or {})}
    hub.update({key: getattr(config, ours) for ours, (key, _) in CONFIG.items()})
    hub.update(head_dim=config.d_model // config.n_heads, torch_dtype=dtype)
    hub.setdefault("max_position_embeddings", config.seq_len)
    return hub


def _layer(i: int) -> str:
    return f"model.layers.{i}."


# dpjax leaf (its path) -> Hub names. A stacked leaf's names take the layer number.
OUTER = {("embed_VmxD",): "model.embed_tokens.weight", ("unembed_VmxD",): "lm_head.weight",
         ("norm", "scale_D"): "model.norm.weight"}
LAYER = {("attn_norm", "scale_LsxD"): ("input_layernorm.weight",),
         ("mlp_norm", "scale_LsxD"): ("post_attention_layernorm.weight",),
         ("attn", "wq_LsxDxHmxK"): ("self_attn.q_proj.weight",),
         ("attn", "wkv_LsxDx2xYmxK"): ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         ("attn", "wo_LsxHmxKxD"): ("self_attn.o_proj.weight",),
         ("mlp", "wgate_LsxDxFm"): ("mlp.gate_proj.weight",), ("mlp", "wup_LsxDxFm"): ("mlp.up_proj.weight",),
         ("mlp", "wdown_LsxFmxD"): ("mlp.down_proj.weight",)}


def _heads(s: slice, K: int) -> slice:
    """The rows of a flattened (heads x K) dimension that hold heads s."""
    return slice(s.start * K, s.stop * K)


def read_layer_block(key: tuple, hub: list, idx: tuple, K: int) -> np.ndarray:
    """One layer's block of leaf `key` at `idx` (slices of the leaf's per-layer shape),
    from the memory-mapped Hub tensors `hub`; only the rows and columns inside are read."""
    name = key[-1]
    if name == "scale_LsxD":
        return np.asarray(hub[0][idx[0]])
    if name == "wq_LsxDxHmxK":  # ours[d, h, k] = q[h*K + k, d]
        d, h, k = idx
        return np.asarray(hub[0][_heads(h, K), d]).T.reshape(-1, h.stop - h.start, K)[:, :, k]
    if name == "wkv_LsxDx2xYmxK":  # ours[d, i, y, k] = (k_proj, v_proj)[i][y*K + k, d]
        d, i, y, k = idx
        return np.stack([np.asarray(w[_heads(y, K), d]).T.reshape(-1, y.stop - y.start, K)[:, :, k]
                         for w in hub[i]], axis=1)
    if name == "wo_LsxHmxKxD":  # ours[h, k, d] = o[d, h*K + k]
        h, k, d = idx
        return np.asarray(hub[0][d, _heads(h, K)]).T.reshape(h.stop - h.start, K, -1)[:, k]
    if name in ("wgate_LsxDxFm", "wup_LsxDxFm", "wdown_LsxFmxD"):  # ours = the [out, in] matrix transposed
        a, b = idx
        return np.asarray(hub[0][b, a]).T
    raise AssertionError(f"no Hub layout for {key}")


def hub_tensors(key: tuple, leaf: np.ndarray, i: int | None) -> dict:
    """The Hub tensors of dpjax leaf `key` (one layer of it, layer `i`, for stacked leaves)."""
    if i is None:
        return {OUTER[key]: leaf}
    names, name = [_layer(i) + n for n in LAYER[key]], key[-1]
    if name == "scale_LsxD":
        return {names[0]: leaf}
    if name == "wq_LsxDxHmxK":
        return {names[0]: leaf.reshape(leaf.shape[0], -1).T}
    if name == "wkv_LsxDx2xYmxK":
        return {n: leaf[:, j].reshape(leaf.shape[0], -1).T for j, n in enumerate(names)}
    if name == "wo_LsxHmxKxD":
        return {names[0]: leaf.reshape(-1, leaf.shape[-1]).T}
    return {names[0]: leaf.T}
