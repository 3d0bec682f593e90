"""Mixtral: a Llama whose every block's MLP is a mixture of SwiGLU experts.

Jiang et al., "Mixtral of experts" (2024): the Llama's blocks (RMSNorm, GQA with rotary
positions) with the feed-forward replaced by E SwiGLU experts and a softmax router that
sends each token to its top k (2 of 8), the k gates renormalised to sum to 1. The
arithmetic follows HuggingFace's `MixtralForCausalLM`: the router's logits, softmax and
top-k in float32, each expert down(silu(gate(h)) * up(h)) (w1, w3, w2 on the Hub).

The mixture is `dpjax.models.moe`'s with SwiGLU experts (`SwiGLUMixture`): dropless by
default (`--moe dropless`, `moe_dropless`: no token dropped, so the logits equal
HuggingFace's at any load), the capacity form one option away. Over an `expert` axis
the experts are split E/n a device like the GPT's; the rest of the block is the Llama's,
tensor-parallel over `model`. `MoEBlocks` is the part a mixture adds to a Llama-like
decoder: Qwen3-MoE (`Qwen3MoeForCausalLM`) is Qwen3's attention plus this, its gates
renormalised only when its config says (`norm_topk_prob`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.sharding import PartitionSpec as P

from dpjax.compute.tensor_parallel import DENSE, Parallel
from dpjax.errors import UserError
from dpjax.models import moe
from dpjax.models.llama import Llama, LlamaConfig, rms_norm
from dpjax.models.qwen import Qwen3, Qwen3Config
from dpjax.models.registry import Entry, register


@dataclass(frozen=True)
class MoEFields:
    """What a mixture adds to a decoder's config (d_ff is each expert's width)."""

    experts: int = 8  # E: every block's MLP a mixture of E SwiGLU experts, split over `expert`
    top_k: int = 2  # experts a token is routed to
    norm_topk_prob: bool = True  # the k gates renormalised to sum to 1 (Mixtral: always; Qwen3-MoE: its config's)
    moe: str = "dropless"  # dropless: no token dropped (HuggingFace's logits); capacity: --capacity-factor's slots
    capacity_factor: float = 1.25  # the capacity form's slots: ceil(F N k / E) of a device's N tokens
    router_aux_weight: float = 0.001  # Switch's balance loss in the loss (the Hub's router_aux_loss_coef)
    router_z_weight: float = 0.0  # the router z-loss (HuggingFace's models have none)

    def check_moe(self, kind: str) -> None:
        if self.moe not in moe.FORMS:
            raise UserError(f"{kind} moe {self.moe!r}: choose one of {', '.join(moe.FORMS)}")
        if not 1 <= self.top_k <= self.experts:
            raise UserError(f"{kind} top_k={self.top_k} must be between 1 and experts={self.experts}")
        if self.capacity_factor <= 0 or min(self.router_aux_weight, self.router_z_weight) < 0:
            raise UserError(f"{kind} capacity_factor must be above 0 and the router weights not negative")


@dataclass(frozen=True)
class MixtralConfig(LlamaConfig, MoEFields):
    d_ff: int = 256  # each expert's SwiGLU width
    rope_theta: float = 1e6

    def __post_init__(self):
        super().__post_init__()
        self.check_moe("Mixtral")


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config, MoEFields):
    """Qwen3's attention (per-head q/k norms, its own head width) and a mixture in every block."""

    d_ff: int = 128  # each expert's SwiGLU width (the Hub's moe_intermediate_size)
    norm_topk_prob: bool = False  # the Hub's default; Qwen3-30B-A3B sets it

    def __post_init__(self):
        super().__post_init__()
        self.check_moe("Qwen3-MoE")


# Named shapes (`--preset`): the published configurations (the Hub's config.json of
# mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B)
PRESETS = {
    "mixtral-8x7b": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                         experts=8, top_k=2, rope_theta=1e6, norm_eps=1e-5),
}
QWEN3_MOE_PRESETS = {
    "qwen3-30b-a3b": dict(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                          d_ff=768, experts=128, top_k=8, norm_topk_prob=True, rope_theta=1e6, norm_eps=1e-6),
}


