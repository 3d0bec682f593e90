"""A byte-level GPT: token + position embeddings, pre-LN transformer blocks, tied head.

Radford et al., "Language models are unsupervised multitask learners" (GPT-2), at a
size that trains on two CPU cores. Parameters are a plain dict (a pytree) so that a
sharding can be assigned to each leaf from one table; tensors carry their shapes in
their names (B batch, T time, D model width, H heads, K head width, F MLP width,
V vocabulary).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512

    def __post_init__(self):
        check_positive(self, "GPT")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPT d_model={self.d_model} is not divisible by n_heads={self.n_heads}")


def check_positive(config, kind: str) -> None:
    for name, value in asdict(config).items():
        if value < 1:
            raise ValueError(f"{kind} {name} must be positive, got {value}")


class ByteModel:
    """What every model shares: the next-byte loss, a parameter count, a description."""

    name = "model"

    def __init__(self, config):
        self.config = config

    def loss(self, params, batch_BxT1):
        return cross_entropy(self.apply(params, batch_BxT1[:, :-1]), batch_BxT1[:, 1:])

    def num_params(self, params) -> int:
        return sum(x.size for x in jax.tree.leaves(params))

    def describe(self) -> dict:
        return {"model": self.name, **asdict(self.config)}


def layer_norm(x, p, eps: float = 1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def causal_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK):
    T, K = q_BxTxHxK.shape[1], q_BxTxHxK.shape[-1]
    s_BxHxTxT = jnp.einsum("bthk,bshk->bhts", q_BxTxHxK, k_BxTxHxK) / math.sqrt(K)
    mask_TxT = jnp.tril(jnp.ones((T, T), bool))
    s_BxHxTxT = jnp.where(mask_TxT, s_BxHxTxT, jnp.finfo(s_BxHxTxT.dtype).min)
    p_BxHxTxT = jax.nn.softmax(s_BxHxTxT, axis=-1)
    return jnp.einsum("bhts,bshk->bthk", p_BxHxTxT, v_BxTxHxK)


def cross_entropy(logits_BxTxV, targets_BxT):
    logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1).mean()


class GPT(ByteModel):
    name = "gpt"

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
                    "wqkv_Dx3xHxK": std * jax.random.normal(k[0], (D, 3, H, K)),
                    "wo_HxKxD": out_std * jax.random.normal(k[1], (H, K, D)),
                },
                "ln2": ln(),
                "mlp": {
                    "w1_DxF": std * jax.random.normal(k[2], (D, F)),
                    "b1_F": jnp.zeros((F,)),
                    "w2_FxD": out_std * jax.random.normal(k[3], (F, D)),
                    "b2_D": jnp.zeros((D,)),
                },
            })
        return {
            "embed_VxD": std * jax.random.normal(keys[0], (c.vocab_size, D)),
            "pos_TxD": std * jax.random.normal(keys[1], (c.seq_len, D)),
            "blocks": blocks,
            "ln_f": ln(),
        }

    def apply(self, params, tokens_BxT):
        T = tokens_BxT.shape[1]
        x_BxTxD = params["embed_VxD"][tokens_BxT] + params["pos_TxD"][:T]
        for blk in params["blocks"]:
            h_BxTxD = layer_norm(x_BxTxD, blk["ln1"])
            qkv = jnp.einsum("btd,dihk->ibthk", h_BxTxD, blk["attn"]["wqkv_Dx3xHxK"])
            a_BxTxHxK = causal_attention(qkv[0], qkv[1], qkv[2])
            x_BxTxD = x_BxTxD + jnp.einsum("bthk,hkd->btd", a_BxTxHxK, blk["attn"]["wo_HxKxD"])
            h_BxTxD = layer_norm(x_BxTxD, blk["ln2"])
            m = blk["mlp"]
            h_BxTxF = jax.nn.gelu(h_BxTxD @ m["w1_DxF"] + m["b1_F"])
            x_BxTxD = x_BxTxD + h_BxTxF @ m["w2_FxD"] + m["b2_D"]
        x_BxTxD = layer_norm(x_BxTxD, params["ln_f"])
        return x_BxTxD @ params["embed_VxD"].T  # tied output head

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 * matmul parameters + attention (Kaplan et al. 2020)."""
        c = self.config
        matmul = c.n_layers * (4 * c.d_model**2 + 2 * c.d_model * c.d_ff) + c.vocab_size * c.d_model
        attention = c.n_layers * 4 * c.seq_len * c.d_model  # QK^T and PV: forward FLOPs per token
        return 6 * matmul + 3 * attention
