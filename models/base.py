"""What every model shares, and the `Decoder` contract a new architecture fills in.

`ByteModel` is the root: a config, the next-token loss, a parameter count, a description,
and every capability dpjax reads of a model declared with its default (no sequence to
split over a context axis, no stack of layers for a pipeline, no statistics beside the
loss, no experts, its SPECS on every mesh). dpjax reads these as plain attributes, never
probing a model with getattr (`dpjax.models.registry.Model` lists them).

`Decoder` is a stack of identical layers between an embedding and an output head (the
GPT, the Llama): a subclass gives its config (with vocab_size, seq_len, d_model,
n_layers, n_heads, d_ff), `init`, SPECS, `embed`, `layer`, `head` and `flops_per_token`;
the loss, the logits, the pipeline's pieces, the forward over the stack
(`dpjax.compute.stack`), the context split and the memory estimate come from here. A
block whose layers report statistics (a mixture's router) declares their names in
`stat_names` and gives `layer_stats`; the forward then carries their sum beside x.

Packed rows (several examples in one row: `dpjax.data.packing`) reach a decoder as one
optional argument, `segments` (`dpjax.compute.attention.Segments`: per-token segment ids
and positions within each example), last in `forward`, `embed`, `layer` and `layer_stats`:
`layer(blk, x, par, segments=None)`. `embed` reads the positions (a learned position
table), `layer` passes them to rope and the segment ids to its attention core, which
attends only within a segment. A family overriding `layer` passes `segments` on; None is
the unpacked model, traced exactly as before.

A layer takes its attention core from `attention(par, segments)`: the policy's kernel (a
context axis's ring or all-gather when there is one) masked by the segments and the
window the layer passes, or, while decoding (`segments` a `Decoding`), the KV cache's
(`dpjax.generate.cache`), which writes the layer's K and V into the cache and attends over
it: a family whose layers call it decodes with the cache without code of its own.
"""

from __future__ import annotations

import abc
from dataclasses import asdict, dataclass
from typing import Callable
from functools import partial

import jax
import jax.numpy as jnp

from dpjax import collectives
from dpjax.compute import context, stack
from dpjax.compute import tensor_parallel as tp
from dpjax.compute.tensor_parallel import DENSE, Parallel
from dpjax.errors import UserError


ADAPTED = "lora"  # a layer group's entry holding its LoRA terms (`dpjax.models.lora.Terms`), when it has them


def adapted(name: str, group: dict, x, y):
    """y = x W, projection `name` ("q", "kv", "o", "gate", "up", "down") of a layer's `group`
    (its attn or mlp), plus its LoRA term (alpha / r) (dropout(x) A) B where a LoRA layer in a
    training step with dropout put the terms beside the weights (`dpjax.models.lora`); y
    itself otherwise. A family calls it on each projection's own product, before whatever
    it adds (Qwen2's biases, the q/k norms), as PEFT adapts the nn.Linear alone."""
    terms = group.get(ADAPTED)
    return y if terms is None else terms(name, x, y)


def check_positive(config, kind: str, skip: tuple = ()) -> None:
    """A one-line UserError for the first config field below 1 (`skip`: fields that may be)."""
    for name, value in asdict(config).items():
        if name not in skip and value < 1:
            raise UserError(f"{kind} {name} must be positive, got {value}")


def cross_entropy(logits_BdxTxV, targets_BdxT):
    """Mean next-byte cross-entropy of whole (unsplit) logits."""
    logp = jax.nn.log_softmax(logits_BdxTxV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets_BdxT[..., None], axis=-1).mean()


