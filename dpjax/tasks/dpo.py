"""Preference training: DPO and its variants, pairs (chosen, rejected) against a reference.

Rafailov et al., "Direct Preference Optimization: your language model is secretly a reward
model" (2023): with π the policy's and ρ the reference's log-probability of an answer
given its prompt (the sum over the answer's tokens), a pair's loss is

    sigmoid   -log σ(β h),  h = (π_c - ρ_c) - (π_r - ρ_r)          (DPO)
    hinge     max(0, 1 - β h)                                      (SLiC, Zhao et al. 2023)
    ipo       (h̄ - 1 / (2β))²,  h̄: h of log-probs averaged over each answer's tokens, as TRL
              computes it (Azar et al. 2023 write sums)
    simpo     -log σ(β (π_c / |c| - π_r / |r|) - γ): no reference (Meng et al. 2024)

and the step's loss the mean over the pairs of the global batch. Every pair counts alike,
so each device's mean over its own pairs, averaged over the micro-batches and the data
axes as the step does, is that mean: no count is exchanged.

The batch (`dpjax.data.pref.PairStream`), every leaf with the pairs first:
    tokens     B x T+1 int32    the chosen answers' rows (prompt, answer, padding)
    rejected   B x T+1 int32    the rejected answers' rows
    masks      B x 2 x T f32    which targets are answer tokens (chosen, rejected)
    ref        B x 2 f32        ρ_c, ρ_r: the reference's sums, computed before training
                                (`dpjax.train.reference`); zeros for a variant without one
Both rows of a pair go through the model in one forward (2B rows). The log-prob of each
target is vocabulary-parallel (`tensor_parallel.vocab_parallel_nll`): every model rank holds
it whole; with a context axis each device sums its share of each sequence and the shares
are summed over the axis (`_whole`), so the sums are the same on every mesh.

The metrics (averaged over the pairs like the loss): reward_chosen = β(π_c - ρ_c),
reward_rejected = β(π_r - ρ_r) (SimPO: β π / |answer|), margin = their difference,
accuracy = the share of pairs whose margin is > 0.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from dpjax import collectives
from dpjax.collectives.ranks import axis_size
from dpjax.compute import context
from dpjax.compute import tensor_parallel as tp
from dpjax.compute.tensor_parallel import DENSE, Parallel
from dpjax.models.lora import Lora, Split
from dpjax.registry import Registry


@dataclasses.dataclass(frozen=True)
class Variant:
    """A preference loss: `loss(pi_Bx2, ref_Bx2, len_Bx2, beta, gamma) -> per-pair loss B`, with
    (chosen, rejected) in the last dimension; `rewards(...)` the B x 2 implicit rewards the
    metrics report; reference: whether it needs ρ."""

    name: str
    loss: Callable
    rewards: Callable
    reference: bool = True
    about: str = ""


def _dpo_rewards(pi, ref, n, beta):
    return beta * (pi - ref)


def _simpo_rewards(pi, ref, n, beta):
    return beta * pi / n


def _h(r):
    return r[..., 0] - r[..., 1]


VARIANTS: Registry[Variant] = Registry("preference loss")
VARIANTS.register(Variant("sigmoid", lambda pi, ref, n, beta, gamma: -jax.nn.log_sigmoid(beta * _h(pi - ref)),
                          _dpo_rewards, about="DPO: -log sigmoid(beta h)"))
VARIANTS.register(Variant("hinge", lambda pi, ref, n, beta, gamma: jax.nn.relu(1 - beta * _h(pi - ref)),
                          _dpo_rewards, about="SLiC: max(0, 1 - beta h)"))
VARIANTS.register(Variant("ipo", lambda pi, ref, n, beta, gamma: (_h((pi - ref) / n) - 1 / (2 * beta)) ** 2,
                          _dpo_rewards, about="IPO: (h of per-token means - 1/(2 beta))^2"))
VARIANTS.register(Variant("simpo", lambda pi, ref, n, beta, gamma: -jax.nn.log_sigmoid(beta * _h(pi / n) - gamma),
                          _simpo_rewards, reference=False,
                          about="SimPO: -log sigmoid(beta (mean log-prob difference) - gamma), no reference"))


@dataclasses.dataclass(frozen=True)
class Options:
    """What a preference run sets (--dpo-loss, --dpo-beta, --simpo-gamma)."""

    variant: str = "sigmoid"
    beta: float = 0.1
    gamma: float = 0.5
    # --ref-logps online with LoRA: ρ computed in the step from the base; else the batch's ρ
    # (precomputed, or filled each step by the run's frozen copy: dpjax.train.preference.Online)
    online: bool = False

    @classmethod
    def of(cls, settings) -> "Options":
        if settings is None:
            return cls()
        return cls(settings.dpo_loss, settings.dpo_beta, settings.simpo_gamma, settings.ref_logps == "online")


def _whole(x_2Bd, par: Parallel):
    """Per-sequence sums of this device's share of each sequence -> the whole sequences'
    sums (over the context axis), with a gradient that the step's mean over that axis
    (`dpjax.step.gradient.inner_mean`) turns into the whole sum's: each device's own share
    carries n times its gradient, the other shares none (stop_gradient)."""
    if not context.active(par):
        return x_2Bd
    n = axis_size(par.context_axis)
    total = lax.stop_gradient(collectives.allreduce(x_2Bd, par.context_axis))
    return total + n * (x_2Bd - lax.stop_gradient(x_2Bd))


def pair_logps(model, params, batch, par: Parallel = DENSE):
    """(π: B x 2 sums of the answer tokens' log-probs, |answer|: B x 2 their numbers), for
    (chosen, rejected), the two rows of each pair through one forward."""
    chosen_BdxT1, rejected_BdxT1, masks_Bdx2xT = batch["tokens"], batch["rejected"], batch["masks"]
    Bd, T1 = chosen_BdxT1.shape
    assert rejected_BdxT1.shape == (Bd, T1) and masks_Bdx2xT.shape == (Bd, 2, T1 - 1), (
        chosen_BdxT1.shape, rejected_BdxT1.shape, masks_Bdx2xT.shape)
    ids_2BdxT1 = jnp.concatenate([chosen_BdxT1, rejected_BdxT1])
    mask_2BdxT = jnp.concatenate([masks_Bdx2xT[:, 0], masks_Bdx2xT[:, 1]]).astype(jnp.float32)
    inputs_2BdxTc = context.split(ids_2BdxT1[:, :-1], par)
    targets_2BdxTc, mask_2BdxTc = context.split(ids_2BdxT1[:, 1:], par), context.split(mask_2BdxT, par)
    logits_2BdxTcxVm, aux = model.forward(params, inputs_2BdxTc, par)
    assert aux is None, "dpjax.plan refuses --task dpo with experts"
    logp_2BdxTc = -tp.vocab_parallel_nll(logits_2BdxTcxVm, targets_2BdxTc, par)
    sums_2Bd = _whole((logp_2BdxTc * mask_2BdxTc).sum(-1), par)
    lens_2Bd = lax.stop_gradient(_whole(mask_2BdxTc.sum(-1), par))
    return sums_2Bd.reshape(2, Bd).T, lens_2Bd.reshape(2, Bd).T


def reference_of(model):
    """(the reference's model, params -> the reference's parameters, par -> its Parallel):
    a LoRA model's base with the adapters off (`dpjax.models.lora.Split.frozen`: the same
    arrays as the policy's base, no copy); None for a model without adapters."""
    if not isinstance(model, Lora):
        return None
    split = Split(model.LAYERS)

    def parallel(par: Parallel) -> Parallel:  # FSDP gathers the base's leaves only
        return par if par.gather_dims is None else dataclasses.replace(par, gather_dims=split.frozen(par.gather_dims))

    return model.base, split.frozen, parallel


def reference_logps(model, params, batch, par: Parallel = DENSE):
    """ρ: B x 2 (chosen, rejected) answer log-prob sums by the reference: a LoRA model's
    base with its adapters off (`reference_of`), never differentiated."""
    base, frozen, parallel = reference_of(model)
    return lax.stop_gradient(pair_logps(base, frozen(params), batch, parallel(par))[0])


def pair_losses(pi_Bx2, ref_Bx2, len_Bx2, options: Options):
    """(per-pair loss B, the metrics' per-pair figures {name: B}) of one variant."""
    v = VARIANTS[options.variant]
    ref_Bx2 = ref_Bx2 if v.reference else jnp.zeros_like(ref_Bx2)
    # a row whose answer truncation cut away has no tokens: dpjax.data.pref drops such pairs
    n_Bx2 = jnp.maximum(len_Bx2, 1.0)
    losses_B = v.loss(pi_Bx2, ref_Bx2, n_Bx2, options.beta, options.gamma)
    r_Bx2 = lax.stop_gradient(v.rewards(pi_Bx2, ref_Bx2, n_Bx2, options.beta))
    margin_B = r_Bx2[:, 0] - r_Bx2[:, 1]
    return losses_B, {"reward_chosen": r_Bx2[:, 0], "reward_rejected": r_Bx2[:, 1], "margin": margin_B,
                      "accuracy": (margin_B > 0).astype(jnp.float32)}


def loss_and_stats(model, settings=None):
    """(the mean preference loss over this device's pairs, the mean of each metric)."""
    options = Options.of(settings)

    def fn(params, batch, par: Parallel = DENSE):
        pi_Bdx2, len_Bdx2 = pair_logps(model, params, batch, par)
        ref_Bdx2 = batch["ref"].astype(jnp.float32)
        if options.online and VARIANTS[options.variant].reference and reference_of(model) is not None:
            ref_Bdx2 = reference_logps(model, params, batch, par)  # LoRA: the base inside the step
        losses_Bd, figures = pair_losses(pi_Bdx2, ref_Bdx2, len_Bdx2, options)
        return losses_Bd.mean(), {k: v.mean() for k, v in figures.items()}

    return fn


def loss(model, settings=None):
    dpo = loss_and_stats(model, settings)
    return lambda params, batch, par=DENSE: dpo(params, batch, par)[0]
