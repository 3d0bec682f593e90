"""A Llama-family decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

Touvron et al., "LLaMA" (2023) and "Llama 2" (2023); Grattafiori et al., "The Llama 3
herd of models" (2024); grouped-query attention from Ainslie et al., "GQA" (2023).
The arithmetic follows HuggingFace's `LlamaForCausalLM` (rotate-half rotary embeddings,
the RMSNorm's statistics in float32, K/V head y serving query heads y*H/Y .. (y+1)*H/Y-1),
so that a Hub checkpoint imports without permuting a weight (`dpjax.hf`).

The parameter tree is stacked like the GPT's (`blocks`, a leading layer axis L that a
`stage` axis splits), runs in the same stack runner and compute policy, and every matmul
is a tensor-parallel one. Shape letters as in `dpjax/__init__.py`; Y is the K/V heads.
Under tensor parallelism the query heads are split over `model`; the K/V heads too when
there are at least as many as model ranks (Y % n == 0), else they are replicated and each
rank computes all Y and uses the one its query heads share (n % Y == 0). Over a `context`
axis (`dpjax.compute.context`) each device's tokens are rotated by their global positions and the
ring / all-gather carries this rank's K/V heads, which each block repeats to its queries."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dpjax.compute import context, rope
from dpjax.compute import tensor_parallel as tp
from dpjax.errors import UserError
from dpjax.models.base import Decoder, adapted, dense_mlp_values
from dpjax.models.registry import Entry, register
from dpjax.compute.rope import RopeScaling
from dpjax.compute.tensor_parallel import DENSE, Parallel


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4  # grouped-query attention: n_heads / n_kv_heads query heads share one K/V head
    d_ff: int = 384  # SwiGLU width
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # the output head is the embedding table (Llama 3.2 1B / 3B)
    rope_scaling: RopeScaling | None = None  # longer contexts (Llama 3.1 / 3.2: llama3); None: none

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):  # as a run record or a preset writes it (dataclasses.asdict)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
            if getattr(self, name) < 1:
                raise UserError(f"Llama {name} must be positive, got {getattr(self, name)}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise UserError(f"Llama rope_theta and norm_eps must be positive, got {self.rope_theta}, {self.norm_eps}")
        self.check_heads()
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"Llama n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @property
    def head_width(self) -> int:
        """K, each attention head's width: d_model / n_heads (a family may set its own)."""
        return self.d_model // self.n_heads

    def check_heads(self) -> None:
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise UserError(f"Llama d_model={self.d_model} must split into n_heads={self.n_heads} heads of an even "
                            "width (rotary positions rotate pairs)")


# Named shapes (`--preset`): Meta's published configurations (the Hub's config.json). The
# 3.2 1B and 3B stretch their rope for a 128K context (llama3 scaling, factor 32 over the
# 8192 positions trained at); Llama 3 8B has none.
_LLAMA32_ROPE = dict(type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)
PRESETS = {
    "llama3-1b": dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
                      rope_theta=500000.0, tie_embeddings=True, rope_scaling=_LLAMA32_ROPE),
    "llama3-3b": dict(vocab_size=128256, d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8, d_ff=8192,
                      rope_theta=500000.0, tie_embeddings=True, rope_scaling=_LLAMA32_ROPE),
    "llama3-8b": dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                      rope_theta=500000.0),
    # Llama 3.1 8B: Llama 3 8B's shape, its rope stretched for 128K (llama3 scaling, factor 8 over 8192)
    "llama3.1-8b": dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                        rope_theta=500000.0, rope_scaling={**_LLAMA32_ROPE, "factor": 8.0}),
    "llama2-7b": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008,
                      norm_eps=1e-5),
}
PRESETS.update({"llama3.2-1b": PRESETS["llama3-1b"], "llama3.2-3b": PRESETS["llama3-3b"]})  # the Hub's names


