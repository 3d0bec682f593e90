"""Qwen2 / Qwen2.5 and Qwen3 decoders: the Llama with what differs in the attention's projections.

Qwen2 (Yang et al., "Qwen2 technical report", 2024; Qwen2.5 the same architecture) adds
biases to the query, key and value projections (`bq_LsxHmxK`, `bkv_Lsx2xYmxK`: split over
`model` with their heads, replicated with the K/V heads when those are). Qwen3 (Yang et
al., "Qwen3 technical report", 2025) drops the biases, normalises each query and key head
with an RMSNorm of its own width before the rotation (`qnorm_LsxK`, `knorm_LsxK`: one
scale a layer, shared by the heads, as HuggingFace's `Qwen3Attention.q_norm` / `k_norm`),
and sets the heads' width K explicitly (`head_dim`: 128 in every published size, which
need not be d_model / n_heads). Everything else, the stack runner, the compute policy, the
tensor-parallel layers, FSDP, pipelines and the context axis, is the Llama's: each family
overrides `queries` / `keys_values`, the projections before the rotation.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dpjax.compute.tensor_parallel import DENSE, Parallel
from dpjax.errors import UserError
from dpjax.models.llama import Llama, LlamaConfig, rms_norm
from dpjax.models.registry import Entry, register


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    head_dim: int = 16  # K, each head's width, set on its own (the published models: 128)

    @property
    def head_width(self) -> int:
        return self.head_dim

    def check_heads(self) -> None:
        if self.head_dim < 2 or self.head_dim % 2:
            raise UserError(f"Qwen3 head_dim must be even and positive (rotary positions rotate pairs), "
                            f"got {self.head_dim}")


# Named shapes (`--preset`): the Hub's config.json of each (Qwen/Qwen2.5-7B, Qwen/Qwen3-0.6B, Qwen/Qwen3-8B)
QWEN2_PRESETS = {
    "qwen2.5-7b": dict(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, d_ff=18944),
}
QWEN3_PRESETS = {
    "qwen3-0.6b": dict(vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                       d_ff=3072, tie_embeddings=True),
    "qwen3-8b": dict(vocab_size=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                     d_ff=12288),
}
_BKV = "bkv_Lsx2xYmxK"


class Qwen2(Llama):
    """The Llama with biases on q, k and v (zero at initialisation, as transformers')."""

    name = "qwen2"
    SPECS = {**Llama.SPECS, "bq_LsxHmxK": P("stage", "model", None), _BKV: P("stage", None, "model", None)}

    def sharding_table(self, mesh) -> dict:
        """The Llama's; the K/V biases replicated where the K/V heads are."""
        table = super().sharding_table(mesh)
        if table["wkv_LsxDx2xYmxK"] != self.SPECS["wkv_LsxDx2xYmxK"]:
            return {**table, _BKV: P("stage", None, None, None)}
        return table

    def init(self, key):
        c, params = self.config, super().init(key)
        H, Y, K, L = c.n_heads, c.n_kv_heads, c.head_width, c.n_layers
        params["blocks"]["attn"].update(bq_LsxHmxK=jnp.zeros((L, H, K)), bkv_Lsx2xYmxK=jnp.zeros((L, 2, Y, K)))
        return params

    def queries(self, a, h_BdxTxD, par: Parallel = DENSE):
        q_BdxTxHmxK = super().queries(a, h_BdxTxD, par)
        return q_BdxTxHmxK + a["bq_LsxHmxK"].astype(q_BdxTxHmxK.dtype)

    def keys_values(self, a, h_BdxTxD, par: Parallel = DENSE):
        kv_Bdx2xTxYmxK = super().keys_values(a, h_BdxTxD, par)
        return kv_Bdx2xTxYmxK + a[_BKV][:, None].astype(kv_Bdx2xTxYmxK.dtype)  # 2 x 1 x Ym x K over B, T


class Qwen3(Llama):
    """The Llama with an RMSNorm on each query and key head before the rotation, and its own head width."""

    name = "qwen3"
    SPECS = {**Llama.SPECS, "qnorm_LsxK": P("stage", None), "knorm_LsxK": P("stage", None)}

    def init(self, key):
        c, params = self.config, super().init(key)
        params["blocks"]["attn"].update(qnorm_LsxK=jnp.ones((c.n_layers, c.head_width)),
                                        knorm_LsxK=jnp.ones((c.n_layers, c.head_width)))
        return params

    def queries(self, a, h_BdxTxD, par: Parallel = DENSE):
        # The norm's scale is replicated but each rank applies it to its own heads only: f
        # sums the ranks' partial gradients of it (identity forward), as for a split input.
        return rms_norm(super().queries(a, h_BdxTxD, par), par.f(a["qnorm_LsxK"]), self.config.norm_eps)

    def keys_values(self, a, h_BdxTxD, par: Parallel = DENSE):
        kv_Bdx2xTxYmxK = super().keys_values(a, h_BdxTxD, par)
        # Split K/V heads: the scale's gradient summed as the queries'. Replicated ones (every
        # rank computes all Y; `project` sums their cotangents already): taken as it is.
        split = a["wkv_LsxDx2xYmxK"].shape[2] < self.config.n_kv_heads
        scale_K = par.f(a["knorm_LsxK"]) if split else a["knorm_LsxK"]
        k_BdxTxYmxK = rms_norm(kv_Bdx2xTxYmxK[:, 0], scale_K, self.config.norm_eps)
        return jnp.stack([k_BdxTxYmxK, kv_Bdx2xTxYmxK[:, 1]], axis=1)


register(Entry("qwen2", Qwen2, Qwen2Config, presets=QWEN2_PRESETS))
register(Entry("qwen3", Qwen3, Qwen3Config, presets=QWEN3_PRESETS))
