"""GRPO's arithmetic (`dpjax.tasks.grpo`) against numpy written from the papers' formulas: the
group-normalised advantages, the clipped objective with its KL term (value and gradient with
respect to the policy's log-probs: a clipped token gives none), both aggregations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.tasks import grpo

P, G, T = 3, 4, 7


def numpy_advantages(r, G, scale=True, eps=1e-4):
    out = np.empty_like(r)
    for p in range(len(r) // G):
        g = r[p * G:(p + 1) * G]
        out[p * G:(p + 1) * G] = (g - g.mean()) / ((g.std(ddof=1) + eps) if scale else 1.0)
    return out


def batch(seed=0):
    rng = np.random.default_rng(seed)
    N = P * G
    old = -rng.uniform(0.1, 3, (N, T))
    logp = old + rng.normal(0, 0.3, (N, T))  # ratios from about 0.4 to 2.5: both sides clip
    ref = old + rng.normal(0, 0.2, (N, T))
    mask = np.ones((N, T))
    for i, n in enumerate(rng.integers(1, T + 1, N)):
        mask[i, n:] = 0
    rewards = rng.integers(0, 2, N).astype(np.float64) + rng.normal(0, 0.1, N)
    return logp, old, ref, mask, rewards


def numpy_objective(logp, old, ref, adv, mask, eps_low, eps_high, beta, aggregate):
    """(loss, d loss / d logp) as float64 numpy."""
    ratio = np.exp(logp - old)
    a = adv[:, None]
    unclipped, clipped = ratio * a, np.clip(ratio, 1 - eps_low, 1 + eps_high) * a
    took_clipped = clipped < unclipped
    q = ref - logp
    per_token = -np.minimum(unclipped, clipped) + beta * (np.exp(q) - q - 1)
    d_token = np.where(took_clipped, 0.0, -ratio * a) + beta * (1 - np.exp(q))
    if aggregate == "sequence":
        w = mask / mask.sum(1, keepdims=True) / len(mask)
    else:
        w = mask / mask.sum()
    return (per_token * w).sum(), d_token * w, (took_clipped * mask).sum() / mask.sum()


def test_group_advantages_against_numpy():
    rewards = batch()[4]
    for scale in (True, False):
        got = grpo.group_advantages(jnp.asarray(rewards, jnp.float32), G, scale=scale)
        np.testing.assert_allclose(got, numpy_advantages(rewards, G, scale), rtol=1e-5, atol=1e-5)
    same = grpo.group_advantages(jnp.full(P * G, 0.7), G)  # a group that all agree: no signal, not NaN
    np.testing.assert_array_equal(same, np.zeros(P * G))


@pytest.mark.parametrize("aggregate", grpo.AGGREGATES)
def test_clipped_objective_and_its_gradient_against_numpy(aggregate):
    logp, old, ref, mask, rewards = batch(1)
    adv = numpy_advantages(rewards, G)
    eps_low, eps_high, beta = 0.2, 0.28, 0.04
    want, want_grad, want_clip = numpy_objective(logp, old, ref, adv, mask, eps_low, eps_high, beta, aggregate)
    assert 0.05 < want_clip < 0.95  # the case holds clipped and unclipped tokens

    def loss(lp):
        return grpo.objective(lp, jnp.asarray(old, jnp.float32), jnp.asarray(ref, jnp.float32),
                              jnp.asarray(adv, jnp.float32), jnp.asarray(mask), eps_low, eps_high, beta, aggregate)

    (got, figures), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp, jnp.float32))
    assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    assert float(figures["clip_fraction"]) == pytest.approx(want_clip, rel=1e-6)
    q = ref - logp
    assert float(figures["kl"]) == pytest.approx(((np.exp(q) - q - 1) * mask).sum() / mask.sum(), rel=1e-4)


def test_on_policy_first_step_is_minus_the_mean_advantage():
    """The first optimizer step of a generation batch (logp = old = ref): the loss is -mean A
    (0 after group normalisation) and each token's gradient -A_i / (its completion's length N)."""
    logp, _, _, mask, rewards = batch(2)
    adv = numpy_advantages(rewards, G)
    lp = jnp.asarray(logp, jnp.float32)
    (got, figures), grad = jax.value_and_grad(
        lambda x: grpo.objective(x, lp, lp, jnp.asarray(adv, jnp.float32), jnp.asarray(mask)), has_aux=True)(lp)
    assert abs(float(got)) < 1e-6 and float(figures["kl"]) == 0 and float(figures["clip_fraction"]) == 0
    np.testing.assert_allclose(grad, -adv[:, None] * mask / mask.sum(1, keepdims=True) / len(mask), rtol=1e-5,
                               atol=1e-8)
