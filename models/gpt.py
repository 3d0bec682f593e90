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
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dpjax import collectives
from dpjax.compute import attention, context, stack
from dpjax.compute import tensor_parallel as tp
from dpjax.errors import UserError
from dpjax.models import moe
from dpjax.models.registry import Entry, register
from dpjax.compute.tensor_parallel import DENSE, Parallel


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

    def __post_init__(self):
        check_positive(self, "GPT", skip=MOE_OPTIONS)
        if self.d_model % self.n_heads:
            raise UserError(f"GPT d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.experts < 0 or self.capacity_factor <= 0 or min(self.router_aux_weight, self.router_z_weight) < 0:
            raise UserError(f"GPT experts {self.experts}, capacity_factor {self.capacity_factor} and the router "
                            f"weights must not be negative (a capacity factor above 0)")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise UserError(f"GPT top_k={self.top_k} must be between 1 and experts={self.experts}")


MOE_OPTIONS = ("experts", "top_k", "capacity_factor", "router_aux_weight", "router_z_weight")


def check_positive(config, kind: str, skip: tuple = ()) -> None:
    for name, value in asdict(config).items():
        if name not in skip and value < 1:
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


def layer_norm(x, scale, bias, eps: float = 1e-5):
    """Layer norm with its statistics in float32 whatever `x`'s dtype; the result in `x`'s dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)


causal_attention = attention.naive  # the readable kernel (dpjax.compute.attention has the switch)


def cross_entropy(logits_BdxTxV, targets_BdxT):
    """Mean next-byte cross-entropy of whole (unsplit) logits."""
    logp = jax.nn.log_softmax(logits_BdxTxV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets_BdxT[..., None], axis=-1).mean()


class GPT(ByteModel):
    """Every matmul is a dpjax.compute.tensor_parallel layer: with the model axis of size n, each
    device holds 1/n of the heads, of the MLP width and of the vocabulary.

    The blocks are stacked: every leaf under `blocks` carries a leading layer axis L
    (`w1_LsxDxFm` is L x D x F), which a `stage` axis splits (`Ls`): stage s holds layers
    s*L/S .. (s+1)*L/S - 1 (`dpjax.pipeline`). The parameter tree is the same on every
    mesh, so a checkpoint resumes on another stage count. For a pipeline the model is cut
    into `embed` (first stage), `layer` (L times) and `head_loss` (last stage)."""

    name = "gpt"
    CONTEXT = True  # its loss splits each sequence over a context axis (dpjax.compute.context)
    LAYERS = "blocks"  # the key of the stacked layers, which a pipeline divides over `stage`
    # The one sharding table (Megatron-LM layout), by leaf name; dimensions not named are
    # replicated. FSDP adds the data axes on top (dpjax.sharding.make_layout).
    SPECS = {
        "embed_VmxD": P("model", None),  # vocabulary-parallel embedding and (tied) output head
        "pos_TxD": P(),
        "scale_D": P(), "bias_D": P(),  # the final layer norm
        "scale_LsxD": P("stage", None), "bias_LsxD": P("stage", None),  # the blocks' layer norms
        "wqkv_LsxDx3xHmxK": P("stage", None, None, "model", None),  # heads split: column-parallel
        "wo_LsxHmxKxD": P("stage", "model", None, None),  # heads split: row-parallel
        "w1_LsxDxFm": P("stage", None, "model"), "b1_LsxFm": P("stage", "model"),  # column-parallel
        "w2_LsxFmxD": P("stage", "model", None), "b2_LsxD": P("stage", None),  # row-parallel; b2 added after g
        # with experts (dpjax.models.moe): E split over `expert`, each expert whole (replicated over `model`)
        "router_LsxDxX": P("stage", None, None), "w1_LsxXexDxF": P("stage", "expert", None, None),
        "b1_LsxXexF": P("stage", "expert", None), "w2_LsxXexFxD": P("stage", "expert", None, None),
        "b2_LsxXexD": P("stage", "expert", None),
    }

    def init(self, key):
        c = self.config
        D, F, H, K, L = c.d_model, c.d_ff, c.n_heads, c.d_model // c.n_heads, c.n_layers
        std, out_std = 0.02, 0.02 / math.sqrt(2 * L)
        keys = jax.random.split(key, 2 + 4 * L)

        def stacked(j, shape, scale):  # layer i draws from keys[2 + 4i + j], whatever L is split into
            return jnp.stack([scale * jax.random.normal(keys[2 + 4 * i + j], shape) for i in range(L)])

        ln = lambda: {"scale_LsxD": jnp.ones((L, D)), "bias_LsxD": jnp.zeros((L, D))}  # noqa: E731
        E = c.experts
        if E:  # each expert's matrices drawn as the dense MLP's are, one key per layer and matrix
            router = jnp.stack([std * jax.random.normal(jax.random.fold_in(keys[4 + 4 * i], E), (D, E))
                                for i in range(L)])  # its own key, folded from w1's
            mlp = {"router_LsxDxX": router,
                   "w1_LsxXexDxF": stacked(2, (E, D, F), std), "b1_LsxXexF": jnp.zeros((L, E, F)),
                   "w2_LsxXexFxD": stacked(3, (E, F, D), out_std), "b2_LsxXexD": jnp.zeros((L, E, D))}
        else:
            mlp = {"w1_LsxDxFm": stacked(2, (D, F), std), "b1_LsxFm": jnp.zeros((L, F)),
                   "w2_LsxFmxD": stacked(3, (F, D), out_std), "b2_LsxD": jnp.zeros((L, D))}
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

    # The pieces below compute with parameters ready to use (under FSDP: gathered; `logits`
    # gathers them, a pipeline gathers a stage's once per step).

    def embed(self, params, tokens_BdxT, par: Parallel = DENSE):
        """Token plus position embeddings (the first stage's work): Bd x T x D."""
        c, T = self.config, tokens_BdxT.shape[1]
        assert T <= c.seq_len and params["embed_VmxD"].shape == (c.vocab_size // par.size(), c.d_model), (
            tokens_BdxT.shape, params["embed_VmxD"].shape, par.size())  # this device's blocks
        embed_VmxD, pos_TxD = par.policy.cast((params["embed_VmxD"], params["pos_TxD"]))
        # with a context axis this device's tokens are chunks of the sequence: their global positions
        pos_TcxD = pos_TxD[context.positions(T, par)] if context.active(par) else pos_TxD[:T]
        return tp.vocab_parallel_embed(tokens_BdxT, embed_VmxD, par) + pos_TcxD

    def layer(self, blk, x_BdxTxD, par: Parallel = DENSE):
        """One pre-LN transformer block; `blk` is one layer of the stack (its leaves without
        the leading L: `w1_LsxDxFm` is D x Fm here). With experts the carry is (x, the
        router statistics summed so far: balance loss, z loss, share of choices dropped)
        and so is the result."""
        a, m, c, n = blk["attn"], blk["mlp"], self.config, par.size()
        if c.experts:
            x_BdxTxD, aux_3 = x_BdxTxD
        D, H = c.d_model, c.n_heads
        assert x_BdxTxD.shape[-1] == D and a["wqkv_LsxDx3xHmxK"].shape == (D, 3, H // n, D // H), (
            x_BdxTxD.shape, a["wqkv_LsxDx3xHmxK"].shape, n)  # this device's heads
        h_BdxTxD = layer_norm(x_BdxTxD, blk["ln1"]["scale_LsxD"], blk["ln1"]["bias_LsxD"])
        x_BdxTxD = x_BdxTxD + tp.head_parallel_attention(h_BdxTxD, a["wqkv_LsxDx3xHmxK"], a["wo_LsxHmxKxD"],
                                                         context.kernel(par), par)
        h_BdxTxD = layer_norm(x_BdxTxD, blk["ln2"]["scale_LsxD"], blk["ln2"]["bias_LsxD"])
        if c.experts:
            y_BdxTxD, stats = self.mixture(m, h_BdxTxD, par)
            dropped = jax.lax.stop_gradient(stats["dropped"] / stats["choices"])
            return x_BdxTxD + y_BdxTxD, aux_3 + jnp.stack([stats["balance"], stats["z"], dropped])
        assert m["w1_LsxDxFm"].shape == (D, c.d_ff // n), (m["w1_LsxDxFm"].shape, n)  # this device's columns
        h_BdxTxFm = jax.nn.gelu(tp.column_parallel(h_BdxTxD, m["w1_LsxDxFm"], m["b1_LsxFm"], par))
        return x_BdxTxD + tp.row_parallel(h_BdxTxFm, m["w2_LsxFmxD"], m["b2_LsxD"], par)

    def mixture(self, m, h_BdxTxD, par: Parallel = DENSE):
        """The block's mixture of experts on this device's tokens (`dpjax.models.moe`): its
        experts split over the expert axis (all here without one); every model rank
        computes it whole. (output, the layer's router statistics)."""
        c, (B, T, D) = self.config, h_BdxTxD.shape
        axis = par.expert_axis if tp._active(par.expert_axis) else None
        names = {"router_DxX": "router_LsxDxX", "w1_XexDxF": "w1_LsxXexDxF", "b1_XexF": "b1_LsxXexF",
                 "w2_XexFxD": "w2_LsxXexFxD", "b2_XexD": "b2_LsxXexD"}
        y_NxD, stats = moe.moe_mlp(h_BdxTxD.reshape(B * T, D), {k: m[v] for k, v in names.items()}, k=c.top_k,
                                   capacity_factor=c.capacity_factor, axis=axis,
                                   algorithm=par.policy.expert_alltoall, einsum=par.policy.einsum)
        return y_NxD.reshape(B, T, D), stats

    def head(self, params, x_BdxTxD, par: Parallel = DENSE):
        """Final layer norm and the tied output head (the last stage's work): Bd x T x Vm,
        float32 whatever the compute dtype (the logits are a numerically sensitive part:
        `dpjax.compute.policy`)."""
        assert x_BdxTxD.shape[-1] == self.config.d_model, x_BdxTxD.shape
        x_BdxTxD = layer_norm(x_BdxTxD, params["ln_f"]["scale_D"], params["ln_f"]["bias_D"]).astype(jnp.float32)
        return tp.column_parallel(x_BdxTxD, params["embed_VmxD"].T.astype(jnp.float32), None, par)  # tied head

    def head_loss(self, params, x_BdxTxD, targets_BdxT, par: Parallel = DENSE):
        """Vocabulary-parallel cross-entropy of the head's logits: the full logits are never gathered."""
        return tp.vocab_parallel_cross_entropy(self.head(params, x_BdxTxD, par), targets_BdxT, par)

    def logits(self, params, tokens_BdxT, par: Parallel = DENSE):
        """This shard's slice of the logits, Bd x T x Vm (all of them when dense); with a
        context axis `tokens_BdxT` are this device's chunks (`context.split`)."""
        return self.forward(params, tokens_BdxT, par)[0]

    def forward(self, params, tokens_BdxT, par: Parallel = DENSE):
        """(`logits`, the router statistics (balance loss, z loss, share of the choices dropped)
        averaged over the layers; None without experts)."""
        outer = {k: par.use(v, k) for k, v in params.items() if k != self.LAYERS}
        x_BdxTxD = self.embed(outer, tokens_BdxT, par)
        carry = (x_BdxTxD, jnp.zeros(3, jnp.float32)) if self.config.experts else x_BdxTxD
        # dpjax.compute.stack: scanned, rematerialised by the policy, FSDP gathering one layer at a time
        carry = stack.run(self.layer, params[self.LAYERS], carry, par, path=(self.LAYERS,))
        x_BdxTxD, aux_3 = carry if self.config.experts else (carry, None)
        return self.head(outer, x_BdxTxD, par), None if aux_3 is None else aux_3 / self.config.n_layers

    def apply(self, params, tokens_BdxT, par: Parallel = DENSE):
        """The full logits (dense; with a model axis, gathered: for inspection, not training;
        with a context axis, of this device's tokens, `context.split`'s)."""
        logits = self.logits(params, tokens_BdxT, par)
        if par.model_axis is None:
            return logits
        return jnp.moveaxis(collectives.all_gather(jnp.moveaxis(logits, -1, 0), par.model_axis), 0, -1)

    def loss(self, params, batch_BdxT1, par: Parallel = DENSE):
        """Vocabulary-parallel cross-entropy: the full logits are never gathered. With a
        context axis, the mean over this device's share of the tokens (`dpjax.compute.context`:
        the step averages it over the axis)."""
        return self.loss_and_stats(params, batch_BdxT1, par)[0]

    def loss_and_stats(self, params, batch_BdxT1, par: Parallel = DENSE):
        """(`loss`, the router statistics of the same forward: {'router_balance', 'router_z',
        'dropped'} of this device's tokens; None without experts): the train step's figures
        come from its own forward, no second one (`dpjax.step`'s `loss_and_stats`)."""
        tokens_BdxTc, targets_BdxTc = context.split(batch_BdxT1[:, :-1], par), context.split(batch_BdxT1[:, 1:], par)
        logits_BdxTcxVm, aux_3 = self.forward(params, tokens_BdxTc, par)
        loss = tp.vocab_parallel_cross_entropy(logits_BdxTcxVm, targets_BdxTc, par)
        if aux_3 is None:
            return loss, None
        loss = loss + self.config.router_aux_weight * aux_3[0] + self.config.router_z_weight * aux_3[1]
        return loss, _named(aux_3)

    def activation_bytes(self, rows: int, *, remat: str = "none", attention: str = "naive", width: int = 4,
                         split: int = 1, context: int = 1) -> int:
        """Bytes of activations the backward pass of `rows` sequences keeps (an estimate,
        per device): each layer keeps what the remat policy saves, a layer being
        recomputed holds its whole working set once, and the ends of the model keep the
        embeddings and the float32 logits. `width`: bytes of a compute-dtype value (4 on
        CPU, where XLA computes bfloat16 in float32); the attention's scores and
        probabilities are float32 (naive, xla: heads x T per token; cudnn's flash kernel
        keeps a float32 log-sum-exp per head instead). `split`: the model axis's size
        (heads, MLP width and vocabulary split; the model width not). `context`: the context
        axis's size: a device holds T/context tokens of each sequence (each row's scores
        still span the T keys: ring attention keeps them block by block for its backward).

        Per token and layer, in compute-dtype values: none keeps about 12 D + 6 F (the
        norms' inputs and outputs, Q K V, the attention and projection outputs, the MLP's
        pre- and post-GELU values), dots keeps the matmul outputs 6 D + F (Q K V 3 D, the
        attention output, the two projections' D each, the first MLP matmul's F), full the
        layer's input D. The coefficients were fitted to XLA's buffer assignment on CPU
        (`memory_analysis()`, layers 2 and 4 apart); tests/test_memory.py holds the
        estimate to the compiled program. With experts the MLP's terms are its slots'
        (`moe.activation_values`: k x capacity factor a token, and the dispatch buffers)."""
        c = self.config
        D, F, H, T, V = c.d_model, c.d_ff // split, max(1, c.n_heads // split), c.seq_len, c.vocab_size // split
        scores = 2 * H * T * 4 if attention in ("naive", "xla") else H * 4
        mlp = {"none": 6 * F, "dots": F}  # a mixture's: its slots' (experts are whole on a model rank)
        if c.experts:
            mlp = {r: moe.activation_values(rows * (T // context), D, c.d_ff, c.experts, c.top_k, c.capacity_factor,
                                            r) for r in mlp}
        full_layer = (12 * D + mlp["none"]) * width + scores
        saved = {"none": full_layer, "dots": (6 * D + mlp["dots"]) * width, "full": D * width}[remat]
        working = {"none": 0.5, "dots": 0.6, "full": 1.0}[remat] * full_layer  # the layer being recomputed
        ends = (2 * V + 2 * D) * 4
        return int(rows * (T // context) * (c.n_layers * saved + working + ends))

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 * matmul parameters + attention (Kaplan et al. 2020);
        with experts, the active ones: a token's k experts and the router."""
        c = self.config
        mlp = 2 * c.d_model * c.d_ff * (c.top_k if c.experts else 1) + c.d_model * c.experts  # active: k experts
        matmul = c.n_layers * (4 * c.d_model**2 + mlp) + c.vocab_size * c.d_model
        attention = c.n_layers * 4 * c.seq_len * c.d_model  # QK^T and PV: forward FLOPs per token
        return 6 * matmul + 3 * attention


def _named(aux_3) -> dict:
    """The router statistics carried through the layers (a vector of 3) by name."""
    return {"router_balance": aux_3[0], "router_z": aux_3[1], "dropped": aux_3[2]}


register(Entry("gpt", GPT, GPTConfig))

