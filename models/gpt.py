"""A byte-level GPT: token + position embeddings, pre-LN transformer blocks, tied head.

Radford et al., "Language models are unsupervised multitask learners" (GPT-2), at a
size that trains on two CPU cores. Parameters are a plain dict (a pytree) so that a
sharding can be assigned to each leaf from one table; tensors carry their shapes in
their names (B batch, T time, D model width, H heads, K head width, F MLP width,
V vocabulary), and a dimension split over a mesh axis carries that axis's initial:
`w1_DxFm` is D x F with F split over `model` (this device holds D x F/n of it inside a
step), `x_BdxTxD` has the batch split over the data axes. The same name is the global
array outside a shard_map and this device's block inside it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dpjax import collectives
from dpjax import tensor_parallel as tp
from dpjax.errors import UserError
from dpjax.tensor_parallel import DENSE, Parallel


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128  # model width
    n_layers: int = 2  # transformer blocks
    n_heads: int = 8  # attention heads
    d_ff: int = 512  # MLP width

    def __post_init__(self):
        check_positive(self, "GPT")
        if self.d_model % self.n_heads:
            raise UserError(f"GPT d_model={self.d_model} is not divisible by n_heads={self.n_heads}")


def check_positive(config, kind: str) -> None:
    for name, value in asdict(config).items():
        if value < 1:
            raise UserError(f"{kind} {name} must be positive, got {value}")


class ByteModel:
    """What every model shares: the next-byte loss, a parameter count, a description."""

    name = "model"

    def __init__(self, config):
        self.config = config

    def loss(self, params, batch_BdxT1, par: Parallel = DENSE):
        """Mean next-byte cross-entropy. Inside a sharded step `par` names the model axis
        (and the FSDP gathers); the default is the plain dense computation."""
        return cross_entropy(self.apply(params, batch_BdxT1[:, :-1], par), batch_BdxT1[:, 1:])

    def num_params(self, params) -> int:
        return sum(x.size for x in jax.tree.leaves(params))

    def describe(self) -> dict:
        return {"model": self.name, **asdict(self.config)}


def layer_norm(x, p, eps: float = 1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def causal_attention(q_BdxTxHmxK, k_BdxTxHmxK, v_BdxTxHmxK):
    T, K = q_BdxTxHmxK.shape[1], q_BdxTxHmxK.shape[-1]
    s_BdxHmxTxT = jnp.einsum("bthk,bshk->bhts", q_BdxTxHmxK, k_BdxTxHmxK) / math.sqrt(K)
    mask_TxT = jnp.tril(jnp.ones((T, T), bool))
    s_BdxHmxTxT = jnp.where(mask_TxT, s_BdxHmxTxT, jnp.finfo(s_BdxHmxTxT.dtype).min)
    p_BdxHmxTxT = jax.nn.softmax(s_BdxHmxTxT, axis=-1)
    return jnp.einsum("bhts,bshk->bthk", p_BdxHmxTxT, v_BdxTxHmxK)


def cross_entropy(logits_BdxTxV, targets_BdxT):
    """Mean next-byte cross-entropy of whole (unsplit) logits."""
    logp = jax.nn.log_softmax(logits_BdxTxV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets_BdxT[..., None], axis=-1).mean()


class GPT(ByteModel):
    """Every matmul is a dpjax.tensor_parallel layer: with the model axis of size n, each
    device holds 1/n of the heads, of the MLP width and of the vocabulary."""

    name = "gpt"
    # The one sharding table (Megatron-LM layout), by leaf name; dimensions not named are
    # replicated. FSDP adds the data axes on top (dpjax.sharding.make_layout).
    SPECS = {
        "embed_VmxD": P("model", None),  # vocabulary-parallel embedding and (tied) output head
        "pos_TxD": P(),
        "wqkv_Dx3xHmxK": P(None, None, "model", None),  # heads split: column-parallel
        "wo_HmxKxD": P("model", None, None),  # heads split: row-parallel
        "w1_DxFm": P(None, "model"), "b1_Fm": P("model"),  # column-parallel
        "w2_FmxD": P("model", None), "b2_D": P(),  # row-parallel; the bias is added once, after g
        "scale": P(), "bias": P(),  # layer norms
    }

    def init(self, key):
        c = self.config
        D, F, H, K = c.d_model, c.d_ff, c.n_heads, c.d_model // c.n_heads
        std, out_std = 0.02, 0.02 / math.sqrt(2 * c.n_layers)
        keys = jax.random.split(key, 2 + 4 * c.n_layers)
        ln = lambda: {"scale": jnp.ones((D,)), "bias": jnp.zeros((D,))}  # noqa: E731
        blocks = []
        for i in range(c.n_layers):
            k = keys[2 + 4 * i: 6 + 4 * i]
            blocks.append({
                "ln1": ln(),
                "attn": {
                    "wqkv_Dx3xHmxK": std * jax.random.normal(k[0], (D, 3, H, K)),
                    "wo_HmxKxD": out_std * jax.random.normal(k[1], (H, K, D)),
                },
                "ln2": ln(),
                "mlp": {
                    "w1_DxFm": std * jax.random.normal(k[2], (D, F)),
                    "b1_Fm": jnp.zeros((F,)),
                    "w2_FmxD": out_std * jax.random.normal(k[3], (F, D)),
                    "b2_D": jnp.zeros((D,)),
                },
            })
        return {
            "embed_VmxD": std * jax.random.normal(keys[0], (c.vocab_size, D)),
            "pos_TxD": std * jax.random.normal(keys[1], (c.seq_len, D)),
            "blocks": blocks,
            "ln_f": ln(),
        }

    def logits(self, params, tokens_BdxT, par: Parallel = DENSE):
        """This shard's slice of the logits, Bd x T x Vm (all of them when dense)."""
        T = tokens_BdxT.shape[1]
        embed_VmxD = par.use(params["embed_VmxD"], "embed_VmxD")
        x_BdxTxD = tp.vocab_parallel_embed(tokens_BdxT, embed_VmxD, par) + par.use(params["pos_TxD"], "pos_TxD")[:T]
        for i, blk in enumerate(params["blocks"]):
            blk = par.use(blk, "blocks", i)
            h_BdxTxD = layer_norm(x_BdxTxD, blk["ln1"])
            x_BdxTxD = x_BdxTxD + tp.head_parallel_attention(h_BdxTxD, blk["attn"]["wqkv_Dx3xHmxK"],
                                                             blk["attn"]["wo_HmxKxD"], causal_attention, par)
            h_BdxTxD = layer_norm(x_BdxTxD, blk["ln2"])
            m = blk["mlp"]
            h_BdxTxFm = jax.nn.gelu(tp.column_parallel(h_BdxTxD, m["w1_DxFm"], m["b1_Fm"], par))
            x_BdxTxD = x_BdxTxD + tp.row_parallel(h_BdxTxFm, m["w2_FmxD"], m["b2_D"], par)
        x_BdxTxD = layer_norm(x_BdxTxD, par.use(params["ln_f"], "ln_f"))
        return tp.column_parallel(x_BdxTxD, embed_VmxD.T, None, par)  # tied output head

    def apply(self, params, tokens_BdxT, par: Parallel = DENSE):
        """The full logits (dense; with a model axis, gathered: for inspection, not training)."""
        logits = self.logits(params, tokens_BdxT, par)
        if par.model_axis is None:
            return logits
        return jnp.moveaxis(collectives.all_gather(jnp.moveaxis(logits, -1, 0), par.model_axis), 0, -1)

    def loss(self, params, batch_BdxT1, par: Parallel = DENSE):
        """Vocabulary-parallel cross-entropy: the full logits are never gathered."""
        logits_BdxTxVm = self.logits(params, batch_BdxT1[:, :-1], par)
        return tp.vocab_parallel_cross_entropy(logits_BdxTxVm, batch_BdxT1[:, 1:], par)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 * matmul parameters + attention (Kaplan et al. 2020)."""
        c = self.config
        matmul = c.n_layers * (4 * c.d_model**2 + 2 * c.d_model * c.d_ff) + c.vocab_size * c.d_model
        attention = c.n_layers * 4 * c.seq_len * c.d_model  # QK^T and PV: forward FLOPs per token
        return 6 * matmul + 3 * attention