def rms_norm(x, scale, eps: float):
    """x / sqrt(mean(x^2) + eps) * scale, the statistics in float32 whatever `x`'s dtype
    (HuggingFace's LlamaRMSNorm); the result in `x`'s dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 / jnp.sqrt((x32 * x32).mean(-1, keepdims=True) + eps)
    return (scale * normed.astype(x.dtype)).astype(x.dtype)


def rope_table(n_positions: int, K: int, theta: float, scaling: RopeScaling | None = None):
    """sin and cos of every position's angles, n_positions x K each (the K/2 frequencies
    twice: the rotate-half layout), times the scaling's attention factor (YaRN's; 1 for the
    others), as HuggingFace scales its cos and sin. Made with numpy (frequencies from
    `dpjax.compute.rope` in float64, angles cast to float32, then sin and cos): a constant
    of the trace. `dynamic` scaling reads n_positions (the run's seq_len)."""
    inv_freq, scale = rope.inverse_frequencies(K, theta, scaling, n_positions)
    freqs = np.einsum("i,j->ij", np.arange(n_positions), inv_freq).astype(np.float32)
    angles = np.concatenate([freqs, freqs], axis=-1)
    return (np.sin(angles) * np.float32(scale)).astype(np.float32), (np.cos(angles) * np.float32(scale)).astype(
        np.float32)


def rotate(x_BxTxHxK, sin_BxTxK, cos_BxTxK):
    """Rotary embedding (Su et al., "RoFormer", 2021) in the rotate-half convention: the
    pairs are (i, i + K/2), not neighbours."""
    half = x_BxTxHxK.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxTxHxK[..., half:], x_BxTxHxK[..., :half]], axis=-1)
    sin, cos = sin_BxTxK[:, :, None].astype(x_BxTxHxK.dtype), cos_BxTxK[:, :, None].astype(x_BxTxHxK.dtype)
    return x_BxTxHxK * cos + rotated * sin



def kv_heads_table(model: Decoder, mesh) -> dict:
    """A grouped-query decoder's SPECS on `mesh` (the Llama's, Gemma's): the K/V heads
    (`wkv_LsxDx2xYmxK`) split over `model` when they divide by it, replicated when fewer
    (each rank then uses the one its query heads share)."""
    n, Y = dict(mesh.shape).get("model", 1), model.config.n_kv_heads
    if Y % n == 0:
        return model.SPECS
    if n % Y:
        raise UserError(f"{model.name} n_kv_heads={Y} and the model axis of {n}: one must divide the other (K/V "
                        "heads split over the model ranks, or each shared by n/Y of them)")
    return {**model.SPECS, "wkv_LsxDx2xYmxK": P("stage", None, None, None, None)}

