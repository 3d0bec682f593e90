"""A byte-level GPT: token + position embeddings, pre-LN transformer blocks, tied head.

Radford et al., "Language models are unsupervised multitask learners" (GPT-2), at a
size that trains on two CPU cores. Parameters are a plain dict (a pytree) so that a
sharding can be assigned to each leaf from one table; tensors carry their shapes in
their names (B batch, T time, D model width, H heads, K head width, F MLP width,
V vocabulary, L layers), and a dimension split over a mesh axis carries that axis's
initial: `w1_LsxDxFm` is L x D x F with the layers split over `stage` and F over `model`
(inside a step this device holds L/S x D x F/n of it), `x_BdxTxD` has the batch split
over the data axes. The same name is the global array outside a shard_map and this
device's block inside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dpjax.compute import attention, context
from dpjax.compute import tensor_parallel as tp
from dpjax.compute.tensor_parallel import DENSE, Parallel
from dpjax.errors import UserError
from dpjax.models import moe
from dpjax.models.base import Decoder, check_positive, dense_mlp_values
from dpjax.models.registry import Entry, register


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128  # model width
    n_layers: int = 2  # transformer blocks
    n_heads: int = 8  # attention heads
    d_ff: int = 512  # MLP width (each expert's, with experts)
    experts: int = 0  # E > 0: every block's MLP a mixture of E experts (dpjax.models.moe), split over `expert`
    top_k: int = 2  # experts a token is routed to
    capacity_factor: float = 1.25  # an expert's slots per device: ceil(F N k / E) of the device's N tokens
    router_aux_weight: float = 0.01  # Switch's load-balancing loss, in the loss with this weight
    router_z_weight: float = 0.001  # the router z-loss's weight
    moe: str = "capacity"  # capacity: choices past an expert's slots dropped; dropless: none (moe_dropless.py)

    def __post_init__(self):
        check_positive(self, "GPT", skip=MOE_OPTIONS)
        if self.d_model % self.n_heads:
            raise UserError(f"GPT d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.experts < 0 or self.capacity_factor <= 0 or min(self.router_aux_weight, self.router_z_weight) < 0:
            raise UserError(f"GPT experts {self.experts}, capacity_factor {self.capacity_factor} and the router "
                            f"weights must not be negative (a capacity factor above 0)")
        if self.moe not in moe.FORMS:
            raise UserError(f"GPT moe {self.moe!r}: choose one of {', '.join(moe.FORMS)}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise UserError(f"GPT top_k={self.top_k} must be between 1 and experts={self.experts}")


MOE_OPTIONS = ("experts", "top_k", "capacity_factor", "router_aux_weight", "router_z_weight", "moe")  # 0 allowed


def layer_norm(x, scale, bias, eps: float = 1e-5):
    """Layer norm with its statistics in float32 whatever `x`'s dtype; the result in `x`'s dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)


causal_attention = attention.naive  # the readable kernel (dpjax.compute.attention has the switch)


