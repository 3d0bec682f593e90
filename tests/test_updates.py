"""Update rules (dpjax.updates) against numpy simulations of their algebra, on losses
whose gradients are known in closed form, through the research API
(`dpjax.make_update_step`); the `--update` grammar and flag. (Every rule with every
layout and exchange option: tests/test_step.py.)"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from dpjax import step as S
from dpjax import updates as U
from dpjax.updates.delayed import delayed
from dpjax.updates.sparse import sparse
from dpjax.updates.stale_async import stale_async
from dpjax.updates.sync import sync
from dpjax.errors import UserError
from dpjax.updates import registry
from dpjax.train import main

from conftest import read_losses

N = 8  # workers
STEPS = 5


# ---------------------------------------------------------------------------------------
# the algebra of delayed averaging, on a loss whose gradients do not depend on w

D, LR = 6, 0.5


def linear_loss(params, x_BxD):
    """Gradient w.r.t. w: the mean of the local rows; w.r.t. m: the same in each column."""
    return jnp.mean(x_BxD @ params["w"]) + jnp.mean(jnp.sum(x_BxD @ params["m"], -1))


def _linear_batches(steps, seed=0):
    # small integers with one row per worker: every sum, average (/8) and lr step (*0.5)
    # is exact in float32, so the slide's algebra can be checked with ==
    return np.random.default_rng(seed).integers(-4, 5, size=(steps, N, D)).astype(np.float32)


def _linear_init():
    return {"w": np.arange(D, dtype=np.float32), "m": np.ones((D, 2), np.float32)}


def _run(mesh, put, rule, loss_fn, xs, init):
    ustep = S.make_update_step(loss_fn, rule, mesh, init, donate=False)
    params_W, state_W = ustep.init(jax.tree.map(lambda v: put(mesh, v, P()), init))
    states = []
    for x in xs:  # one micro-batch per step: K x B with K = 1
        params_W, state_W, _ = ustep.train(params_W, state_W, put(mesh, x[None], P(None, "data")))
        states.append(state_W)
    return ustep, params_W, state_W, states


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("compensate", [True, False])
def test_delayed_sgd_is_the_slide_algebra(mesh_of, put, T, compensate):
    mesh, steps = mesh_of("8x1", N), 6
    xs = _linear_batches(steps)
    g_SxNxD = xs.astype(np.float64)  # worker k's gradient of w at step i
    gbar_SxD = g_SxNxD.mean(1)
    w0 = _linear_init()
    rule = delayed(optax.sgd(LR), T, "data", compensate=compensate, algorithm="ring")
    ustep, params_W, state_W, _ = _run(mesh, put, rule, linear_loss, xs, w0)

    # before the last T averages arrive: worker k has its own g for steps N-T..N-1
    # (with compensation) or nothing for them (without)
    own = g_SxNxD[steps - T:].sum(0) if compensate else 0.0
    want_W = w0["w"] - LR * (gbar_SxD[:steps - T].sum(0) + own)
    np.testing.assert_array_equal(np.asarray(params_W["w"]), np.broadcast_to(want_W, (N, D)).astype(np.float32))

    # once they have arrived: every worker holds w_0 - lr * sum of all the averages ...
    params_W, state_W = ustep.flush(params_W, state_W)
    want = {"w": w0["w"] - LR * gbar_SxD.sum(0), "m": w0["m"] - LR * gbar_SxD.sum(0)[:, None]}
    for k in want:
        np.testing.assert_array_equal(np.asarray(params_W[k]), np.broadcast_to(want[k], (N, *want[k].shape)))
    # ... which is exactly where sync goes on a loss with constant gradients (sync keeps
    # one copy, no worker axis)
    _, sync_params, _, _ = _run(mesh, put, sync(optax.sgd(LR), "data"), linear_loss, xs, w0)
    for k in want:
        assert sync_params[k].shape == want[k].shape
        np.testing.assert_array_equal(np.asarray(params_W[k]), np.broadcast_to(sync_params[k], params_W[k].shape))


def test_delayed_momentum_compensates_the_gradient_stream(mesh_of, put):
    """With momentum the compensated gradient g_i + gbar_{i-T} - g_{i-T} is what feeds the
    optimizer (the docstring's statement), checked against a numpy momentum."""
    mesh, steps, T, beta = mesh_of("8x1", N), 7, 2, 0.9
    xs = _linear_batches(steps, seed=1)
    w0 = _linear_init()
    rule = delayed(optax.sgd(0.1, momentum=beta), T, "data")
    _, params_W, _, _ = _run(mesh, put, rule, linear_loss, xs, w0)
    g = xs.astype(np.float64)
    gbar = g.mean(1, keepdims=True)
    w, trace = np.broadcast_to(w0["w"], (N, D)).copy(), np.zeros((N, D))
    for i in range(steps):
        fed = g[i] + ((gbar[i - T] - g[i - T]) if i >= T else 0.0)
        trace = fed + beta * trace
        w -= 0.1 * trace
    np.testing.assert_allclose(np.asarray(params_W["w"]), w, rtol=1e-6, atol=1e-5)


# ---------------------------------------------------------------------------------------
# sparse (local SGD, DiLoCo) and async against numpy simulations, on a quadratic


def quadratic_loss(params, x_BxD):
    """0.5 |w - x|^2 averaged over the local rows: the gradient is w - mean(x)."""
    return 0.5 * jnp.mean(jnp.sum((params["w"][None] - x_BxD) ** 2, -1))


def _quadratic_data(steps, seed=2):
    return np.random.default_rng(seed).standard_normal((steps, N, D)).astype(np.float32)


@pytest.mark.parametrize("period,outer_lr", [(3, 0.0), (2, 0.7)])
def test_sparse_is_local_sgd_with_periodic_average(mesh_of, put, period, outer_lr):
    mesh, steps, lr, beta = mesh_of("8x1", N), 7, 0.3, 0.9
    xs = _quadratic_data(steps)
    outer = optax.sgd(outer_lr, momentum=beta, nesterov=True) if outer_lr else None
    rule = sparse(optax.sgd(lr), period, "data", outer=outer)
    _, params_W, _, _ = _run(mesh, put, rule, quadratic_loss, xs, {"w": np.zeros(D, np.float32)})
    w, anchor, trace = np.zeros((N, D)), np.zeros(D), np.zeros(D)
    for i in range(steps):
        w -= lr * (w - xs[i])
        if (i + 1) % period == 0:
            if outer_lr:
                delta = (anchor - w).mean(0)  # the outer (pseudo-)gradient
                trace = delta + beta * trace
                anchor = anchor - outer_lr * (delta + beta * trace)  # optax's Nesterov
                w[:] = anchor
            else:
                w[:] = w.mean(0)
    np.testing.assert_allclose(np.asarray(params_W["w"]), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tau,fetch,push", [(3, 1, 1), (2, 2, 3)])
def test_async_follows_its_seeded_schedule(mesh_of, put, tau, fetch, push):
    mesh, steps, lr, seed = mesh_of("8x1", N), 9, 0.4, 7
    xs = _quadratic_data(steps, seed=3)
    rule = stale_async(optax.sgd(lr), tau, "data", seed=seed, fetch_every=fetch, push_every=push)
    ustep, params_W, _, states = _run(mesh, put, rule, quadratic_loss, xs, {"w": np.zeros(D, np.float32)})

    # the seeded schedule is this simulation's input (its properties: the tests below);
    # the step must read the versions it names
    sched = U.staleness_schedule(seed, steps, N, tau)
    assert sched.max() == tau and len(np.unique(sched)) > 1  # really stale, and mixed

    hist, local, version, acc = [np.zeros(D)], np.zeros((N, D)), np.zeros(N, int), np.zeros((N, D))
    w = np.zeros(D)
    for t in range(steps):
        for k in range(N):
            if (t + k) % fetch == 0:
                version[k] = t - sched[t, k]
                local[k] = hist[version[k]]
        np.testing.assert_array_equal(np.asarray(states[t].version), version)  # what the step read
        acc += local - xs[t]
        pushed = np.array([(t + k) % push == push - 1 for k in range(N)])
        w = w - lr * np.where(pushed[:, None], acc, 0).mean(0)
        acc[pushed] = 0
        hist.append(w.copy())
    np.testing.assert_allclose(np.asarray(ustep.consensus(params_W)["w"]), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(params_W["w"]), np.broadcast_to(params_W["w"][0], (N, D)))


def test_staleness_schedule_small_cases():
    """By hand: TAU=0 is never stale; nothing is staler than the versions that exist
    (step t has versions 0..t), so step 0 is fresh for every worker and step 1 at most
    one version old."""
    np.testing.assert_array_equal(U.staleness_schedule(3, 6, 4, 0), np.zeros((6, 4), int))
    for seed in range(5):
        sched = U.staleness_schedule(seed, 3, 8, 5)
        assert sched.shape == (3, 8) and sched.dtype.kind == "i"
        np.testing.assert_array_equal(sched[0], 0)
        assert set(sched[1]) <= {0, 1} and set(sched[2]) <= {0, 1, 2}


def test_staleness_schedule_properties():
    """What `staleness` documents: uniform on 0..TAU, from (seed, step, worker) alone."""
    tau, steps, workers, seed = 3, 2000, 8, 11
    sched = U.staleness_schedule(seed, steps, workers, tau)
    t = np.arange(steps)[:, None]
    assert sched.min() >= 0 and (sched <= np.minimum(tau, t)).all()
    # reproducible from the seed: again, and as a corner of a larger schedule (any process
    # regenerates its own entries without the others'); another seed, another schedule
    np.testing.assert_array_equal(U.staleness_schedule(seed, steps, workers, tau), sched)
    np.testing.assert_array_equal(U.staleness_schedule(seed, 40, 3, tau), sched[:40, :3])
    assert (U.staleness_schedule(seed + 1, steps, workers, tau) != sched).mean() > 0.5
    # uniform on 0..TAU once every version exists: 15976 draws, each value expected 3994
    # times with a standard deviation of 55; the draws are fixed by the seed, so 5
    # standard deviations is a bound this schedule meets, not a flaky test
    full = sched[tau:]
    counts = np.bincount(full.ravel(), minlength=tau + 1)
    expected = full.size / (tau + 1)
    sd = np.sqrt(full.size * (1 / (tau + 1)) * (tau / (tau + 1)))
    assert len(counts) == tau + 1 and np.all(np.abs(counts - expected) < 5 * sd), counts
    # workers draw independently: neighbours agree as often as two uniform draws would (1/4)
    agree = (full[:, :-1] == full[:, 1:]).mean()
    assert abs(agree - 1 / (tau + 1)) < 0.02, agree


def test_param_specs_shard_worker_state_over_model(mesh_of, put):
    """With param_specs, per-worker leaves are split over `model` too (the layout tensor
    parallelism will need): the same run on data=4 x model=2 with w split over `model`
    equals data=4 x model=1 with w whole."""
    steps, lr = 5, 0.3
    xs = np.random.default_rng(4).standard_normal((steps, 4, D)).astype(np.float32)

    def sliced_loss(params, x_BxD):  # this model rank's columns of the quadratic
        w = params["w"]
        x = lax.dynamic_slice_in_dim(x_BxD, lax.axis_index("model") * w.shape[0], w.shape[0], axis=1)
        return 0.5 * jnp.mean(jnp.sum((w[None] - x) ** 2, -1))

    out = {}
    for spec, count, pspec in (("4x2", 8, P("model")), ("4x1", 4, P())):
        mesh = mesh_of(spec, count)
        rule = delayed(optax.sgd(lr), 2, "data")
        w0 = {"w": put(mesh, np.zeros(D, np.float32), pspec)}
        ustep = S.make_update_step(sliced_loss, rule, mesh, w0, param_specs={"w": pspec}, donate=False)
        params_W, state_W = ustep.init(w0)
        for x in xs:
            params_W, state_W, _ = ustep.train(params_W, state_W, put(mesh, x[None], P(None, "data")))
        cols = D // mesh.shape["model"]  # each device: its worker's copy of its model rank's columns
        assert params_W["w"].addressable_shards[0].data.shape == (1, cols)
        assert state_W.gbar_RxP["w"].addressable_shards[0].data.shape == (1, 2, cols)
        # and the global arrays are whole: a state leaf wrongly claimed replicated over
        # `model` would hold only one rank's columns (and a checkpoint would save those)
        assert params_W["w"].shape == (4, D) and state_W.gbar_RxP["w"].shape == (4, 2, D)
        out[spec] = np.asarray(params_W["w"])
    # float32 round-off only: the ring cuts a 3-element and a 6-element vector into
    # different chunks, so the 4 workers' gradients are summed in another order
    np.testing.assert_allclose(out["4x2"], out["4x1"], rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------
# specs and the command line


@pytest.mark.parametrize("text,want", [
    ("sync", U.UpdateSpec()), ("delayed:4", U.UpdateSpec("delayed", 4)),
    ("delayed-nocomp:2", U.UpdateSpec("delayed-nocomp", 2)),
    ("sparse:8,outer=0.7", U.UpdateSpec("sparse", 8, outer_lr=0.7)),
    ("async:4,fetch=2,push=3", U.UpdateSpec("async", 4, fetch=2, push=3)),
])
def test_parse_update_round_trips(text, want):
    assert U.parse_update(text) == want and str(want) == text


def test_unknown_rule_is_an_error_not_async():
    with pytest.raises(UserError, match="unknown update rule 'foo'; choose one of sync, delayed, "):
        U.make_rule(U.UpdateSpec("foo", 2), optax.sgd(0.1), "data")
    with pytest.raises(UserError, match="bad --update 'foo:2': choose sync, delayed:T"):
        U.make_rule("foo:2", optax.sgd(0.1), "data")


def test_a_registered_rule_is_in_the_grammar_help_and_make_rule():
    """A rule is its module's registration: nothing else lists the names."""
    def build(spec, inner, axis_name, *, seed, **allreduce):
        return sync(inner, axis_name, **allreduce)._replace(name=f"every:{spec.n}")

    kind = registry.Kind("every", "a toy: sync, named", build=build, is_sync=lambda spec: spec.n == 7,
                         number="the toy number N", low=2)
    with registry.registered(kind):
        assert U.parse_update("every:3") == U.UpdateSpec("every", 3) and str(U.UpdateSpec("every", 3)) == "every:3"
        assert U.parse_update("every:7").is_sync and not U.parse_update("every:3").is_sync
        assert "'every:N' (a toy: sync, named)" in U.HELP
        with pytest.raises(UserError, match="the toy number N must be an integer >= 2"):
            U.parse_update("every:1")
        assert U.make_rule("every:3", optax.sgd(0.1), "data").name == "every:3"
    assert "'every:N'" not in U.HELP
    with pytest.raises(UserError, match="bad --update 'every:3': choose sync, "):
        U.parse_update("every:3")


def test_onebit_adam_is_found_through_the_registry_by_its_optimizer():
    """1-bit Adam registers as every rule does, as the rule its optimizer brings: the plan
    gets it from make_rule by the optimizer's name, whatever the spec; --update does not
    name it (its help lists only --update's rules)."""
    from dpjax.optim import ADAM_B1, ADAM_B2, ADAM_EPS, OptimizerConfig
    from dpjax.updates import onebit_adam

    kind = registry.for_optimizer("onebit_adam")
    assert kind is not None and kind.build is onebit_adam._build and registry.for_optimizer("adamw") is None
    assert "onebit_adam" not in [k.name for k in registry.kinds()] and "onebit_adam" not in U.HELP
    with pytest.raises(UserError, match="bad --update 'onebit_adam': choose sync, "):
        U.parse_update("onebit_adam")
    opt = OptimizerConfig(name="onebit_adam", lr=0.1)
    own = registry.Optimizer(opt, 8, {"w": P()}, ADAM_B1, ADAM_B2, ADAM_EPS)
    inner = opt.make(8, {"w": P()})
    rule = U.make_rule("sync", inner, "data", optimizer=own, compression="onebit,start=2")
    assert rule.name == "onebit_adam" and rule.per_worker
    plain = U.make_rule("sync", inner, "data", optimizer=registry.Optimizer(
        OptimizerConfig(name="adamw"), 8, {"w": P()}, ADAM_B1, ADAM_B2, ADAM_EPS))
    assert plain.name == "sync"


def _tiny(corpus, *extra):
    return ["--model", "mlp", "--d-hidden", "64", "--seq-len", "16", "--batch-size", "16", "--data", corpus,
            "--eval-every", "0", "--eval-batches", "1", "--progress", "none", "--mesh", "8x1", *extra]


def test_train_update_flag_resumes_exactly(corpus, tmp_path, capsys):
    ckpt, path, straight = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "s.jsonl"
    args = _tiny(corpus, "--update", "delayed:2", "--ckpt-dir", str(ckpt), "--ckpt-every", "3",
                 "--metrics", str(path))
    assert main(args + ["--steps", "3"]) == 0
    assert main(args + ["--steps", "6", "--resume"]) == 0
    assert main(_tiny(corpus, "--update", "delayed:2", "--steps", "6", "--metrics", str(straight))) == 0
    got = read_losses(path)
    assert len(got) == 6 and got == read_losses(straight)  # the in-flight averages were saved too
    assert "done: 6 steps on mesh 8x1" in capsys.readouterr().out
    # another rule on that checkpoint: refused, naming the difference
    assert main(_tiny(corpus, "--update", "sparse:4", "--ckpt-dir", str(ckpt), "--steps", "9", "--resume")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optimizer.update: saved 'delayed:2', now 'sparse:4'" in err[0], err


@pytest.mark.slow  # tests/test_step.py covers every rule on 2x4 against a simulation
@pytest.mark.parametrize("update", ["delayed:2", "sparse:3", "async:2"])
def test_update_rules_compose_with_tensor_parallelism(corpus, tmp_path, update):
    """The same 2 workers with their parameters split 4 ways over `model`, or whole: the
    same losses (float32 round-off). AdamW with a small clip norm, so that the clipping
    norm must be summed over the model shards."""
    whole, split = tmp_path / "whole.jsonl", tmp_path / "split.jsonl"
    common = ["--update", update, "--steps", "6", "--clip-norm", "0.05"]
    assert main(_tiny(corpus, *common, "--mesh", "2x1", "--metrics", str(whole))) == 0
    assert main(_tiny(corpus, *common, "--mesh", "2x4", "--metrics", str(split))) == 0
    np.testing.assert_allclose(read_losses(split), read_losses(whole), rtol=2e-5)


@pytest.mark.parametrize("update,needle", [
    ("delayed:-1", "bad --update 'delayed:-1': the delay T must be an integer >= 0"),
    ("sparse:0", "bad --update 'sparse:0': the period P must be an integer >= 1"),
    ("foo", "bad --update 'foo': choose sync, delayed:T"),
    ("async:2,pull=3", "unknown option 'pull=3' (options of async: fetch=..., push=...)"),
    ("sparse:2 --workers model", "--workers 'model': 'model' is not a data axis of mesh"),
    ("sparse:2 --workers data,data", "--workers 'data,data' names an axis twice"),
])
def test_train_bad_update_one_line(corpus, capsys, update, needle):
    rule, *extra = update.split()
    assert main(_tiny(corpus, "--steps", "2", "--update", rule, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
