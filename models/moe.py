"""A mixture-of-experts MLP with its experts split over an `expert` axis (a block's math).

Shazeer et al., "Outrageously large neural networks: the sparsely-gated mixture-of-experts
layer" (ICLR 2017); Lepikhin et al., "GShard" (ICLR 2021); Fedus et al., "Switch
Transformers" (JMLR 2022). Per device, for its N tokens (any batch and time flattened):

    router     logits = x W_r (float32), p = softmax(logits); each token's top k experts,
               their gates p renormalised over the k (k = 1: Switch's raw p)
    capacity   each expert takes at most C = ceil(F N k / E) tokens from a device (F the
               capacity factor); first choices are placed before second ones (GShard's
               priority), in token order; a choice past C is dropped (its gate's share of
               the output is lost, the residual carries the token: `dropped` counts them)
    dispatch   an E x C x D buffer, slot (e, c) the c-th token routed to e; an explicit
               all-to-all over `expert` (`dpjax.collectives.all_to_all`: dpjax's pairwise or
               bruck schedules, or "xla", `lax.all_to_all`, as the baseline) sends expert e's
               slots to the device holding e, which gets n x C tokens for each of its E/n
    experts    each its own GELU MLP (w1_XexDxF: E split over `expert`)
    combine    the all-to-all back, then each token's output is the gate-weighted sum of its
               kept choices' slots

Auxiliary losses (added to the model's loss by the caller with their weights):

    balance    Switch's load-balancing loss E * sum_e f_e P_e, f_e the share of the N k
               choices routed to e, P_e the mean router probability of e (1 when uniform)
    z          the router z-loss mean(logsumexp(logits)^2) (Zoph et al., "ST-MoE", 2022)

Both are computed over a device's own tokens (GShard's groups); the step averages them
over the data axes like the loss. Autodiff of the all-to-all is the all-to-all of the
cotangents, so each device's expert weights get the gradient of every token routed to
them, from every device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dpjax import collectives
from dpjax.collectives.ranks import axis_size
from dpjax.compute import tensor_parallel as tp
from dpjax.compute.tensor_parallel import DENSE, Parallel
from dpjax.models import moe_dropless


def capacity(N: int, E: int, k: int, factor: float) -> int:
    """C: the slots each expert has for one device's N tokens."""
    return max(1, math.ceil(factor * N * k / E))


def activation_values(N: int, D: int, F: int, E: int, k: int, factor: float, remat: str) -> float:
    """Compute-dtype values per token that one MoE MLP keeps for the backward pass on a
    device with N tokens (the planner's memory estimate; the dense MLP's are 6F, F, 0).
    The device computes E C slots (E/n experts x n sources x C, whatever n), about
    k x factor a token: each slot keeps its expert's 6F as a dense token does (F under
    remat dots, the first matmul's output, and the second's D); the dispatch keeps its
    buffers before and after each of the two all-to-alls (4 D a slot) and the k chosen
    rows sent and gathered (2 k D a token)."""
    slots = E * capacity(N, E, k, factor) / N
    return {"none": slots * (6 * F + 4 * D) + 2 * k * D, "dots": slots * (F + D), "full": 0.0}[remat]


def route(x_NxD, router_DxX, k: int, normalize: bool | None = None):
    """(gates N x k, experts N x k, balance loss, z loss) of the softmax top-k router;
    normalize: the k gates renormalised to sum to 1 (Mixtral's always, Qwen3-MoE's
    `norm_topk_prob`; None: for k > 1, Switch's raw probability for k = 1)."""
    logits_NxX = x_NxD.astype(jnp.float32) @ router_DxX.astype(jnp.float32)
    p_NxX = jax.nn.softmax(logits_NxX, axis=-1)
    gates, chosen = jax.lax.top_k(p_NxX, k)
    if (k > 1) if normalize is None else normalize:
        gates = gates / gates.sum(-1, keepdims=True)
    E = router_DxX.shape[1]
    f_X = jax.nn.one_hot(chosen, E, dtype=jnp.float32).sum((0, 1)) / chosen.size
    balance = E * jnp.sum(f_X * p_NxX.mean(0))
    z = jnp.mean(jax.nn.logsumexp(logits_NxX, axis=-1) ** 2)
    return gates, chosen, balance, z


def slots(chosen, E: int, C: int):
    """(slot N x k, kept N x k): each choice's place in its expert's buffer, first choices
    of all tokens before second ones, and whether it is within the capacity C."""
    N, k = chosen.shape
    onehot = jax.nn.one_hot(chosen.T.reshape(-1), E, dtype=jnp.int32)  # choice-major order
    before = jnp.cumsum(onehot, axis=0) - onehot
    slot = jnp.sum(before * onehot, axis=-1).reshape(k, N).T
    return slot, slot < C


