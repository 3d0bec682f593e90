"""Gemma 2 and Gemma 3 (text): a decoder of alternating local and global attention layers.

Gemma Team, "Gemma 2: improving open language models at a practical size" (2024) and
"Gemma 3 technical report" (2025). What differs from the Llama (`dpjax.models.llama`),
each as HuggingFace's `Gemma2ForCausalLM` / `Gemma3ForCausalLM` computes it, so that a Hub
checkpoint imports without changing a weight (`dpjax.hf`):

- RMSNorm with (1 + w) as its scale, the product taken in float32 and then cast (`norm`);
  a norm before and after both the attention and the MLP (four a layer), the outputs'
  norms applied to the summed (row-parallel) result before the residual add;
- the embeddings scaled by sqrt(d) in the compute dtype (sqrt(d) rounded to it first, as
  HuggingFace's `normalizer`), the output head tied to them;
- GeGLU with tanh-GELU: down(gelu_tanh(gate(h)) * up(h)) (Shazeer 2020);
- the scores q.k / sqrt(query_pre_attn_scalar), not / sqrt(head_dim) (queries are scaled
  by sqrt(K / query_pre_attn_scalar) before the kernel's own 1/sqrt(K)); head_dim explicit;
- Gemma 2: scores and final logits soft-capped, cap * tanh(z / cap)
  (`dpjax.compute.attention`'s `softcap`); Gemma 3: RMSNorm of each query and key head
  before the rotation (`qk_norm`);
- every `sliding_window_pattern`-th layer global (full causal attention, rotary base
  `rope_theta` and the checkpoint's `rope_scaling`), the others local (a sliding window of
  `sliding_window` positions, base `rope_local_theta`): Gemma 2 alternates (pattern 2),
  Gemma 3 has five local layers to a global one (pattern 6).

Local and global layers share one parameter tree and one stack (`blocks`, a leading layer
axis L, scanned by `dpjax.compute.stack` and split over `stage` by a pipeline). A layer's
kind is not a parameter: it is a static table of the config (`local_layers`), which each
layer reads at its global index, handed to it by the stack runner (`index=`; a pipeline's
stages hand theirs, `dpjax.pipeline.staged`). The index is traced inside the scan, so the
layer picks its rotary tables with `jnp.where` and its attention with `lax.cond` between
the windowed and the full form (each with a static window: the kernels' masks are static);
one branch runs. A stored leaf was the other choice, but an optimizer would train it
(weight decay moves every leaf). Decoding with the KV cache (`dpjax.generate.cache`, which
hands the index too) needs no branch: the cache's mask takes the window traced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dpjax.compute import attention, context
from dpjax.compute import tensor_parallel as tp
from dpjax.compute.rope import RopeScaling
from dpjax.compute.tensor_parallel import DENSE, Parallel
from dpjax.errors import UserError
from dpjax.models.base import Decoder, Decoding, adapted, dense_mlp_values
from dpjax.models.llama import kv_heads_table, rope_table, rotate
from dpjax.models.registry import Entry, register


@dataclass(frozen=True)
class GemmaConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention, as the Llama's
    head_dim: int = 32  # explicit: Gemma's heads are wider than d_model / n_heads
    d_ff: int = 256  # GeGLU width
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # the global layers' rotary base (Gemma 3: 1e6)
    rope_local_theta: float = 10000.0  # the local layers' (HF: rope_local_base_freq / sliding_attention's)
    sliding_window: int = 32  # a local layer's query sees the last W positions (itself included)
    sliding_window_pattern: int = 2  # layer i is global when (i + 1) % P == 0, else local; 1: all global
    query_pre_attn_scalar: float = 32.0  # the scores are q.k / sqrt(this)
    attn_softcap: float = 0.0  # Gemma 2 (50): scores soft-capped, cap * tanh(s / cap); 0: none
    final_softcap: float = 0.0  # Gemma 2 (30): the logits soft-capped; 0: none
    rope_scaling: RopeScaling | None = None  # the global layers' (gemma3-4b: linear, 8); None: none

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):  # as a run record or a preset writes it (dataclasses.asdict)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                     "sliding_window", "sliding_window_pattern"):
            if getattr(self, name) < 1:
                raise UserError(f"Gemma {name} must be positive, got {getattr(self, name)}")
        for name in ("norm_eps", "rope_theta", "rope_local_theta", "query_pre_attn_scalar"):
            if getattr(self, name) <= 0:
                raise UserError(f"Gemma {name} must be positive, got {getattr(self, name)}")
        if self.attn_softcap < 0 or self.final_softcap < 0:
            raise UserError(f"Gemma soft caps must be 0 (none) or positive, got {self.attn_softcap}, "
                            f"{self.final_softcap}")
        if self.head_dim % 2:
            raise UserError(f"Gemma head_dim={self.head_dim} must be even (rotary positions rotate pairs)")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"Gemma n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    qk_norm = False  # Gemma 3's RMSNorm of each query and key head: the family's, not an option
    tie_embeddings = True  # the output head is the embedding table, always

    @property
    def head_width(self) -> int:
        """K (`dpjax.hf`'s name for it): the explicit head_dim."""
        return self.head_dim

    def local_layers(self) -> np.ndarray:
        """Which layers are local (sliding window), L booleans: HuggingFace's `layer_types`."""
        return np.array([(i + 1) % self.sliding_window_pattern != 0 for i in range(self.n_layers)])


@dataclass(frozen=True)
class Gemma2Config(GemmaConfig):
    """Gemma 2: local and global layers alternate, one rotary base."""


@dataclass(frozen=True)
class Gemma3Config(GemmaConfig):
    """Gemma 3: five local layers to a global one, q/k norms, a global base of 1e6."""

    rope_theta: float = 1000000.0
    sliding_window_pattern: int = 6
    qk_norm = True


# Google's published shapes (the Hub's config.json; Gemma 3 4B's text model).
GEMMA2_PRESETS = {
    "gemma2-2b": dict(vocab_size=256000, d_model=2304, n_layers=26, n_heads=8, n_kv_heads=4, head_dim=256,
                      d_ff=9216, sliding_window=4096, sliding_window_pattern=2, query_pre_attn_scalar=256.0,
                      attn_softcap=50.0, final_softcap=30.0),
}
GEMMA3_PRESETS = {
    "gemma3-1b": dict(vocab_size=262144, d_model=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256,
                      d_ff=6912, sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256.0,
                      rope_theta=1000000.0),
    "gemma3-4b": dict(vocab_size=262208, d_model=2560, n_layers=34, n_heads=8, n_kv_heads=4, head_dim=256,
                      d_ff=10240, sliding_window=1024, sliding_window_pattern=6, query_pre_attn_scalar=256.0,
                      rope_theta=1000000.0, rope_scaling=dict(type="linear", factor=8.0)),
}


def norm(x, w, eps: float):
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + w), all in float32, then cast to
    x's dtype (HuggingFace's Gemma2RMSNorm / Gemma3RMSNorm; the Llama's casts before the
    product)."""
    x32 = x.astype(jnp.float32)
    normed = x32 / jnp.sqrt((x32 * x32).mean(-1, keepdims=True) + eps)
    return (normed * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


class Gemma(Decoder):
    """Gemma 2 / Gemma 3 text decoder blocks (see the module docstring); the loss, the
    forward over the stack and the pipeline's pieces are the `Decoder`'s."""

    name = "gemma"  # abstract: Gemma2 and Gemma3 register
    LORA_LAYERS = True  # PEFT's q_proj .. down_proj, through `adapted` (dpjax.models.lora)
    INDEXED_LAYERS = True  # local and global layers: `layer` reads its global index (module docstring)
    SPECS = {
        "embed_VmxD": P("model", None),  # vocabulary-parallel, and the tied output head
        "scale_D": P(), "scale_LsxD": P("stage", None),  # the norms
        "qnorm_LsxK": P("stage", None), "knorm_LsxK": P("stage", None),  # Gemma 3's q/k norms
        "wq_LsxDxHmxK": P("stage", None, "model", None),  # query heads split: column-parallel
        "wkv_LsxDx2xYmxK": P("stage", None, None, "model", None),  # K/V heads split (or replicated: sharding_table)
        "wo_LsxHmxKxD": P("stage", "model", None, None),  # row-parallel
        "wgate_LsxDxFm": P("stage", None, "model"), "wup_LsxDxFm": P("stage", None, "model"),  # column-parallel
        "wdown_LsxFmxD": P("stage", "model", None),  # row-parallel
    }

    def sharding_table(self, mesh) -> dict:
        """The Llama's rule: K/V heads split over `model` when they divide by it, else replicated."""
        return kv_heads_table(self, mesh)

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def kv_heads(self) -> int:
        return self.config.n_kv_heads

    @property
    def attention_softcap(self) -> float:
        return self.config.attn_softcap

    def init(self, key):
        c = self.config
        D, F, H, Y, K, L = c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.head_dim, c.n_layers
        std = 0.02  # HuggingFace's initializer_range
        keys = jax.random.split(key, 1 + 6 * L)

        def stacked(j, shape):  # layer i draws from keys[1 + 6i + j], whatever L is split into
            return jnp.stack([std * jax.random.normal(keys[1 + 6 * i + j], shape) for i in range(L)])

        zeros = {"scale_LsxD": jnp.zeros((L, D))}  # (1 + w): w = 0 is the identity scale
        attn = {"wq_LsxDxHmxK": stacked(0, (D, H, K)), "wkv_LsxDx2xYmxK": stacked(1, (D, 2, Y, K)),
                "wo_LsxHmxKxD": stacked(2, (H, K, D))}
        if c.qk_norm:
            attn.update(qnorm_LsxK=jnp.zeros((L, K)), knorm_LsxK=jnp.zeros((L, K)))
        return {
            "embed_VmxD": std * jax.random.normal(keys[0], (c.vocab_size, D)),
            "blocks": {"attn_norm": dict(zeros), "attn": attn, "attn_post_norm": dict(zeros),
                       "mlp_norm": dict(zeros), "mlp_post_norm": dict(zeros),
                       "mlp": {"wgate_LsxDxFm": stacked(3, (D, F)), "wup_LsxDxFm": stacked(4, (D, F)),
                               "wdown_LsxFmxD": stacked(5, (F, D))}},
            "norm": {"scale_D": jnp.zeros((D,))},
        }

    def embed(self, params, tokens_BdxT, par: Parallel = DENSE, segments=None):
        """The token embeddings times sqrt(d), in the compute dtype (the first stage's work)."""
        c = self.config
        assert params["embed_VmxD"].shape == (c.vocab_size // par.size(), c.d_model), (
            params["embed_VmxD"].shape, par.size())  # this device's block
        e_BdxTxD = tp.vocab_parallel_embed(tokens_BdxT, par.policy.cast(params["embed_VmxD"]), par)
        return e_BdxTxD * jnp.asarray(math.sqrt(c.d_model), e_BdxTxD.dtype)

    def _rope(self, positions_BdxT, local):
        """sin, cos (Bd x T x K) of the layer's kind: the local base, or the global base
        with the checkpoint's scaling; `local` is traced (the layer's index is)."""
        c = self.config
        tables = [rope_table(c.seq_len, c.head_dim, c.rope_theta, c.rope_scaling),
                  rope_table(c.seq_len, c.head_dim, c.rope_local_theta)]
        (sg, cg), (sl, cl) = [(jnp.asarray(s)[positions_BdxT], jnp.asarray(co)[positions_BdxT]) for s, co in tables]
        return jnp.where(local, sl, sg), jnp.where(local, cl, cg)

    def project(self, a, h_BdxTxD, positions_BdxT, local, par: Parallel = DENSE):
        """This rank's queries (Bd x T x Hm x K, scaled for query_pre_attn_scalar) and the K
        and V heads they read (the Llama's split or replicated K/V heads), q/k-normed
        (Gemma 3) and rotated with the layer kind's tables."""
        c, n = self.config, par.size()
        H, Y, K = c.n_heads, c.n_kv_heads, c.head_dim
        replicated = a["wkv_LsxDx2xYmxK"].shape[2] == Y and n > 1 and Y % n != 0
        assert a["wq_LsxDxHmxK"].shape == (c.d_model, H // n, K), (a["wq_LsxDxHmxK"].shape, n)  # this device's
        hf_BdxTxD = par.f(h_BdxTxD)
        q_BdxTxHmxK = adapted("q", a, hf_BdxTxD, par.policy.einsum("btd,dhk->bthk", hf_BdxTxD, a["wq_LsxDxHmxK"]))

        def kv(h_BdxTxD):  # the projection (and its LoRA term: `adapted`) before the norms
            return adapted("kv", a, h_BdxTxD, par.policy.einsum("btd,diyk->bityk", h_BdxTxD, a["wkv_LsxDx2xYmxK"]))
        if replicated:  # every rank computes the Y heads; f sums the ranks' partial cotangents of them
            kv_Bdx2xTxYmxK = lax.dynamic_slice_in_dim(par.f(kv(h_BdxTxD)), par.rank() * Y // n, 1, axis=3)
        else:
            kv_Bdx2xTxYmxK = kv(hf_BdxTxD)
        k_BdxTxYmxK, v_BdxTxYmxK = kv_Bdx2xTxYmxK[:, 0], kv_Bdx2xTxYmxK[:, 1]
        if c.qk_norm:  # replicated scales applied to this rank's heads only: f sums their gradient over model
            q_BdxTxHmxK = norm(q_BdxTxHmxK, par.f(a["qnorm_LsxK"]), c.norm_eps)
            k_BdxTxYmxK = norm(k_BdxTxYmxK, par.f(a["knorm_LsxK"]), c.norm_eps)
        sin_BdxTxK, cos_BdxTxK = self._rope(positions_BdxT, local)
        q_BdxTxHmxK = rotate(q_BdxTxHmxK, sin_BdxTxK, cos_BdxTxK)
        scale = math.sqrt(K / c.query_pre_attn_scalar)  # the kernels divide by sqrt(K)
        return q_BdxTxHmxK * jnp.asarray(scale, q_BdxTxHmxK.dtype), rotate(k_BdxTxYmxK, sin_BdxTxK,
                                                                           cos_BdxTxK), v_BdxTxYmxK

    def attend(self, q_BdxTxHmxK, k_BdxTxYmxK, v_BdxTxYmxK, local, par: Parallel = DENSE, segments=None):
        """The attention core (`Decoder.attention`: the training kernel, a context axis's,
        or the KV cache's) with the layer kind's window, the scores soft-capped (Gemma 2).
        Training: `lax.cond` between the windowed and the full form (the kernels' masks are
        static; one branch runs). Decoding: the cache's mask reads the window traced (a
        full layer's is the whole context), so the core that writes the cache runs once,
        outside any branch."""
        c = self.config
        core = self.attention(par, segments)

        def run(window):
            return core(q_BdxTxHmxK, k_BdxTxYmxK, v_BdxTxYmxK, window=window, softcap=c.attn_softcap or None)
        kinds = set(c.local_layers().tolist())
        if kinds == {True}:
            return run(c.sliding_window)
        if kinds == {False}:
            return run(None)
        if isinstance(segments, Decoding):
            return run(jnp.where(local, c.sliding_window, c.seq_len))  # every key p - seq_len < k <= p: all
        return lax.cond(local, lambda: run(c.sliding_window), lambda: run(None))

    def layer(self, blk, x_BdxTxD, par: Parallel = DENSE, segments=None, *, index=None):
        """One block (`blk`: one layer of the stack) at global layer `index` (traced; the
        stack runner gives it): pre-norm, attention, post-norm, residual; the same around
        the GeGLU. Positions and packed rows' `segments` as the Llama's."""
        a, c = blk["attn"], self.config
        assert index is not None, "Gemma's layers read their index (stack.run's index_L)"
        B, T = x_BdxTxD.shape[:2]
        positions_BdxT = jnp.broadcast_to(context.positions(T, par), (B, T)) if segments is None else \
            segments.positions_BxT
        local = jnp.asarray(c.local_layers())[index]
        h_BdxTxD = norm(x_BdxTxD, blk["attn_norm"]["scale_LsxD"], c.norm_eps)
        q_BdxTxHmxK, k_BdxTxYmxK, v_BdxTxYmxK = self.project(a, h_BdxTxD, positions_BdxT, local, par)
        o_BdxTxHmxK = self.attend(q_BdxTxHmxK, k_BdxTxYmxK, v_BdxTxYmxK, local, par, segments)
        o_BdxTxD = par.g(adapted("o", a, o_BdxTxHmxK, par.policy.einsum("bthk,hkd->btd", o_BdxTxHmxK,
                                                                        a["wo_LsxHmxKxD"])))
        x_BdxTxD = x_BdxTxD + norm(o_BdxTxD, blk["attn_post_norm"]["scale_LsxD"], c.norm_eps)
        return x_BdxTxD + norm(self.mlp(blk, x_BdxTxD, par), blk["mlp_post_norm"]["scale_LsxD"], c.norm_eps)

    def mlp(self, blk, x_BdxTxD, par: Parallel = DENSE):
        """GeGLU of the normed input: down(gelu_tanh(gate(h)) * up(h)), summed over the model axis."""
        m = blk["mlp"]
        hf_BdxTxD = par.f(norm(x_BdxTxD, blk["mlp_norm"]["scale_LsxD"], self.config.norm_eps))
        def mm(name, x, leaf):  # fp8 under --dtype fp8; the LoRA term where there is one (`adapted`)
            return adapted(name, m, x, par.policy.matmul(x, m[leaf]))
        h_BdxTxFm = jax.nn.gelu(mm("gate", hf_BdxTxD, "wgate_LsxDxFm"), approximate=True) * mm(
            "up", hf_BdxTxD, "wup_LsxDxFm")
        return par.g(mm("down", h_BdxTxFm, "wdown_LsxFmxD"))  # row-parallel: the ranks' partial sums added

    def head(self, params, x_BdxTxD, par: Parallel = DENSE):
        """Final norm, the tied output head and the final soft cap: Bd x T x Vm logits in float32."""
        c = self.config
        x_BdxTxD = norm(x_BdxTxD, params["norm"]["scale_D"], c.norm_eps).astype(jnp.float32)
        logits = tp.column_parallel(x_BdxTxD, params["embed_VmxD"].T.astype(jnp.float32), None, par)
        return attention.soft_cap(logits, c.final_softcap)

    def mlp_values(self, tokens: int, split: int) -> dict:
        """As the Llama's: the gated MLP's extra half counted as width (F -> 1.5 F)."""
        return dense_mlp_values(self.config.d_ff * 3 // 2 // split)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x matmul parameters + attention (Kaplan et al. 2020)
        over the whole context (local layers counted as global: an upper bound)."""
        c = self.config
        K = c.head_dim
        attn = c.d_model * (2 * c.n_heads * K + 2 * c.n_kv_heads * K)
        matmul = c.n_layers * (attn + 3 * c.d_model * c.d_ff) + c.vocab_size * c.d_model
        return 6 * matmul + 3 * c.n_layers * 4 * c.seq_len * c.n_heads * K


class Gemma2(Gemma):
    name = "gemma2"


class Gemma3(Gemma):
    name = "gemma3"


register(Entry("gemma2", Gemma2, Gemma2Config, presets=GEMMA2_PRESETS))
register(Entry("gemma3", Gemma3, Gemma3Config, presets=GEMMA3_PRESETS))
