"""GRPO's arithmetic: group-normalised advantages and the clipped objective with a KL term.

Shao et al., "DeepSeekMath" (2024), section 4.1: for each prompt a group of G completions is
sampled and scored; a completion's advantage is its reward normalised within its group,

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)      (std with G - 1, as TRL computes it;
                                                            scale=False: Dr. GRPO's r_i - mean)

and every token t of completion i is trained by PPO's clipped surrogate (Schulman et al. 2017)
with a KL penalty to the reference (the k3 estimator, Schulman 2020, always >= 0):

    ratio = exp(logp - logp_old)
    l_t   = -min(ratio A_i, clip(ratio, 1 - eps_low, 1 + eps_high) A_i) + kl_coef (exp(q) - q - 1),
            q = logp_ref - logp

averaged over each completion's tokens, then over the completions (the paper's mean of means;
aggregate="token": over every completion token of the batch at once, as DAPO does).

The functions below are pure functions of arrays (jax.numpy); `loss_and_stats` is the task
`--task grpo` registers: the loop that samples the groups with the KV-cache generator, scores
them and computes the old and reference log-probs is `dpjax.train.rollout`. Its batch, every
leaf with the completions first (N = prompts x G rows, T = --seq-len targets):

    tokens   N x T+1 int32   prompt, completion, padding
    weights  N x T   f32     mask x T / |completion|: a completion token's share of its row's mean
    adv      N       f32     the group-normalised advantages
    ref      N x T   f32     the reference's log-probs of the targets (with --kl-coef > 0)
    old      N x T   f32     the sampling policy's (with --grpo-updates > 1; else the current
                             log-probs, stopped: the ratio is 1 and its gradient A's)

Each device's loss is the plain mean over its slots of weight x l_t: the step's averages
over the data axes' devices make it the mean over the completions of each one's token mean
("sequence" below), the same on every mesh and with no count exchanged.
Shapes: N completions (N = P prompts x G), T completion tokens, mask N x T (1: a completion
token, 0: padding).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from dpjax.compute import tensor_parallel as tp
from dpjax.compute.tensor_parallel import DENSE, Parallel

AGGREGATES = ("sequence", "token")


def group_advantages(rewards_N, group_size: int, scale: bool = True, eps: float = 1e-4):
    """Each completion's reward less its group's mean (over `group_size` consecutive
    completions), over the group's standard deviation (G - 1 in its denominator) + eps."""
    N = rewards_N.shape[0]
    assert group_size > 1 and N % group_size == 0, (N, group_size)  # dpjax.plan refuses G = 1 (no baseline)
    grouped = rewards_N.astype(jnp.float32).reshape(N // group_size, group_size)  # prompts x group_size
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (grouped.std(axis=1, ddof=1, keepdims=True) + eps)
    return centred.reshape(N)


def kl_k3(logp_NxT, ref_logp_NxT):
    """The k3 estimate of KL(policy || reference) per token: exp(q) - q - 1, q = ref - policy."""
    q = ref_logp_NxT - logp_NxT
    return jnp.exp(q) - q - 1


def token_losses(logp_NxT, old_logp_NxT, ref_logp_NxT, adv_N, clip_eps: float = 0.2,
                 clip_eps_high: float | None = None, kl_coef: float = 0.04):
    """(l_t: N x T per-token loss, whether each token's ratio was clipped: N x T bool)."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = jnp.exp(logp_NxT - old_logp_NxT)
    a = adv_N[:, None]
    unclipped, clipped = ratio * a, jnp.clip(ratio, 1 - clip_eps, 1 + high) * a
    loss = -jnp.minimum(unclipped, clipped)
    if kl_coef:
        loss = loss + kl_coef * kl_k3(logp_NxT, ref_logp_NxT)
    return loss, clipped < unclipped  # the min took the clipped term: this token's ratio has no gradient


def objective(logp_NxT, old_logp_NxT, ref_logp_NxT, adv_N, mask_NxT, clip_eps: float = 0.2,
              clip_eps_high: float | None = None, kl_coef: float = 0.04, aggregate: str = "sequence"):
    """(the GRPO loss, {"kl": mean k3 per token, "clip_fraction": the share of tokens clipped})."""
    assert aggregate in AGGREGATES, aggregate
    mask = mask_NxT.astype(jnp.float32)
    loss_NxT, clipped_NxT = token_losses(logp_NxT, old_logp_NxT, ref_logp_NxT, adv_N, clip_eps, clip_eps_high,
                                         kl_coef)
    if aggregate == "sequence":
        loss = ((loss_NxT * mask).sum(1) / jnp.maximum(mask.sum(1), 1.0)).mean()
    else:
        loss = (loss_NxT * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    n = jnp.maximum(mask.sum(), 1.0)
    return loss, {"kl": (kl_k3(logp_NxT, ref_logp_NxT) * mask).sum() / n,
                  "clip_fraction": (clipped_NxT * mask).sum() / n}


@dataclasses.dataclass(frozen=True)
class Options:
    """What a GRPO run sets (--clip-eps, --kl-coef)."""

    clip_eps: float = 0.2
    kl_coef: float = 0.04

    @classmethod
    def of(cls, settings) -> "Options":
        return cls() if settings is None else cls(settings.clip_eps, settings.kl_coef)


def token_logps(model, params, tokens_BdxT1, par: Parallel = DENSE):
    """Bd x T log-probs of each row's targets (tokens[:, 1:]) given the tokens before them,
    the vocabulary parallel over `model` (every model rank holds them whole)."""
    logits_BdxTxVm, aux = model.forward(params, tokens_BdxT1[:, :-1], par)
    assert aux is None, "dpjax.plan refuses --task grpo with experts"
    return -tp.vocab_parallel_nll(logits_BdxTxVm, tokens_BdxT1[:, 1:], par)


def loss_and_stats(model, settings=None):
    """(the clipped objective with the KL term on this device's rows, {kl, clip_fraction})."""
    options = Options.of(settings)

    def fn(params, batch, par: Parallel = DENSE):
        logp_BdxT = token_logps(model, params, batch["tokens"], par)
        w_BdxT, adv_Bd = batch["weights"], batch["adv"]
        assert w_BdxT.shape == logp_BdxT.shape and adv_Bd.shape == logp_BdxT.shape[:1], (w_BdxT.shape, adv_Bd.shape)
        old_BdxT = batch["old"] if "old" in batch else lax.stop_gradient(logp_BdxT)
        ref_BdxT = batch["ref"] if "ref" in batch else lax.stop_gradient(logp_BdxT)  # --kl-coef 0
        loss_BdxT, clipped_BdxT = token_losses(logp_BdxT, old_BdxT, ref_BdxT, adv_Bd, options.clip_eps, None,
                                               options.kl_coef)
        return (loss_BdxT * w_BdxT).mean(), {"kl": lax.stop_gradient(kl_k3(logp_BdxT, ref_BdxT) * w_BdxT).mean(),
                                             "clip_fraction": (clipped_BdxT * w_BdxT).mean()}

    return fn


def loss(model, settings=None):
    grpo = loss_and_stats(model, settings)
    return lambda params, batch, par=DENSE: grpo(params, batch, par)[0]