class Llama(Decoder):
    """Pre-norm decoder blocks (RMSNorm, GQA with rotary positions, SwiGLU), a final
    RMSNorm and an untied (or tied) output head; the loss, the forward over the stack and
    the pipeline's pieces are the `Decoder`'s."""

    name = "llama"
    LORA_LAYERS = True  # PEFT's q_proj .. down_proj, through `adapted` (dpjax.models.lora)
    SPECS = {
        "embed_VmxD": P("model", None), "unembed_VmxD": P("model", None),  # vocabulary-parallel
        "scale_D": P(), "scale_LsxD": P("stage", None),  # the norms
        "wq_LsxDxHmxK": P("stage", None, "model", None),  # query heads split: column-parallel
        "wkv_LsxDx2xYmxK": P("stage", None, None, "model", None),  # K/V heads split (or replicated: sharding_table)
        "wo_LsxHmxKxD": P("stage", "model", None, None),  # row-parallel
        "wgate_LsxDxFm": P("stage", None, "model"), "wup_LsxDxFm": P("stage", None, "model"),  # column-parallel
        "wdown_LsxFmxD": P("stage", "model", None),  # row-parallel
    }

    def sharding_table(self, mesh) -> dict:
        return kv_heads_table(self, mesh)

    @property
    def kv_heads(self) -> int:
        return self.config.n_kv_heads

    @property
    def window(self) -> int | None:
        """The sliding window of every layer's attention (a family's: `dpjax.models.mistral`); None: none."""
        return None

    @property
    def cache_window(self) -> int | None:
        return self.window  # every layer's: the cache keeps that many positions

    @property
    def head_dim(self) -> int:
        return self.config.head_width

    def init(self, key):
        c = self.config
        D, F, H, Y, K, L = c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.head_width, c.n_layers
        std = 0.02  # HuggingFace's initializer_range
        keys = jax.random.split(key, 2 + 6 * L)

        def stacked(j, shape):  # layer i draws from keys[2 + 6i + j], whatever L is split into
            return jnp.stack([std * jax.random.normal(keys[2 + 6 * i + j], shape) for i in range(L)])

        params = {
            "embed_VmxD": std * jax.random.normal(keys[0], (c.vocab_size, D)),
            "blocks": {
                "attn_norm": {"scale_LsxD": jnp.ones((L, D))},
                "attn": {"wq_LsxDxHmxK": stacked(0, (D, H, K)), "wkv_LsxDx2xYmxK": stacked(1, (D, 2, Y, K)),
                         "wo_LsxHmxKxD": stacked(2, (H, K, D))},
                "mlp_norm": {"scale_LsxD": jnp.ones((L, D))},
                "mlp": {"wgate_LsxDxFm": stacked(3, (D, F)), "wup_LsxDxFm": stacked(4, (D, F)),
                        "wdown_LsxFmxD": stacked(5, (F, D))},
            },
            "norm": {"scale_D": jnp.ones((D,))},
        }
        if not c.tie_embeddings:
            params["unembed_VmxD"] = std * jax.random.normal(keys[1], (c.vocab_size, D))
        return params

    def embed(self, params, tokens_BdxT, par: Parallel = DENSE, segments=None):
        """The token embeddings (the first stage's work): Bd x T x D; positions enter in
        each layer's attention (packed rows' too: `segments` is read by `layer`)."""
        c = self.config
        assert params["embed_VmxD"].shape == (c.vocab_size // par.size(), c.d_model), (
            params["embed_VmxD"].shape, par.size())  # this device's block
        return tp.vocab_parallel_embed(tokens_BdxT, par.policy.cast(params["embed_VmxD"]), par)

    def project(self, a, h_BdxTxD, positions_BdxT, par: Parallel = DENSE):
        """This rank's queries (Bd x T x Hm x K) and the K and V heads they read (Bd x T x
        Ym x K: Y/n split heads, or the one replicated head its queries share), rotated
        to `positions_BdxT`."""
        c, n = self.config, par.size()
        H, Y, K = c.n_heads, c.n_kv_heads, c.head_width
        replicated = a["wkv_LsxDx2xYmxK"].shape[2] == Y and n > 1 and Y % n != 0
        assert a["wq_LsxDxHmxK"].shape == (c.d_model, H // n, K) and a["wkv_LsxDx2xYmxK"].shape[:2] == (
            c.d_model, 2), (a["wq_LsxDxHmxK"].shape, a["wkv_LsxDx2xYmxK"].shape, n)  # this device's heads
        hf_BdxTxD = par.f(h_BdxTxD)
        q_BdxTxHmxK = self.queries(a, hf_BdxTxD, par)
        if replicated:  # every rank computes the Y heads; f sums the ranks' partial cotangents of them
            kv_Bdx2xTxYxK = par.f(self.keys_values(a, h_BdxTxD, par))
            kv_Bdx2xTxYmxK = lax.dynamic_slice_in_dim(kv_Bdx2xTxYxK, par.rank() * Y // n, 1, axis=3)
        else:
            kv_Bdx2xTxYmxK = self.keys_values(a, hf_BdxTxD, par)
        sin_TxK, cos_TxK = rope_table(c.seq_len, K, c.rope_theta, c.rope_scaling)
        sin_BdxTxK, cos_BdxTxK = jnp.asarray(sin_TxK)[positions_BdxT], jnp.asarray(cos_TxK)[positions_BdxT]
        q_BdxTxHmxK = rotate(q_BdxTxHmxK, sin_BdxTxK, cos_BdxTxK)
        k_BdxTxYmxK = rotate(kv_Bdx2xTxYmxK[:, 0], sin_BdxTxK, cos_BdxTxK)
        return q_BdxTxHmxK, k_BdxTxYmxK, kv_Bdx2xTxYmxK[:, 1]

    def queries(self, a, h_BdxTxD, par: Parallel = DENSE):
        """The queries of the heads `a` holds, before rotation: Bd x T x Hm x K (a family
        adds what its projection has: Qwen2's biases, Qwen3's per-head norms)."""
        return adapted("q", a, h_BdxTxD, par.policy.einsum("btd,dhk->bthk", h_BdxTxD, a["wq_LsxDxHmxK"]))

    def keys_values(self, a, h_BdxTxD, par: Parallel = DENSE):
        """The keys and values of the heads `a` holds, before rotation: Bd x 2 x T x Y' x K."""
        return adapted("kv", a, h_BdxTxD, par.policy.einsum("btd,diyk->bityk", h_BdxTxD, a["wkv_LsxDx2xYmxK"]))

    def layer(self, blk, x_BdxTxD, par: Parallel = DENSE, segments=None):
        """One block; `blk` is one layer of the stack (its leaves without the leading L).
        Each token is rotated to its position: 0 .. T-1 (with a context axis, the global
        positions of this device's chunks, `context.positions`), or with packed rows
        (`segments`) its position within its own example, whose tokens alone it attends to."""
        x_BdxTxD = self.attend(blk, x_BdxTxD, par, segments)
        return x_BdxTxD + self.mlp(blk, x_BdxTxD, par)

    def attend(self, blk, x_BdxTxD, par: Parallel = DENSE, segments=None):
        """x plus the block's attention (the first half of `layer`; a mixture's block, models/mixtral.py,
        adds its own second half)."""
        a, c = blk["attn"], self.config
        B, T = x_BdxTxD.shape[:2]
        if segments is None:
            positions_BdxT = jnp.broadcast_to(context.positions(T, par), (B, T))
        else:
            positions_BdxT = segments.positions_BxT
        h_BdxTxD = rms_norm(x_BdxTxD, blk["attn_norm"]["scale_LsxD"], c.norm_eps)
        q_BdxTxHmxK, k_BdxTxYmxK, v_BdxTxYmxK = self.project(a, h_BdxTxD, positions_BdxT, par)
        # the Y heads: a context axis's ring carries them, the local kernel and the KV cache repeat them
        o_BdxTxHmxK = self.attention(par, segments)(q_BdxTxHmxK, k_BdxTxYmxK, v_BdxTxYmxK, window=self.window)
        return x_BdxTxD + par.g(self.attn_out(a, o_BdxTxHmxK, par))

    def attn_out(self, a, o_BdxTxHmxK, par: Parallel = DENSE):
        """The output projection of this rank's heads, Bd x T x D: a partial sum (row-parallel:
        the caller's g adds the ranks'). Like `queries`, `keys_values`, `mlp_in` and `mlp_out`,
        the one place a projection is computed: LoRA's dropout adds its adapter's term here
        (`dpjax.models.lora`)."""
        return adapted("o", a, o_BdxTxHmxK, par.policy.einsum("bthk,hkd->btd", o_BdxTxHmxK, a["wo_LsxHmxKxD"]))

    def mlp(self, blk, x_BdxTxD, par: Parallel = DENSE):
        """The SwiGLU feed-forward (Shazeer, "GLU variants improve Transformer", 2020) of
        the normed input: down(silu(gate(h)) * up(h)); one f for both column-parallel halves."""
        m = blk["mlp"]
        hf_BdxTxD = par.f(rms_norm(x_BdxTxD, blk["mlp_norm"]["scale_LsxD"], self.config.norm_eps))
        h_BdxTxFm = jax.nn.silu(self.mlp_in(m, "wgate_LsxDxFm", hf_BdxTxD, par)) * self.mlp_in(
            m, "wup_LsxDxFm", hf_BdxTxD, par)
        return par.g(self.mlp_out(m, h_BdxTxFm, par))

    def mlp_in(self, m, leaf: str, hf_BdxTxD, par: Parallel = DENSE):
        """gate or up (`leaf`), column-parallel: Bd x T x Fm."""
        return adapted(leaf[1:leaf.index("_")], m, hf_BdxTxD, par.policy.matmul(hf_BdxTxD, m[leaf]))  # fp8 too

    def mlp_out(self, m, h_BdxTxFm, par: Parallel = DENSE):
        """down, row-parallel: Bd x T x D, a partial sum (the caller's g adds the ranks')."""
        assert h_BdxTxFm.shape[-1] == m["wdown_LsxFmxD"].shape[0], (h_BdxTxFm.shape, m["wdown_LsxFmxD"].shape)
        return adapted("down", m, h_BdxTxFm, par.policy.matmul(h_BdxTxFm, m["wdown_LsxFmxD"]))

    def head(self, params, x_BdxTxD, par: Parallel = DENSE):
        """Final RMSNorm and the output head: Bd x T x Vm logits in float32."""
        x_BdxTxD = rms_norm(x_BdxTxD, params["norm"]["scale_D"], self.config.norm_eps).astype(jnp.float32)
        unembed_VmxD = params["embed_VmxD" if self.config.tie_embeddings else "unembed_VmxD"]
        return tp.column_parallel(x_BdxTxD, unembed_VmxD.T.astype(jnp.float32), None, par)

    def mlp_values(self, tokens: int, split: int) -> dict:
        """The memory estimate's MLP (`Decoder.activation_bytes`, fitted to the GPT's buffers
        on CPU) with SwiGLU's extra half counted as width (F -> 1.5 F): an estimate the
        planner sizes remat by, not a fit of its own."""
        return dense_mlp_values(self.config.d_ff * 3 // 2 // split)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x matmul parameters + attention (Kaplan et al. 2020)."""
        c = self.config
        K = c.head_width
        attn = c.d_model * (2 * c.n_heads * K + 2 * c.n_kv_heads * K)
        matmul = c.n_layers * (attn + 3 * c.d_model * c.d_ff) + c.vocab_size * c.d_model  # + the output head
        return 6 * matmul + 3 * c.n_layers * 4 * c.seq_len * c.d_model


register(Entry("llama", Llama, LlamaConfig, presets=PRESETS))
