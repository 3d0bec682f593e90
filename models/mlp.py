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
from jax.sharding import PartitionSpec as P

from dpjax.compute import tensor_parallel as tp
from dpjax.models.base import ByteModel, check_positive
from dpjax.models.registry import Entry, register
from dpjax.compute.tensor_parallel import DENSE, Parallel


@dataclass(frozen=True)
class MLPConfig:
    vocab_size: int = 256
    seq_len: int = 128
    context: int = 4  # bytes of context each position sees
    d_embed: int = 32  # byte embedding width
    d_hidden: int = 256  # hidden units

    def __post_init__(self):
        check_positive(self, "MLP")


class MLP(ByteModel):
    """No sequence to split over a context axis, no stack of layers for a pipeline, no
    statistics: `ByteModel`'s defaults."""

    name = "mlp"
    # Hidden units split over the model axis: w1 column-parallel, w2 row-parallel.
    SPECS = {"embed_VxE": P(), "w1_CxFm": P(None, "model"), "b1_Fm": P("model"), "w2_FmxV": P("model", None),
             "b2_V": P()}

    def init(self, key):
        c = self.config
        k = jax.random.split(key, 3)
        C = c.context * c.d_embed
        return {
            "embed_VxE": 0.1 * jax.random.normal(k[0], (c.vocab_size, c.d_embed)),
            "w1_CxFm": jax.random.normal(k[1], (C, c.d_hidden)) / math.sqrt(C),
            "b1_Fm": jnp.zeros((c.d_hidden,)),
            "w2_FmxV": jax.random.normal(k[2], (c.d_hidden, c.vocab_size)) / math.sqrt(c.d_hidden),
            "b2_V": jnp.zeros((c.vocab_size,)),
        }

    def apply(self, params, tokens_BdxT, par: Parallel = DENSE):
        c = self.config
        p = par.policy.cast(par.use(params))  # the compute dtype (dpjax.compute.policy); the loss upcasts the logits
        e_BdxTxE = p["embed_VxE"][tokens_BdxT]
        # window t holds bytes t-context+1 .. t (zeros before the start)
        padded = jnp.pad(e_BdxTxE, ((0, 0), (c.context - 1, 0), (0, 0)))
        T = tokens_BdxT.shape[1]
        win_BdxTxC = jnp.concatenate([padded[:, i:i + T] for i in range(c.context)], axis=-1)
        h_BdxTxFm = jax.nn.relu(tp.column_parallel(win_BdxTxC, p["w1_CxFm"], p["b1_Fm"], par))
        return tp.row_parallel(h_BdxTxFm, p["w2_FmxV"], p["b2_V"], par)

    def activation_bytes(self, rows: int, **policy) -> int:
        """Bytes of float32 activations the backward pass of `rows` sequences keeps (an
        estimate): the context windows, the hidden layer before and after its ReLU, the
        logits and their softmax; the compute policy (`policy`: remat, attention, width,
        split) does not apply to its one hidden layer."""
        c = self.config
        return 4 * rows * c.seq_len * (c.context * c.d_embed + 2 * c.d_hidden + 2 * c.vocab_size)

    def flops_per_token(self) -> float:
        c = self.config
        return 6 * (c.context * c.d_embed * c.d_hidden + c.d_hidden * c.vocab_size)


register(Entry("mlp", MLP, MLPConfig))
