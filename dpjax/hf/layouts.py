"""How each dpjax leaf lies in a Hub tensor: the conversion every family's weight map uses.

A Hub checkpoint stores PyTorch's `nn.Linear` weights, [out, in], with the heads
flattened into `out` (q_proj: H*K x D), and biases [out]. dpjax keeps [in, out] with the
heads as their own dimension (`wq_LsxDxHmxK`: D x H x K per layer), K and V stacked
(`wkv_LsxDx2xYmxK`, `bkv_Lsx2xYmxK`). Both use the rotate-half rotary convention, so no
weight is permuted: every conversion is a transpose and a reshape, exact in any dtype.
The layout follows from the leaf's name (its shape letters), so a family's weight map
(`dpjax.hf.family`) only pairs names; a leaf of a new shape adds its case here, in the
three functions below.

`read_layer_block` gives one device's block of a leaf by reading only the rows and
columns of the (memory-mapped) Hub tensors that hold it; `hub_tensors` gives one layer's
Hub tensors from dpjax's leaves for export; `hub_shapes` the shapes a config implies.
"""

from __future__ import annotations

import numpy as np


def _heads(s: slice, K: int) -> slice:
    """The rows of a flattened (heads x K) dimension that hold heads s."""
    return slice(s.start * K, s.stop * K)


def read_layer_block(key: tuple, hub: list, idx: tuple, K: int) -> np.ndarray:
    """One layer's block of leaf `key` at `idx` (slices of the leaf's per-layer shape),
    from the memory-mapped Hub tensors `hub`; only the rows and columns inside are read."""
    name = key[-1]
    if name in ("scale_LsxD", "qnorm_LsxK", "knorm_LsxK"):
        return np.asarray(hub[0][idx[0]])
    if name == "wq_LsxDxHmxK":  # ours[d, h, k] = q[h*K + k, d]
        d, h, k = idx
        return np.asarray(hub[0][_heads(h, K), d]).T.reshape(-1, h.stop - h.start, K)[:, :, k]
    if name == "wkv_LsxDx2xYmxK":  # ours[d, i, y, k] = (k_proj, v_proj)[i][y*K + k, d]
        d, i, y, k = idx
        return np.stack([np.asarray(w[_heads(y, K), d]).T.reshape(-1, y.stop - y.start, K)[:, :, k]
                         for w in hub[i]], axis=1)
    if name == "bq_LsxHmxK":  # ours[h, k] = q_bias[h*K + k]
        h, k = idx
        return np.asarray(hub[0][_heads(h, K)]).reshape(h.stop - h.start, K)[:, k]
    if name == "bkv_Lsx2xYmxK":  # ours[i, y, k] = (k_bias, v_bias)[i][y*K + k]
        i, y, k = idx
        return np.stack([np.asarray(b[_heads(y, K)]).reshape(y.stop - y.start, K)[:, k] for b in hub[i]])
    if name == "wo_LsxHmxKxD":  # ours[h, k, d] = o[d, h*K + k]
        h, k, d = idx
        return np.asarray(hub[0][d, _heads(h, K)]).T.reshape(h.stop - h.start, K, -1)[:, k]
    if name in ("wgate_LsxDxFm", "wup_LsxDxFm", "wdown_LsxFmxD"):  # ours = the [out, in] matrix transposed
        a, b = idx
        return np.asarray(hub[0][b, a]).T
    raise AssertionError(f"no Hub layout for {key}")


def hub_tensors(key: tuple, leaf: np.ndarray, names: list[str]) -> dict:
    """The Hub tensors `names` of one layer of dpjax leaf `key` (or of an outer leaf)."""
    name = key[-1]
    if name == "wq_LsxDxHmxK":
        return {names[0]: leaf.reshape(leaf.shape[0], -1).T}
    if name == "wkv_LsxDx2xYmxK":
        return {n: leaf[:, j].reshape(leaf.shape[0], -1).T for j, n in enumerate(names)}
    if name == "bq_LsxHmxK":
        return {names[0]: leaf.reshape(-1)}
    if name == "bkv_Lsx2xYmxK":
        return {n: leaf[j].reshape(-1) for j, n in enumerate(names)}
    if name == "wo_LsxHmxKxD":
        return {names[0]: leaf.reshape(-1, leaf.shape[-1]).T}
    if name in ("wgate_LsxDxFm", "wup_LsxDxFm", "wdown_LsxFmxD"):
        return {names[0]: leaf.T}
    return {names[0]: leaf}  # norms' scales, the embedding and the output head: as they are


def hub_shapes(key: tuple, c) -> list[tuple]:
    """The Hub shapes of leaf `key`'s tensors (one layer's, for stacked leaves) that the
    dpjax config `c` implies."""
    D, F, V, K = c.d_model, c.d_ff, c.vocab_size, c.head_width
    return {"embed_VmxD": [(V, D)], "unembed_VmxD": [(V, D)], "scale_D": [(D,)], "scale_LsxD": [(D,)],
            "qnorm_LsxK": [(K,)], "knorm_LsxK": [(K,)], "wq_LsxDxHmxK": [(c.n_heads * K, D)],
            "bq_LsxHmxK": [(c.n_heads * K,)],
            "wkv_LsxDx2xYmxK": [(c.n_kv_heads * K, D)] * 2, "bkv_Lsx2xYmxK": [(c.n_kv_heads * K,)] * 2,
            "wo_LsxHmxKxD": [(D, c.n_heads * K)], "wgate_LsxDxFm": [(F, D)], "wup_LsxDxFm": [(F, D)],
            "wdown_LsxFmxD": [(D, F)]}[key[-1]]