class SwiGLUMixture(moe.Mixture):
    """The mixture with SwiGLU experts (Mixtral's w1, w3, w2: gate, up, down) and no biases;
    the gates renormalised as the config says (`norm_topk_prob`)."""

    act = "swiglu"
    SPECS = {"router_LsxDxX": P("stage", None, None), "wgate_LsxXexDxF": P("stage", "expert", None, None),
             "wup_LsxXexDxF": P("stage", "expert", None, None), "wdown_LsxXexFxD": P("stage", "expert", None, None)}
    _NAMES = {"router_DxX": "router_LsxDxX", "wgate_XexDxF": "wgate_LsxXexDxF", "wup_XexDxF": "wup_LsxXexDxF",
              "wdown_XexFxD": "wdown_LsxXexFxD"}

    @property
    def normalize(self) -> bool:
        return self.config.norm_topk_prob

    def draw(self, key) -> dict:
        """The stacked leaves, drawn as HuggingFace initialises them (normal, 0.02)."""
        c = self.config
        L, D, F, E = c.n_layers, c.d_model, c.d_ff, c.experts
        k = jax.random.split(key, 4)
        return {"router_LsxDxX": 0.02 * jax.random.normal(k[0], (L, D, E)),
                "wgate_LsxXexDxF": 0.02 * jax.random.normal(k[1], (L, E, D, F)),
                "wup_LsxXexDxF": 0.02 * jax.random.normal(k[2], (L, E, D, F)),
                "wdown_LsxXexFxD": 0.02 * jax.random.normal(k[3], (L, E, F, D))}

    def values(self, tokens: int, split: int) -> dict:
        """The mixture's values (`moe.Mixture.values`) with SwiGLU's extra half counted as
        width (F -> 1.5 F), as the Llama's dense MLP counts it."""
        c = self.config
        factor = 2.0 if c.moe == "dropless" else c.capacity_factor
        return {r: moe.activation_values(tokens, c.d_model, c.d_ff * 3 // 2, c.experts, c.top_k, factor, r)
                for r in ("none", "dots")}

    def matmul_params(self) -> int:
        c = self.config
        return 3 * c.d_model * c.d_ff * c.top_k + c.d_model * c.experts


class MoEBlocks(Llama):
    """What a mixture adds to a Llama-like decoder (listed first among its bases): every
    block's MLP the mixture, whose router statistics the forward carries and the loss adds."""

    def __init__(self, config):
        super().__init__(config)
        self.mixture = SwiGLUMixture(config)

    @property
    def stat_names(self) -> tuple:
        return self.mixture.stat_names

    @property
    def experts(self) -> int:
        return self.config.experts

    def model_splits(self) -> tuple[int, ...]:
        return (self.config.n_heads, self.config.vocab_size)  # experts are whole on a model rank

    def init(self, key):
        params = super().init(key)
        params[self.LAYERS]["mlp"] = self.mixture.draw(jax.random.fold_in(key, 1))
        return params

    def layer(self, blk, x_BdxTxD, par: Parallel = DENSE, segments=None):
        return self.layer_stats(blk, x_BdxTxD, par, segments)[0]

    def layer_stats(self, blk, x_BdxTxD, par: Parallel = DENSE, segments=None):
        """(the block's output, the mixture's balance loss, z loss and share dropped)."""
        x_BdxTxD = self.attend(blk, x_BdxTxD, par, segments)
        y_BdxTxD, stats = self.mixture(blk["mlp"], self._normed(blk, x_BdxTxD), par)
        return x_BdxTxD + y_BdxTxD, stats

    def mlp(self, blk, x_BdxTxD, par: Parallel = DENSE):
        """The mixture's output alone (the KV cache's forward, `dpjax.generate.cache`)."""
        return self.mixture(blk["mlp"], self._normed(blk, x_BdxTxD), par)[0]

    def _normed(self, blk, x_BdxTxD):
        return rms_norm(x_BdxTxD, blk["mlp_norm"]["scale_LsxD"], self.config.norm_eps)

    def add_stats_loss(self, loss, stat_means):
        return self.mixture.add_loss(loss, stat_means)

    def mlp_values(self, tokens: int, split: int) -> dict:
        return self.mixture.values(tokens, split)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x the active matmul parameters (a token's k experts
        and the router) + attention (Kaplan et al. 2020)."""
        c = self.config
        K = c.head_width
        attn = c.d_model * (2 * c.n_heads * K + 2 * c.n_kv_heads * K)
        matmul = c.n_layers * (attn + self.mixture.matmul_params()) + c.vocab_size * c.d_model
        return 6 * matmul + 3 * c.n_layers * 4 * c.seq_len * c.d_model


def moe_specs(base: dict) -> dict:
    """A Llama-like sharding table with its dense MLP's leaves replaced by the mixture's."""
    dense = ("wgate_LsxDxFm", "wup_LsxDxFm", "wdown_LsxFmxD")
    return {**{k: v for k, v in base.items() if k not in dense}, **SwiGLUMixture.SPECS}


class Mixtral(MoEBlocks, Llama):
    """The Llama's blocks with a SwiGLU mixture as their MLP."""

    name = "mixtral"
    SPECS = moe_specs(Llama.SPECS)


class Qwen3Moe(MoEBlocks, Qwen3):
    """Qwen3's blocks (q/k norms before the rotation) with a SwiGLU mixture as their MLP."""

    name = "qwen3_moe"
    SPECS = moe_specs(Qwen3.SPECS)


register(Entry("mixtral", Mixtral, MixtralConfig, presets=PRESETS))
register(Entry("qwen3_moe", Qwen3Moe, Qwen3MoeConfig, presets=QWEN3_MOE_PRESETS))