def experts_mlp(x_XexTxD, p: dict, act: str = "gelu", einsum=jnp.einsum):
    """Each local expert's MLP on its T slots: GELU with biases (w1, b1, w2, b2: the GPT's)
    or SwiGLU (wgate, wup, wdown: Mixtral's, Qwen3-MoE's); `einsum`: the compute policy's
    (fp8 under --dtype fp8)."""
    mm = lambda x, w: einsum("etd,edf->etf", x, w)  # noqa: E731
    if act == "swiglu":
        return mm(jax.nn.silu(mm(x_XexTxD, p["wgate_XexDxF"])) * mm(x_XexTxD, p["wup_XexDxF"]), p["wdown_XexFxD"])
    h_XexTxF = jax.nn.gelu(mm(x_XexTxD, p["w1_XexDxF"]) + p["b1_XexF"][:, None])
    return mm(h_XexTxF, p["w2_XexFxD"]) + p["b2_XexD"][:, None]


FORMS = ("capacity", "dropless")  # --moe: what an expert does with more tokens than it has slots for


def moe_mlp(x_NxD, p: dict, *, k: int, capacity_factor: float, axis=None, algorithm: str = "pairwise",
            einsum=jnp.einsum, form: str = "capacity", act: str = "gelu", normalize: bool | None = None,
            grouped: str | None = None):
    """(y N x D, {'balance', 'z', 'dropped', 'choices'}) of the MoE MLP on this device's
    tokens; `p` holds router_DxX (whole) and this device's E/n experts (`experts_mlp`'s
    leaves for `act`). axis: the expert axis inside a shard_map (None: every expert here);
    algorithm: the all-to-all's (`dpjax.collectives.ALL_TO_ALL_ALGORITHMS`); einsum: the
    capacity form's expert matmuls' (`Policy.einsum`: fp8 under --dtype fp8); form:
    `capacity` (this module) or `dropless` (`moe_dropless`: no choice dropped, its grouped
    matmul `grouped`, default for the backend); normalize: `route`'s."""
    N, D = x_NxD.shape
    E, El = p["router_DxX"].shape[1], p["w1_XexDxF" if act == "gelu" else "wgate_XexDxF"].shape[0]
    n = axis_size(axis, "the experts' all-to-all") if axis is not None else 1
    assert E == El * n and p["router_DxX"].shape == (D, E), (p["router_DxX"].shape, El, n)
    gates, chosen, balance, z = route(x_NxD, p["router_DxX"], k, normalize)
    if form == "dropless":
        y_NxD = moe_dropless.dropless(x_NxD, gates, chosen, p, act=act, axis=axis, n=n, algorithm=algorithm,
                                      form=grouped)
        return y_NxD, {"balance": balance, "z": z, "dropped": jnp.zeros((), jnp.int32), "choices": chosen.size}
    assert form == "capacity", form
    C = capacity(N, E, k, capacity_factor)
    slot, kept = slots(chosen, E, C)
    slot = jnp.where(kept, slot, 0)  # a dropped choice writes nothing and reads nothing
    sent = jnp.where(kept[..., None], x_NxD[:, None, :], 0).astype(x_NxD.dtype)
    buf_XxNxD = jnp.zeros((E, C, D), x_NxD.dtype).at[chosen, slot].add(sent)
    if n > 1:  # expert e's slots to the device holding it: n sources x E/n experts x C slots
        buf_XxNxD = collectives.all_to_all(buf_XxNxD, axis, algorithm=algorithm)
    x_XexNxD = buf_XxNxD.reshape(n, El, C, D).transpose(1, 0, 2, 3).reshape(El, n * C, D)
    y_XexNxD = experts_mlp(x_XexNxD, p, act, einsum)
    y_XxNxD = y_XexNxD.reshape(El, n, C, D).transpose(1, 0, 2, 3).reshape(E, C, D)
    if n > 1:  # and back: each source gets its tokens' outputs, in expert order
        y_XxNxD = collectives.all_to_all(y_XxNxD, axis, algorithm=algorithm)
    weight = jnp.where(kept, gates, 0.0).astype(y_XxNxD.dtype)
    y_NxD = jnp.einsum("nk,nkd->nd", weight, y_XxNxD[chosen, slot])
    stats = {"balance": balance, "z": z, "dropped": jnp.sum(~kept), "choices": kept.size}
    return y_NxD, stats