class ByteModel:
    """What every model shares: the next-byte loss, a parameter count, a description, and
    the capabilities dpjax reads, declared with their defaults."""

    name = "model"
    CONTEXT = False  # True: its loss splits each sequence over a context axis (dpjax.compute.context)
    LAYERS: str | None = None  # the key of its stacked layers, which a pipeline divides over `stage`
    SPECS: dict  # (each model's own) its one sharding table: leaf name -> PartitionSpec over `model`
    # >0: its layers drop values in training at this rate when the step gives them a draw
    # (`Parallel.dropout`, `dpjax.compute.dropout`): LoRA's adapters' input (`dpjax.models.lora`)
    dropout_rate: float = 0.0
    apply: Callable[..., jax.Array]  # (each model's own) apply(params, tokens_BdxT, par) -> logits Bd x T x V

    @property
    def has_stats(self) -> bool:
        """True: `loss_and_stats` returns statistics the train step reports (a router's)."""
        return False

    @property
    def head_dim(self) -> int | None:
        """The attention heads' width (the compute policy's kernel choice), None: no attention."""
        return None

    # properties, not class attributes: a mixture reads its experts from its config, Gemma 2 its softcap
    @property
    def experts(self) -> int:
        """E > 0: a mixture of E experts, which an `expert` axis splits."""
        return 0

    @property
    def attention_softcap(self) -> float:
        """> 0: its attention scores are soft-capped (Gemma 2): no cuDNN kernel."""
        return 0.0

    def __init__(self, config):
        self.config = config

    def loss(self, params, batch_BdxT1, par: Parallel = DENSE):
        """Mean next-byte cross-entropy. Inside a sharded step `par` names the model axis
        (and the FSDP gathers); the default is the plain dense computation."""
        return cross_entropy(self.apply(params, batch_BdxT1[:, :-1], par), batch_BdxT1[:, 1:])

    def loss_and_stats(self, params, batch_BdxT1, par: Parallel = DENSE):
        """(`loss`, its statistics by name, or None where the model has none: `has_stats`)."""
        return self.loss(params, batch_BdxT1, par), None

    def sharding_table(self, mesh) -> dict:
        """Its sharding table on `mesh`: SPECS unless the table depends on the mesh."""
        return self.SPECS

    def model_splits(self) -> tuple[int, ...]:
        """The sizes a model axis must divide (`dpjax.hf`'s default mesh)."""
        return (self.config.vocab_size,)

    def num_params(self, params) -> int:
        return sum(x.size for x in jax.tree.leaves(params))

    def describe(self) -> dict:
        return {"model": self.name, **asdict(self.config)}


