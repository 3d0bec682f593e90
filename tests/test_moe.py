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
from dpjax.compute.tensor_parallel import NOT_FSDP

N, D, F, E, K = 16, 8, 12, 8, 2  # tokens per device, width, expert width, experts, top-k


def params(seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: (0.5 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    return {"router_DxX": r(D, E), "w1_XexDxF": r(E, D, F), "b1_XexF": r(E, F), "w2_XexFxD": r(E, F, D),
            "b2_XexD": r(E, D)}


EXPERT_SPECS = {"router_DxX": P(), "w1_XexDxF": P("expert"), "b1_XexF": P("expert"), "w2_XexFxD": P("expert"),
                "b2_XexD": P("expert")}


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
        gp = {**gp, "router_DxX": jax.lax.psum(gp["router_DxX"], "expert")}
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
    logits = x.astype(np.float64) @ p["router_DxX"]
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
                h = x[t] @ p["w1_XexDxF"][e] + p["b1_XexF"][e]
                h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))  # jax.nn.gelu's tanh form
                want[t] += gate * (h @ p["w2_XexFxD"][e] + p["b2_XexD"][e])
            else:
                dropped += 1
    assert int(stats["dropped"]) == dropped > 0 and stats["choices"] == N * K
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)


SEQ = 8
GPT_MOE = dict(seq_len=SEQ, d_model=16, n_heads=2, d_ff=16, experts=8, top_k=2, capacity_factor=4.0)


# slow: 60-85 s under load (three programs compiled); the fast set keeps the layer's equality over the
# axis (test_experts_over_the_axis_equal_every_expert_on_one_device) and the plan's refusals
@pytest.mark.slow
@pytest.mark.parametrize("mesh,tp,fsdp", [("data=2,expert=4", False, False), ("expert=4,model=2", True, False),
                                          ("data=2,expert=4", False, True)])
def test_a_moe_gpt_step_over_an_expert_axis_moves_by_the_one_device_gradient(mesh_of, put, mesh, tp, fsdp):
    """A GPT whose blocks' MLPs are 8 experts (top 2), trained one SGD step on a mesh with
    an expert axis of 4 (2 experts a device) beside data or tensor-parallel axes, against
    plain JAX on one device holding every expert: the loss (cross-entropy, the balance and
    z router losses, each device's tokens a routing group as in GShard, so the reference
    averages the same 8 or 4 row groups) and the update equal to float32 round-off, with
    no token dropped (capacity factor 4 = E/k). An expert's gradient averaged over the
    expert axis, a broadcast overwriting the experts, or a missing 1/n is far off. With
    --fsdp the other leaves are split over all 8 devices and gathered per layer, the
    experts stay whole on their expert rank (split over `expert` only, never gathered):
    the same step."""
    import optax

    from dpjax import step as S
    from dpjax.mesh import data_axes, dp_size
    from dpjax.models import get_model
    from dpjax.plan import resolve
    from dpjax.settings import Settings

    model = get_model("gpt", **GPT_MOE)
    B = 8
    s = Settings(mesh=mesh, data="synthetic", batch_size=B, seq_len=SEQ, fsdp=fsdp)
    plan = resolve(s, mesh=mesh_of(mesh, 8), model=model, optimizer=optax.sgd(1.0))
    assert plan.layout.parallel().expert_axis == "expert"
    step = S.for_plan(plan, donate=False)
    p0 = S.init_params(model, plan.layout, jax.random.key(0))
    w1 = p0["blocks"]["mlp"]["w1_LsxXexDxF"]
    assert w1.addressable_shards[0].data.shape == (w1.shape[0], 2, *w1.shape[2:])  # 8 experts / 4, each whole
    if fsdp:  # the other leaves: an eighth on each device, gathered one layer at a time; the experts never
        wqkv = p0["blocks"]["attn"]["wqkv_LsxDx3xHmxK"]
        assert wqkv.addressable_shards[0].data.size * 8 == wqkv.size
        mlp = plan.layout.gather_dims["blocks"]["mlp"]
        assert [mlp[k] for k in ("w1_LsxXexDxF", "b1_LsxXexF", "w2_LsxXexFxD", "b2_LsxXexD")] == [NOT_FSDP] * 4
        assert plan.layout.gather_dims["blocks"]["attn"]["wqkv_LsxDx3xHmxK"] >= 0
    tokens = np.random.default_rng(0).integers(0, 256, (1, B, SEQ + 1)).astype(np.int32)
    params, state = step.init(p0)
    p1, _, loss, step_stats = step.train(params, state, put(plan.mesh, tokens, P(None, data_axes(plan.mesh))))

    whole = jax.tree.map(np.asarray, model.init(jax.random.key(0)))
    groups = np.split(tokens[0], dp_size(plan.mesh))  # each data rank's rows: its routing group
    grad_fn = jax.jit(jax.value_and_grad(model.loss))
    results = [grad_fn(whole, g) for g in groups]
    want_loss = np.mean([float(r[0]) for r in results])
    want = jax.tree.map(lambda *g: sum(g) / len(g), *[r[1] for r in results])
    assert float(loss) == pytest.approx(want_loss, rel=1e-6)
    got = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), jax.device_get(p0), jax.device_get(p1))
    for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-7, err_msg=jax.tree_util.keystr(path[0]))
    # the metrics' router figures (the step's stats program: each device's, averaged) against the groups'
    stats = jax.device_get(step.stats(p0, put(plan.mesh, tokens[0], P(data_axes(plan.mesh)))))
    want_stats = [jax.jit(model.loss_and_stats)(whole, g)[1] for g in groups]
    for got_stats in (stats, step_stats):  # the stats program's, and the train step's of its own forward
        for key in ("router_balance", "router_z", "dropped"):
            want_key = np.mean([float(w[key]) for w in want_stats])
            assert float(got_stats[key]) == pytest.approx(want_key, rel=1e-5, abs=1e-7)
        assert float(got_stats["dropped"]) == 0.0