class DenseMLP:
    """The block's GELU MLP, column- then row-parallel (F split over `model`): a GPT's
    `mlp` part when it has no experts (`moe.Mixture` is the other)."""

    stat_names: tuple = ()
    SPECS = {"w1_LsxDxFm": P("stage", None, "model"), "b1_LsxFm": P("stage", "model"),  # column-parallel
             "w2_LsxFmxD": P("stage", "model", None), "b2_LsxD": P("stage", None)}  # row-parallel; b2 added after g

    def __init__(self, config):
        self.config = config

    def init(self, stacked, layer_key) -> dict:
        """The stacked leaves: `stacked(j, shape, scale)` draws layer i's from its key j (2, 3
        here; `layer_key(i, j)`, that key, is for a part drawing its own, as `moe.Mixture`'s router)."""
        c, L = self.config, self.config.n_layers
        D, F, std, out_std = c.d_model, c.d_ff, 0.02, 0.02 / math.sqrt(2 * L)
        return {"w1_LsxDxFm": stacked(2, (D, F), std), "b1_LsxFm": jnp.zeros((L, F)),
                "w2_LsxFmxD": stacked(3, (F, D), out_std), "b2_LsxD": jnp.zeros((L, D))}

    def __call__(self, m, h_BdxTxD, par: Parallel = DENSE):
        """(the MLP's output, no statistics)."""
        c, n = self.config, par.size()
        assert m["w1_LsxDxFm"].shape == (c.d_model, c.d_ff // n), (m["w1_LsxDxFm"].shape, n)  # this device's columns
        h_BdxTxFm = jax.nn.gelu(tp.column_parallel(h_BdxTxD, m["w1_LsxDxFm"], m["b1_LsxFm"], par))
        return tp.row_parallel(h_BdxTxFm, m["w2_LsxFmxD"], m["b2_LsxD"], par), ()

    def add_loss(self, loss, stats):
        """The loss as it is: a dense MLP reports no statistics (`moe.Mixture.add_loss` adds its router's)."""
        return loss

    def values(self, tokens: int, split: int) -> dict:
        """Its values per token for the memory estimate, F split over the model axis."""
        return dense_mlp_values(self.config.d_ff // split)

    def matmul_params(self) -> int:
        """The matmul parameters a token uses: both of its matrices."""
        return 2 * self.config.d_model * self.config.d_ff


class GPT(Decoder):
    """Every matmul is a dpjax.compute.tensor_parallel layer: with the model axis of size n, each
    device holds 1/n of the heads, of the MLP width and of the vocabulary.

    The blocks are stacked: every leaf under `blocks` carries a leading layer axis L
    (`w1_LsxDxFm` is L x D x F), which a `stage` axis splits (`Ls`): stage s holds layers
    s*L/S .. (s+1)*L/S - 1 (`dpjax.pipeline`). The block's MLP is chosen once, by the
    config: the dense one (`DenseMLP`) or, with experts, a mixture (`moe.Mixture`), whose
    router statistics the forward carries beside x (`Decoder.stat_names`)."""

    name = "gpt"
    # The one sharding table (Megatron-LM layout), by leaf name; dimensions not named are
    # replicated. FSDP adds the data axes on top (dpjax.sharding.make_layout).
    SPECS = {
        "embed_VmxD": P("model", None),  # vocabulary-parallel embedding and (tied) output head
        "pos_TxD": P(),
        "scale_D": P(), "bias_D": P(),  # the final layer norm
        "scale_LsxD": P("stage", None), "bias_LsxD": P("stage", None),  # the blocks' layer norms
        "wqkv_LsxDx3xHmxK": P("stage", None, None, "model", None),  # heads split: column-parallel
        "wo_LsxHmxKxD": P("stage", "model", None, None),  # heads split: row-parallel
        **DenseMLP.SPECS,
        **moe.Mixture.SPECS,  # with experts: E split over `expert`, each expert whole
    }

    def __init__(self, config):
        super().__init__(config)
        self.mlp = moe.Mixture(config) if config.experts else DenseMLP(config)

    @property
    def stat_names(self) -> tuple:
        return self.mlp.stat_names

    @property
    def experts(self) -> int:
        return self.config.experts

    def init(self, key):
        c = self.config
        D, H, K, L = c.d_model, c.n_heads, c.d_model // c.n_heads, c.n_layers
        std, out_std = 0.02, 0.02 / math.sqrt(2 * L)
        keys = jax.random.split(key, 2 + 4 * L)

        def stacked(j, shape, scale):  # layer i draws from keys[2 + 4i + j], whatever L is split into
            return jnp.stack([scale * jax.random.normal(keys[2 + 4 * i + j], shape) for i in range(L)])

        ln = lambda: {"scale_LsxD": jnp.ones((L, D)), "bias_LsxD": jnp.zeros((L, D))}  # noqa: E731
        mlp = self.mlp.init(stacked, lambda i, j: keys[2 + 4 * i + j])
        return {
            "embed_VmxD": std * jax.random.normal(keys[0], (c.vocab_size, D)),
            "pos_TxD": std * jax.random.normal(keys[1], (c.seq_len, D)),
            "blocks": {
                "ln1": ln(),
                "attn": {"wqkv_LsxDx3xHmxK": stacked(0, (D, 3, H, K), std),
                         "wo_LsxHmxKxD": stacked(1, (H, K, D), out_std)},
                "ln2": ln(),
                "mlp": mlp,
            },
            "ln_f": {"scale_D": jnp.ones((D,)), "bias_D": jnp.zeros((D,))},
        }

    def embed(self, params, tokens_BdxT, par: Parallel = DENSE, segments=None):
        """Token plus position embeddings (the first stage's work): Bd x T x D. With packed
        rows (`segments`) each token's position is its place in its own example."""
        c, T = self.config, tokens_BdxT.shape[1]
        assert T <= c.seq_len and params["embed_VmxD"].shape == (c.vocab_size // par.size(), c.d_model), (
            tokens_BdxT.shape, params["embed_VmxD"].shape, par.size())  # this device's blocks
        embed_VmxD, pos_TxD = par.policy.cast((params["embed_VmxD"], params["pos_TxD"]))
        if segments is not None:  # already this device's tokens' (split like them over a context axis)
            pos_TcxD = pos_TxD[segments.positions_BxT]
        # with a context axis this device's tokens are chunks of the sequence: their global positions
        else:
            pos_TcxD = pos_TxD[context.positions(T, par)] if context.active(par) else pos_TxD[:T]
        return tp.vocab_parallel_embed(tokens_BdxT, embed_VmxD, par) + pos_TcxD

    def layer(self, blk, x_BdxTxD, par: Parallel = DENSE, segments=None):
        """One pre-LN transformer block; `blk` is one layer of the stack (its leaves without
        the leading L: `w1_LsxDxFm` is D x Fm here)."""
        return self.layer_stats(blk, x_BdxTxD, par, segments)[0]

    def layer_stats(self, blk, x_BdxTxD, par: Parallel = DENSE, segments=None):
        """(the block's output, its MLP's statistics: a mixture's balance loss, z loss and
        share of choices dropped; none for the dense MLP). `segments`: packed rows, whose
        attention stays within each example."""
        a, c, n = blk["attn"], self.config, par.size()
        D, H = c.d_model, c.n_heads
        assert x_BdxTxD.shape[-1] == D and a["wqkv_LsxDx3xHmxK"].shape == (D, 3, H // n, D // H), (
            x_BdxTxD.shape, a["wqkv_LsxDx3xHmxK"].shape, n)  # this device's heads
        h_BdxTxD = layer_norm(x_BdxTxD, blk["ln1"]["scale_LsxD"], blk["ln1"]["bias_LsxD"])
        core = self.attention(par, segments)  # the training kernel, or the KV cache's while decoding
        x_BdxTxD = x_BdxTxD + tp.head_parallel_attention(h_BdxTxD, a["wqkv_LsxDx3xHmxK"], a["wo_LsxHmxKxD"],
                                                         core, par)
        h_BdxTxD = layer_norm(x_BdxTxD, blk["ln2"]["scale_LsxD"], blk["ln2"]["bias_LsxD"])
        y_BdxTxD, stats = self.mlp(blk["mlp"], h_BdxTxD, par)
        return x_BdxTxD + y_BdxTxD, stats

    def head(self, params, x_BdxTxD, par: Parallel = DENSE):
        """Final layer norm and the tied output head (the last stage's work): Bd x T x Vm,
        float32 whatever the compute dtype (the logits are a numerically sensitive part:
        `dpjax.compute.policy`)."""
        assert x_BdxTxD.shape[-1] == self.config.d_model, x_BdxTxD.shape
        x_BdxTxD = layer_norm(x_BdxTxD, params["ln_f"]["scale_D"], params["ln_f"]["bias_D"]).astype(jnp.float32)
        return tp.column_parallel(x_BdxTxD, params["embed_VmxD"].T.astype(jnp.float32), None, par)  # tied head

    def add_stats_loss(self, loss, stat_means):
        return self.mlp.add_loss(loss, stat_means)

    def mlp_values(self, tokens: int, split: int) -> dict:
        """The MLP's values per token for the memory estimate: a mixture's are its slots'
        (`moe.activation_values`: k x capacity factor a token, and the dispatch buffers;
        experts are whole on a model rank)."""
        return self.mlp.values(tokens, split)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 * matmul parameters + attention (Kaplan et al. 2020);
        with experts, the active ones: a token's k experts and the router."""
        c = self.config
        matmul = c.n_layers * (4 * c.d_model**2 + self.mlp.matmul_params()) + c.vocab_size * c.d_model
        attention = c.n_layers * 4 * c.seq_len * c.d_model  # QK^T and PV: forward FLOPs per token
        return 6 * matmul + 3 * attention


register(Entry("gpt", GPT, GPTConfig))
