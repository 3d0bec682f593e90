"""HuggingFace's Llama names and layouts beside dpjax's: the one table of the conversion.

A Hub checkpoint (`LlamaForCausalLM`) stores PyTorch's `nn.Linear` weights, [out, in],
with the heads flattened into `out` (q_proj: H*K x D). dpjax's Llama keeps [in, out]
with the heads as their own dimension (`wq_LsxDxHmxK`: D x H x K per layer) and K and V
stacked (`wkv_LsxDx2xYmxK`). Both use the rotate-half rotary convention, so no weight
is permuted: every conversion is a transpose and a reshape, exact in any dtype.

`read_layer_block` gives one device's block of a leaf by reading only the rows and
columns of the (memory-mapped) Hub tensors that hold it; `hub_tensors` gives one layer's
Hub tensors from dpjax's leaves for export. config.json's keys are `dpjax.hf.config`'s.
"""

from __future__ import annotations

import numpy as np


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