@pytest.mark.parametrize("flags,says", [
    ({"mesh": "data=2,expert=4"}, "splits a mixture of experts: give the model experts"),
    ({"mesh": "data=2,expert=4", "experts": 6}, "--experts 6 do not split over the 4 devices"),
    ({"mesh": "data=2,expert=4", "experts": 8, "workers": "expert"}, "with --workers/--compress-axes naming it"),
    ({"mesh": "data=2,expert=4", "experts": 8, "update": "delayed:2"}, "with --update delayed:2"),
    ({"mesh": "data=2,expert=4", "experts": 8, "expert_alltoall": "ring"}, "unknown --expert-alltoall 'ring'"),
    ({"mesh": "stage=2,data=4", "experts": 8}, "--experts 8 with a stage axis"),
    ({"mesh": "data=2,context=4", "experts": 8}, "--experts 8 with a context axis"),
])
def test_what_an_expert_axis_cannot_run_is_refused_in_one_line(flags, says):
    from dpjax.plan import UsageError, resolve
    from dpjax.settings import Settings

    experts = flags.pop("experts", None)
    s = Settings(data="synthetic", **flags, model_options={} if experts is None else {"experts": experts})
    with pytest.raises(UsageError) as e:
        resolve(s)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_dry_run_tells_of_the_experts(capsys):
    from dpjax.train import main

    assert main(["--mesh", "data=2,expert=4", "--experts", "8", "--data", "synthetic", "--dry-run"]) == 0
    assert ("expert-parallel (8 experts, 2 a device, top 2, capacity factor 1.25, pairwise all-to-all)"
            in capsys.readouterr().out)


@pytest.mark.slow  # 20-30 s under load (a MoE step with two micro-batches compiled)
def test_a_moe_step_returns_its_own_forwards_router_figures(mesh_of, put):
    """The train step's dropped share and router losses (what each metrics row carries)
    are those of the step's own forward: on data=2 with 2 micro-batches a step and a
    capacity that drops (factor 0.5), each the mean over the 4 routing groups (2 ranks'
    rows x 2 micro-batches) of one device's `loss_and_stats` on that group, and the loss
    with them."""
    import optax

    from dpjax import step as S
    from dpjax.mesh import data_axes
    from dpjax.models import get_model
    from dpjax.plan import resolve
    from dpjax.settings import Settings

    model = get_model("gpt", **{**GPT_MOE, "capacity_factor": 0.5, "n_layers": 1})
    A, B = 2, 8
    s = Settings(mesh="2x1", data="synthetic", batch_size=B, seq_len=SEQ, backward_passes=A)
    plan = resolve(s, mesh=mesh_of("2x1", 2), model=model, optimizer=optax.sgd(0.0))
    step = S.for_plan(plan, donate=False)
    p0 = S.init_params(model, plan.layout, jax.random.key(0))
    tokens = np.random.default_rng(1).integers(0, 256, (A, B, SEQ + 1)).astype(np.int32)
    params, state = step.init(p0)
    _, _, loss, got = jax.device_get(step.train(params, state, put(plan.mesh, tokens, P(None, data_axes(plan.mesh)))))

    whole = jax.tree.map(np.asarray, model.init(jax.random.key(0)))
    one = jax.jit(model.loss_and_stats)
    want = [one(whole, g) for a in range(A) for g in np.split(tokens[a], 2)]
    assert float(loss) == pytest.approx(np.mean([float(w[0]) for w in want]), rel=1e-6)
    for key in ("router_balance", "router_z", "dropped"):
        assert float(got[key]) == pytest.approx(np.mean([float(w[1][key]) for w in want]), rel=1e-5, abs=1e-7), key
    assert 0.1 < float(got["dropped"]) < 0.9  # a capacity of half the choices drops some
