"""The mixture-of-experts MLP (`dpjax.models.moe`): its experts split over an `expert`
axis, tokens dispatched and combined by dpjax's all-to-all (and lax's), against every
expert on one device (outputs and gradients, no drops), and the router's losses and the
dropped count against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dpjax.models import moe

N, D, F, E, K = 16, 8, 12, 8, 2  # tokens per device, width, expert width, experts, top-k


def params(seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: (0.5 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    return {"router_DxE": r(D, E), "w1_EexDxF": r(E, D, F), "b1_EexF": r(E, F), "w2_EexFxD": r(E, F, D),
            "b2_EexD": r(E, D)}


EXPERT_SPECS = {"router_DxE": P(), "w1_EexDxF": P("expert"), "b1_EexF": P("expert"), "w2_EexFxD": P("expert"),
                "b2_EexD": P("expert")}


@pytest.mark.parametrize("algorithm", ["pairwise", "xla", pytest.param("bruck", marks=pytest.mark.slow)])
def test_experts_over_the_axis_equal_every_expert_on_one_device(mesh_of, put, algorithm):
    """Tokens of 4 devices routed to 8 experts, 2 on each device, through the all-to-all and
    back: with a capacity that drops nothing, each token's output and every gradient (of
    the tokens, of each device's experts, of the router summed over devices) equal one
    device computing all experts on all tokens, to float32 round-off. A block sent to the
    wrong device, a slot mixed up or a gradient left on the wrong device is O(1) off."""
    n = 4
    mesh = mesh_of(f"expert={n}", n)
    p, x, cot = params(), np.random.default_rng(1).standard_normal((n * N, D)).astype(np.float32), \
        np.random.default_rng(2).standard_normal((n * N, D)).astype(np.float32)
    cf = E / K  # C = N: an expert can take every token of a device

    def local(p, x, cot):
        def f(p, x):
            return moe.moe_mlp(x, p, k=K, capacity_factor=cf, axis="expert", algorithm=algorithm)[0]
        y, vjp = jax.vjp(f, p, x)
        gp, gx = vjp(cot)
        gp = {**gp, "router_DxE": jax.lax.psum(gp["router_DxE"], "expert")}
        dropped = jax.lax.psum(moe.moe_mlp(x, p, k=K, capacity_factor=cf, axis="expert",
                                           algorithm=algorithm)[1]["dropped"], "expert")
        return y, gp, gx, dropped

    rows = P("expert")
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(EXPERT_SPECS, rows, rows),
                               out_specs=(rows, EXPERT_SPECS, rows, P()), check_vma=False))
    placed = ({k: put(mesh, v, EXPERT_SPECS[k]) for k, v in p.items()}, put(mesh, x, rows), put(mesh, cot, rows))
    y, gp, gx, dropped = jax.tree.map(np.asarray, fn(*placed))
    assert int(dropped) == 0

    def dense(p, x):
        return moe.moe_mlp(x, p, k=K, capacity_factor=cf)[0]

    y1, vjp = jax.vjp(dense, jax.tree.map(jnp.asarray, p), jnp.asarray(x))
    gp1, gx1 = vjp(jnp.asarray(cot))
    np.testing.assert_allclose(y, y1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, gx1, rtol=1e-5, atol=1e-5)
    for name in p:
        np.testing.assert_allclose(gp[name], gp1[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_router_losses_and_drops_against_numpy():
    """Switch's balance loss E sum_e f_e P_e, the z-loss, the top-k gates and the choices
    past an expert's capacity (first choices placed first) written again in numpy."""
    p, x = params(3), np.random.default_rng(4).standard_normal((N, D)).astype(np.float32)
    cf = 0.5
    y, stats = moe.moe_mlp(jnp.asarray(x), jax.tree.map(jnp.asarray, p), k=K, capacity_factor=cf)
    logits = x.astype(np.float64) @ p["router_DxE"]
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    top = np.argsort(-prob, axis=-1)[:, :K]
    f = np.bincount(top.reshape(-1), minlength=E) / top.size
    assert float(stats["balance"]) == pytest.approx(E * np.sum(f * prob.mean(0)), rel=1e-5)
    lse = np.log(np.exp(logits).sum(-1))
    assert float(stats["z"]) == pytest.approx(np.mean(lse ** 2), rel=1e-5)
    C = int(np.ceil(cf * N * K / E))
    taken, dropped, want = np.zeros(E, int), 0, np.zeros((N, D))
    for j in range(K):  # choice-major: every token's first choice before any second one
        for t in range(N):
            e = top[t, j]
            if taken[e] < C:
                taken[e] += 1
                gate = prob[t, e] / prob[t, top[t]].sum()
                h = x[t] @ p["w1_EexDxF"][e] + p["b1_EexF"][e]
                h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))  # jax.nn.gelu's tanh form
                want[t] += gate * (h @ p["w2_EexFxD"][e] + p["b2_EexD"][e])
            else:
                dropped += 1
    assert int(stats["dropped"]) == dropped > 0 and stats["choices"] == N * K
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)