class Mixture:
    """A block's MLP as a mixture of experts (a GPT's `mlp` part with `experts` > 0): its
    leaves stacked over the layers like the dense MLP's, E split over `expert` and each
    expert whole (replicated over `model`); every model rank computes it whole. It reports
    the router's statistics, which the decoder sums over the layers and adds to the loss
    with the config's weights. `config`: the model's (d_model, d_ff, n_layers, experts,
    top_k, capacity_factor, router_aux_weight, router_z_weight)."""

    stat_names = ("router_balance", "router_z", "dropped")
    SPECS = {"router_LsxDxX": P("stage", None, None), "w1_LsxXexDxF": P("stage", "expert", None, None),
             "b1_LsxXexF": P("stage", "expert", None), "w2_LsxXexFxD": P("stage", "expert", None, None),
             "b2_LsxXexD": P("stage", "expert", None)}
    _NAMES = {"router_DxX": "router_LsxDxX", "w1_XexDxF": "w1_LsxXexDxF", "b1_XexF": "b1_LsxXexF",
              "w2_XexFxD": "w2_LsxXexFxD", "b2_XexD": "b2_LsxXexD"}  # moe_mlp's names -> the stacked leaves'

    act = "gelu"  # the experts' MLP (`experts_mlp`): GELU with biases; SwiGLU in models/mixtral.py

    def __init__(self, config):
        self.config = config

    @property
    def normalize(self) -> bool | None:
        """`route`'s: the GPT's rule (renormalised for k > 1)."""
        return None

    def init(self, stacked, layer_key) -> dict:
        """Each expert's matrices drawn as the dense MLP's are, one key per layer and matrix
        (`stacked(j, shape, scale)`: layer i's from its key j); the router from its own key,
        folded from w1's (`layer_key(i, 2)`)."""
        c, L = self.config, self.config.n_layers
        D, F, E, std, out_std = c.d_model, c.d_ff, c.experts, 0.02, 0.02 / math.sqrt(2 * L)
        router = jnp.stack([std * jax.random.normal(jax.random.fold_in(layer_key(i, 2), E), (D, E))
                            for i in range(L)])
        return {"router_LsxDxX": router,
                "w1_LsxXexDxF": stacked(2, (E, D, F), std), "b1_LsxXexF": jnp.zeros((L, E, F)),
                "w2_LsxXexFxD": stacked(3, (E, F, D), out_std), "b2_LsxXexD": jnp.zeros((L, E, D))}

    def __call__(self, m, h_BdxTxD, par: Parallel = DENSE):
        """(the mixture's output on this device's tokens, (balance loss, z loss, share of
        the choices dropped)); its experts split over the expert axis (all here without one)."""
        c, (B, T, D) = self.config, h_BdxTxD.shape
        axis = par.expert_axis if tp._active(par.expert_axis) else None
        y_NxD, stats = moe_mlp(h_BdxTxD.reshape(B * T, D), {k: m[v] for k, v in self._NAMES.items()}, k=c.top_k,
                               capacity_factor=c.capacity_factor, axis=axis,
                               algorithm=par.policy.expert_alltoall, einsum=par.policy.einsum, form=c.moe,
                               act=self.act, normalize=self.normalize)
        y_BdxTxD = y_NxD.reshape(B, T, D)
        dropped = jax.lax.stop_gradient(stats["dropped"] / stats["choices"])
        return y_BdxTxD, (stats["balance"], stats["z"], dropped)

    def add_loss(self, loss, stats_3):
        """The loss with Switch's balance loss and the z loss at the config's weights."""
        return loss + self.config.router_aux_weight * stats_3[0] + self.config.router_z_weight * stats_3[1]

    def values(self, tokens: int, split: int) -> dict:
        """Its values per token for the memory estimate (`activation_values`), for remat none
        and dots. Dropless: counted as capacity factor 2 (the segment form's tiles pad each
        expert's rows to at most twice the mean), an estimate no test holds to the compiled
        program yet; over an expert axis its receive buffer is n min(k, E/n) rows a token."""
        c = self.config
        factor = 2.0 if c.moe == "dropless" else c.capacity_factor
        return {r: activation_values(tokens, c.d_model, c.d_ff, c.experts, c.top_k, factor, r)
                for r in ("none", "dots")}

    def matmul_params(self) -> int:
        """The matmul parameters a token uses: its k experts' and the router's."""
        c = self.config
        return 2 * c.d_model * c.d_ff * c.top_k + c.d_model * c.experts
