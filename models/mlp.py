"""A byte-level MLP: each position predicts the next byte from the last `context` bytes.

The embeddings of a window of `context` bytes are concatenated and passed through a
two-layer MLP (Bengio et al., "A neural probabilistic language model", JMLR 2003).
A small, fast model for tests and benchmarks of the data-parallel machinery.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dpjax.models.gpt import ByteModel, check_positive


@dataclass(frozen=True)
class MLPConfig:
    vocab_size: int = 256
    seq_len: int = 128
    context: int = 4
    d_embed: int = 32
    d_hidden: int = 256

    def __post_init__(self):
        check_positive(self, "MLP")


class MLP(ByteModel):
    name = "mlp"

    def init(self, key):
        c = self.config
        k = jax.random.split(key, 3)
        C = c.context * c.d_embed
        return {
            "embed_VxE": 0.1 * jax.random.normal(k[0], (c.vocab_size, c.d_embed)),
            "w1_CxH": jax.random.normal(k[1], (C, c.d_hidden)) / math.sqrt(C),
            "b1_H": jnp.zeros((c.d_hidden,)),
            "w2_HxV": jax.random.normal(k[2], (c.d_hidden, c.vocab_size)) / math.sqrt(c.d_hidden),
            "b2_V": jnp.zeros((c.vocab_size,)),
        }

    def apply(self, params, tokens_BxT):
        c = self.config
        e_BxTxE = params["embed_VxE"][tokens_BxT]
        # window t holds bytes t-context+1 .. t (zeros before the start)
        padded = jnp.pad(e_BxTxE, ((0, 0), (c.context - 1, 0), (0, 0)))
        T = tokens_BxT.shape[1]
        win_BxTxC = jnp.concatenate([padded[:, i:i + T] for i in range(c.context)], axis=-1)
        h_BxTxH = jax.nn.relu(win_BxTxC @ params["w1_CxH"] + params["b1_H"])
        return h_BxTxH @ params["w2_HxV"] + params["b2_V"]

    def flops_per_token(self) -> float:
        c = self.config
        return 6 * (c.context * c.d_embed * c.d_hidden + c.d_hidden * c.vocab_size)