def activation_bytes(rows: int, *, layers: int, d_model: int, heads: int, seq_len: int, vocab: int, mlp: dict,
                     remat: str = "none", attention: str = "naive", width: int = 4, context: int = 1) -> int:
    """Bytes of activations a decoder's backward pass keeps for `rows` sequences (an
    estimate, per device): each layer keeps what the remat policy saves, a layer being
    recomputed holds its whole working set once, and the ends of the model keep the
    embeddings and the float32 logits. `heads`, `vocab` and the MLP's values are this
    device's (split over the model axis); `mlp`: the MLP's compute-dtype values per token
    for remat none and dots (`dense_mlp_values` for a plain MLP of width F). `width`:
    bytes of a compute-dtype value (4 on CPU, where XLA computes bfloat16 in float32); the
    attention's scores and probabilities are float32 (naive, xla: heads x T per token;
    cudnn's flash kernel keeps a float32 log-sum-exp per head instead). `context`: the
    context axis's size: a device holds T/context tokens of each sequence (each row's
    scores still span the T keys: ring attention keeps them block by block for its backward).

    Per token and layer, in compute-dtype values: none keeps about 12 D + 6 F (the
    norms' inputs and outputs, Q K V, the attention and projection outputs, the MLP's
    pre- and post-GELU values), dots keeps the matmul outputs 6 D + F (Q K V 3 D, the
    attention output, the two projections' D each, the first MLP matmul's F), full the
    layer's input D. The coefficients were fitted to XLA's buffer assignment on CPU for
    the GPT (`memory_analysis()`, layers 2 and 4 apart); tests/test_memory.py holds the
    estimate to the compiled program."""
    D, H, T, V = d_model, heads, seq_len, vocab
    scores = 2 * H * T * 4 if attention in ("naive", "xla") else H * 4
    full_layer = (12 * D + mlp["none"]) * width + scores
    saved = {"none": full_layer, "dots": (6 * D + mlp["dots"]) * width, "full": D * width}[remat]
    working = {"none": 0.5, "dots": 0.6, "full": 1.0}[remat] * full_layer  # the layer being recomputed
    ends = (2 * V + 2 * D) * 4
    return int(rows * (T // context) * (layers * saved + working + ends))


def dense_mlp_values(F: int) -> dict:
    """A plain MLP of (this device's) width F: 6 F values a token kept without remat, F under dots."""
    return {"none": 6 * F, "dots": F}


@dataclass(frozen=True)
class Decoding:
    """The `segments` of a decoding step (`dpjax.generate.cache`): the positions of its
    tokens (start .. start+T-1: what rope and a learned table read), no packed segments,
    and `attend`, the KV cache's attention core, which `Decoder.attention` hands the layer
    instead of the training kernel (None: `embed`, which reads the positions only)."""

    segment_ids_BxT: None
    positions_BxT: jax.Array
    attend: Callable | None = None


class Decoder(ByteModel, abc.ABC):
    """Embedding, a stack of identical layers (`blocks`: every leaf with a leading layer
    axis L, which a `stage` axis splits), output head. For a pipeline the model is cut
    into `embed` (first stage), `layer` (L times) and `head_loss` (last stage). The
    parameter tree is the same on every mesh, so a checkpoint resumes on another one."""

    CONTEXT = True  # its loss splits each sequence over a context axis (dpjax.compute.context)
    LAYERS = "blocks"
    # its layers take their attention core from `attention(par, segments)`, so `dpjax.generate`
    # decodes with the KV cache; False: generation recomputes the sequence so far each token
    CACHED = True
    # True: its layers differ by their place in the stack (Gemma's local and global ones): the
    # stack runner hands `layer` each one's index in the whole model, `layer(blk, x, par, index=i)`
    INDEXED_LAYERS = False
    # True: its blocks' linear layers are the Llama's leaves under PEFT's module names (q_proj ..
    # down_proj), each projection through `adapted`: LoRA (`dpjax.models.lora`) adapts those it holds
    LORA_LAYERS = False

    @property
    def stat_names(self) -> tuple:
        """The statistics each layer reports through `layer_stats`, summed over the stack
        (a property: a GPT's come from its MLP part, a mixture's or none)."""
        return ()

    @property
    def has_stats(self) -> bool:
        return bool(self.stat_names)

    @property
    def head_dim(self) -> int:
        return self.config.d_model // self.config.n_heads

    @property
    def kv_heads(self) -> int:
        """The K/V heads a context axis's ring carries (grouped-query attention has fewer)."""
        return self.config.n_heads

    @property
    def cache_window(self) -> int | None:
        """W when every layer attends over the last W positions only (Mistral's sliding
        window): the KV cache then keeps W positions a layer, a ring (`dpjax.generate.cache`),
        as HuggingFace's and vLLM's do; None: every position (a model with full-attention
        layers, Gemma's global ones among them)."""
        return None

    def model_splits(self) -> tuple[int, ...]:
        c = self.config
        return (c.n_heads, c.d_ff, c.vocab_size)

    # A subclass computes with parameters ready to use (under FSDP: gathered; `forward`
    # gathers the outer ones, the stack runner a layer at a time, a pipeline a stage's once).

    @abc.abstractmethod
    def init(self, key) -> dict:
        """The parameters: a dict whose `LAYERS` entry holds the stacked layers."""

    @abc.abstractmethod
    def embed(self, params, tokens_BdxT, par: Parallel = DENSE, segments=None):
        """Bd x T x D: the first stage's work. `segments` (`dpjax.compute.attention.Segments`,
        packed rows; None: one sequence a row): each token's position within its example."""

    @abc.abstractmethod
    def layer(self, blk, x_BdxTxD, par: Parallel = DENSE, segments=None):
        """One block (`blk`: one layer of the stack, its leaves without the leading L): x -> x.
        `segments`: packed rows' segment ids and positions, which its attention masks by."""

    def layer_stats(self, blk, x_BdxTxD, par: Parallel = DENSE, segments=None):
        """(x after the block, its statistics: one scalar for each of `stat_names`)."""
        return self.layer(blk, x_BdxTxD, par, segments), ()

    def attention(self, par: Parallel = DENSE, segments=None) -> Callable:
        """The attention core a layer calls, `core(q_BdxTxHmxK, k_BdxTxYmxK, v_BdxTxYmxK,
        window=None, softcap=None) -> o_BdxTxHmxK`: this rank's Hm query heads, the Ym K/V
        heads they read (each serving Hm/Ym of them, in order; Y = H without grouped-query
        attention), the layer's sliding window (its query at p sees keys p-window+1 .. p;
        None: all before it) and its scores' soft cap (Gemma 2's; None: none). Training:
        the policy's kernel, or a context axis's (which carries the Y heads round its ring
        and repeats them itself), masked by packed rows' segment ids; decoding (`segments`
        a `Decoding`): the KV cache's attention, whose window may be traced."""
        if isinstance(segments, Decoding) and segments.attend is not None:
            return segments.attend
        kernel = context.kernel(par)
        masks = {} if segments is None else {"segment_ids_BxT": segments.segment_ids_BxT}

        def core(q_BdxTxHmxK, k_BdxTxYmxK, v_BdxTxYmxK, window: int | None = None, softcap: float | None = None):
            if not context.active(par):  # each K/V head repeated to the query heads it serves on this rank
                Hm = q_BdxTxHmxK.shape[2]
                k_BdxTxYmxK, v_BdxTxYmxK = context.shared(k_BdxTxYmxK, Hm), context.shared(v_BdxTxYmxK, Hm)
            return kernel(q_BdxTxHmxK, k_BdxTxYmxK, v_BdxTxYmxK, **masks, window=window, softcap=softcap)
        return core

    @abc.abstractmethod
    def head(self, params, x_BdxTxD, par: Parallel = DENSE):
        """This shard's logits, Bd x T x Vm in float32 (the last stage's work)."""

    @abc.abstractmethod
    def flops_per_token(self) -> float:
        """Training FLOPs per token (the MFU's numerator)."""

    def add_stats_loss(self, loss, stat_means):
        """The loss with its statistics' terms (a router's auxiliary losses) added."""
        return loss

    def head_loss(self, params, x_BdxTxD, targets_BdxT, par: Parallel = DENSE):
        """Vocabulary-parallel cross-entropy of the head's logits: the full logits are never gathered."""
        return tp.vocab_parallel_cross_entropy(self.head(params, x_BdxTxD, par), targets_BdxT, par)

    def _summed(self, blk, carry, par: Parallel = DENSE, segments=None):
        x_BdxTxD, stat_totals = carry
        x_BdxTxD, stats = self.layer_stats(blk, x_BdxTxD, par, segments)
        return x_BdxTxD, stat_totals + jnp.stack(stats)

    def forward(self, params, tokens_BdxT, par: Parallel = DENSE, segments=None):
        """(this shard's logits, Bd x T x Vm (all of them when dense; with a context axis,
        of this device's chunks), the layers' statistics averaged over them, or None).
        `segments`: packed rows (`dpjax.compute.attention.Segments`, split like the tokens);
        None traces the model exactly as it was before packing existed."""
        outer = {k: par.use(v, k) for k, v in params.items() if k != self.LAYERS}
        stack_L, path = params[self.LAYERS], (self.LAYERS,)
        layer, summed = self.layer, self._summed
        if segments is None:
            x_BdxTxD = self.embed(outer, tokens_BdxT, par)
        else:  # each layer reads the same segments (the scan closes over them)
            x_BdxTxD = self.embed(outer, tokens_BdxT, par, segments)
            layer, summed = partial(self.layer, segments=segments), partial(self._summed, segments=segments)
        # dpjax.compute.stack: scanned, rematerialised by the policy, FSDP gathering one layer at a time
        if not self.has_stats:
            index_L = jnp.arange(self.config.n_layers) if self.INDEXED_LAYERS else None
            return self.head(outer, stack.run(layer, stack_L, x_BdxTxD, par, path=path, index_L=index_L),
                             par), None
        assert not self.INDEXED_LAYERS, "a decoder with statistics whose layers read their index"
        no_stats = jnp.zeros(len(self.stat_names), jnp.float32)
        x_BdxTxD, stat_totals = stack.run(summed, stack_L, (x_BdxTxD, no_stats), par, path=path)
        return self.head(outer, x_BdxTxD, par), stat_totals / self.config.n_layers

    def logits(self, params, tokens_BdxT, par: Parallel = DENSE, segments=None):
        """This shard's slice of the logits, Bd x T x Vm (all of them when dense); with a
        context axis `tokens_BdxT` are this device's chunks (`context.split`)."""
        return self.forward(params, tokens_BdxT, par, segments)[0]

    def apply(self, params, tokens_BdxT, par: Parallel = DENSE, segments=None):
        """The full logits (dense; with a model axis, gathered: for inspection, not training;
        with a context axis, of this device's tokens, `context.split`'s)."""
        logits = self.logits(params, tokens_BdxT, par, segments)
        if par.model_axis is None:
            return logits
        return jnp.moveaxis(collectives.all_gather(jnp.moveaxis(logits, -1, 0), par.model_axis), 0, -1)

    def loss(self, params, batch_BdxT1, par: Parallel = DENSE):
        """Vocabulary-parallel cross-entropy: the full logits are never gathered. With a
        context axis, the mean over this device's share of the tokens (`dpjax.compute.context`:
        the step averages it over the axis)."""
        return self.loss_and_stats(params, batch_BdxT1, par)[0]

    def loss_and_stats(self, params, batch_BdxT1, par: Parallel = DENSE):
        """(`loss`, the statistics of the same forward by name, of this device's tokens;
        None without): the train step's figures come from its own forward, no second one
        (`dpjax.step`'s `loss_and_stats`)."""
        tokens_BdxTc, targets_BdxTc = context.split(batch_BdxT1[:, :-1], par), context.split(batch_BdxT1[:, 1:], par)
        logits_BdxTcxVm, stat_means = self.forward(params, tokens_BdxTc, par)
        loss = tp.vocab_parallel_cross_entropy(logits_BdxTcxVm, targets_BdxTc, par)
        if stat_means is None:
            return loss, None
        return self.add_stats_loss(loss, stat_means), {name: stat_means[i] for i, name in enumerate(self.stat_names)}

    def mlp_values(self, tokens: int, split: int) -> dict:
        """The MLP's compute-dtype values per token kept for the backward (`activation_bytes`),
        on a device with `tokens` tokens and a model axis of `split`: a plain MLP of d_ff."""
        return dense_mlp_values(self.config.d_ff // split)

    def activation_bytes(self, rows: int, *, remat: str = "none", attention: str = "naive", width: int = 4,
                         split: int = 1, context: int = 1) -> int:
        """The activations' bytes for `rows` sequences per device (`activation_bytes` of the
        module, of this decoder's shape: heads, MLP width and vocabulary split `split` ways)."""
        c = self.config
        return activation_bytes(rows, layers=c.n_layers, d_model=c.d_model, heads=max(1, c.n_heads // split),
                                seq_len=c.seq_len, vocab=c.vocab_size // split,
                                mlp=self.mlp_values(rows * (c.seq_len // context), split), remat=remat,
                                attention=attention, width=width, context=context)
