"""1-bit Adam (`--optimizer onebit_adam`, dpjax.updates.onebit_adam; its compressed
allreduce `--compression onebit`, dpjax.compression.onebit): the warm-up is AdamW bit for
bit; after the freeze nothing of the momentum is lost, only delayed (float64); a
checkpoint resumes bit for bit; the compiled step sends the formula's bytes; it runs on
the layouts it composes with and refuses the others in one line; the start warning
for a biased compressor with error feedback under Adam."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dpjax import step as S
from dpjax.data import make_streams

from conftest import assert_resumes_bit_for_bit, read_losses, tiny_gpt

TINY = {"d_model": 32, "n_layers": 1, "n_heads": 8}
B1, B2 = 0.9, 0.95


def _plan(**kw):
    from dpjax.plan import resolve
    from dpjax.settings import Settings

    return resolve(Settings(seq_len=16, batch_size=16, model_options=TINY, **kw))


def _train(plan, steps: int):
    """(losses, the consensus parameters after each step) of `steps` steps of `plan`."""
    train, _ = make_streams("synthetic", 16, 0)
    st = S.for_plan(plan, donate=False)
    params, state = st.init(S.init_params(plan.model, plan.layout, jax.random.key(0)))
    losses, seen = [], []
    for i in range(steps):
        params, state, loss = st.train(params, state, S.put_batch(train, i * 16, 16, plan.mesh, passes=1))
        losses.append(float(loss))
        seen.append(jax.tree.map(np.asarray, st.consensus(params)))
    return losses, seen


@pytest.mark.parametrize("mesh,extra,reference", [
    ("8x1", {}, {}),
    ("2x4x1", {"compress_axes": "node"}, {"workers": "node"})], ids=["8x1", "sites"])
def test_the_warm_up_is_adamw_bit_for_bit(mesh, extra, reference):
    """start=3: the first 3 steps move the parameters exactly as --optimizer adamw with
    the uncompressed exchange does; the 4th (the variance frozen) does not."""
    kw = {"mesh": mesh, "clip_norm": 1.0, "weight_decay": 0.1}
    want_losses, want = _train(_plan(optimizer="adamw", **kw, **reference), 4)
    losses, got = _train(_plan(optimizer="onebit_adam", compression="onebit,start=3", **kw, **extra), 4)
    for step in range(4):
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(want[step]), jax.tree.leaves(got[step])))
        assert same == (step < 3), step
    assert losses[:4] == want_losses[:4]  # the 4th loss is the one of the 3 warm-up steps' parameters


@pytest.mark.parametrize("compression,exact_steps", [
    ("onebit,start=2", (0, 1)),
    ("onebit,start=2,refresh=2,bound=0.02", (0, 1, 4)),  # refreshes at 4, 8, ...; the bound binds
], ids=["frozen", "refresh-bound"])
def test_after_the_freeze_nothing_of_the_momentum_is_lost(mesh_of, compression, exact_steps):
    """float64, 4 workers, 7 steps: after the freeze, the momenta applied + the mean
    worker error + the servers' errors (+ what the bound holds) == the sum of the true
    means of the workers' momenta b1 m + (1 - b1) g_i; every worker holds the same
    parameters; each step moves them by AdamW's formula from the m it keeps and v over
    its k updates (k counted here: the exact steps so far); v moves on the exact steps
    only, by AdamW's rule from the exact mean gradient; under bound=C no coordinate of
    m passes C sqrt(v_hat), and some reach it."""
    from dpjax.updates.onebit_adam import _find, onebit_adam

    n, shapes, lr, eps = 4, {"w": (12, 40), "b": (40,), "v": (300,)}, 1e-3, 1e-8
    bound = float(compression.partition("bound=")[2] or 0)
    mesh = mesh_of(f"data={n}", n)
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        rule = onebit_adam(optax.adamw(lr, b1=B1, b2=B2, eps=eps), lambda g: g, lambda c: lr, "data",
                           b1=B1, b2=B2, eps=eps, weight_decay=0.0, compression=compression,
                           algorithm="ring", fusion_mb=64)
        params = {k: jnp.asarray(rng.standard_normal(s)) for k, s in shapes.items()}
        state = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), rule.init(params))
        params = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), params)

        def body(p, st, g):
            p, st, g = jax.tree.map(lambda x: x[0], (p, st, g))
            p, st, _ = rule.step(lambda params, batch: (0.0, batch), p, st, g)
            return jax.tree.map(lambda x: x[None], (p, st))

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
        flat = lambda tree: np.concatenate([np.ravel(tree[k]) for k in shapes])  # noqa: E731
        first = lambda tree: flat(jax.tree.map(lambda x: x[0], tree))  # noqa: E731
        applied = true = 0
        for step in range(7):
            g = {k: jnp.asarray(rng.standard_normal((n, *s))) for k, s in shapes.items()}
            g_mean = flat(jax.tree.map(lambda x: np.mean(x, 0), g))
            before, p_before = _find(state.inner, optax.ScaleByAdamState), first(params)
            params, state = f(params, state, g)
            after = _find(state.inner, optax.ScaleByAdamState)
            for k in shapes:  # every worker applies the same update
                np.testing.assert_array_equal(params[k][0], params[k][n - 1])
            if step < 2:
                continue
            k_v = sum(1 for s_ in exact_steps if s_ <= step)
            m, v = first(after.mu), first(after.nu)
            if step in exact_steps:  # a refresh: AdamW's rule from the exact mean gradient
                np.testing.assert_allclose(v, B2 * first(before.nu) + (1 - B2) * g_mean ** 2, rtol=1e-12)
                np.testing.assert_allclose(m, B1 * first(before.mu) + (1 - B1) * g_mean, rtol=1e-12, atol=1e-15)
            else:
                np.testing.assert_array_equal(v, first(before.nu))  # frozen
            v_hat = v / (1 - B2 ** k_v)
            want = p_before - lr * (m / (1 - B1 ** (step + 1)) / (np.sqrt(v_hat) + eps))
            np.testing.assert_allclose(first(params), want, rtol=1e-12, atol=1e-15)
            if bound and step not in exact_steps:
                assert np.all(np.abs(m) <= bound * np.sqrt(v_hat) * (1 + 1e-12))
                assert np.isclose(np.abs(m), bound * np.sqrt(v_hat), rtol=1e-9).mean() > 0.1  # it binds
            true = true + B1 * first(before.mu) + (1 - B1) * g_mean
            applied = applied + m
        ex = state.exchange
        buffers = flat(jax.tree.map(lambda x: np.mean(x, 0), ex.error)) + flat(jax.tree.map(lambda x: np.sum(x, 0),
                                                                                             ex.method))
        if bound:
            buffers = buffers + first(state.held)  # the same on every worker: it goes out once
        assert np.abs(applied - true).max() > 1e-3  # it really compresses
        np.testing.assert_allclose(applied + buffers, true, rtol=0, atol=1e-12)


@pytest.mark.parametrize("extra", [
    ("--mesh", "8x1"),
    pytest.param(("--mesh", "2x4x1", "--compress-axes", "node"), marks=pytest.mark.slow)], ids=["8x1", "sites"])
def test_a_checkpoint_across_the_freeze_resumes_bit_for_bit(corpus, tmp_path, extra):
    """m, v, the worker and server errors and what the bound holds are in the checkpoint:
    3 steps (the freeze after 2), a restart, 3 more (a refresh of v at step 4) equal 6
    straight steps exactly."""
    assert_resumes_bit_for_bit(tiny_gpt(corpus, *extra, "--optimizer", "onebit_adam", "--lr", "0.003",
                                        "--compression", "onebit,start=2,refresh=2,bound=0.1"), tmp_path)


def test_compiled_bytes_are_the_formula():
    """A frozen step sends 1-bit Adam's formula (`accounting.compressed_bytes("onebit")`, 29x
    fewer than AdamW's ring allreduce here), a warm-up step what AdamW's step sends; both
    besides the reported loss's scalar mean, which AdamW's step sends too."""
    from dpjax.compression.accounting import compressed_bytes
    from dpjax.timeline import compiled_text
    from dpjax.train.comm_bytes import StepBytes

    def sent(plan):
        st = S.for_plan(plan, donate=False)
        params, state = st.init(S.init_params(plan.model, plan.layout, jax.random.key(0)))
        batch = S.put_batch(make_streams("synthetic", 16, 0)[0], 0, 16, plan.mesh, passes=1)
        return StepBytes(compiled_text(st.train, params, state, batch))

    plain = _plan(mesh="8x1")
    onebit = _plan(mesh="8x1", optimizer="onebit_adam", compression="onebit,start=2,refresh=2,bound=0.1")
    shapes = [tuple(x.shape) for x in jax.tree.leaves(jax.eval_shape(plain.model.init, jax.random.key(0)))]
    scalar = sent(plain).at(True) - compressed_bytes(None, shapes, 8)
    got = sent(onebit)
    assert got.at(True) == compressed_bytes("onebit", shapes, 8) + scalar, (got.at(True), scalar)
    assert got.at(False) == sent(plain).at(True)
    assert got.at(True) * 16 < got.at(False)


def test_the_metrics_charge_a_refresh_the_exact_exchange():
    """start=2,refresh=3: steps 0, 1, 6, 18, 54 exchange exactly, the others compressed
    (what comm_bytes charges each step)."""
    from dpjax.compression.accounting import compressed_at

    plan = _plan(mesh="8x1", optimizer="onebit_adam", compression="onebit,start=2,refresh=3")
    assert [t for t in range(60) if not compressed_at(plan, t)] == [0, 1, 6, 18, 54]


@pytest.mark.parametrize("extra", [
    ("--mesh", "4x2"),  # tensor parallel: the momentum of each model shard
    ("--mesh", "2x4x1", "--workers", "node", "--fsdp"),  # HSDP: FSDP inside a site, 1-bit Adam between sites
    ("--mesh", "2x4x1", "--compress-axes", "node", "--compression", "int4,start=2,refresh=2,bound=0.1"),  # per shard
], ids=["tp", "hsdp", "sites-int4"])
def test_it_trains_on_the_layouts_it_composes_with(corpus, tmp_path, extra):
    path = tmp_path / "m.jsonl"
    args = tiny_gpt(corpus, "--optimizer", "onebit_adam", "--lr", "0.003", "--compression",
                    "onebit,start=2,refresh=2,bound=0.1", *extra, "--steps", "5",  # step 4: a refresh
                    "--metrics", str(path))
    from dpjax.train import main

    assert main(args) == 0
    losses = read_losses(path)
    assert len(losses) == 5 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("steps,want", [
    (200, "onebit,start=40,refresh=2"),  # the warm-up 20% of the run (experiments/onebit_grid.py) ...
    (1000, "onebit,start=100,refresh=2"),  # ... and at most 100 steps
    (5000, "onebit,start=100,refresh=2"),
    (12, "onebit,start=2,refresh=2"),  # 2.4 steps round to 2
    (2, "onebit,start=1,refresh=2")])  # at least one exact step: v is frozen from them
def test_onebit_adam_alone_runs_the_default(steps, want):
    """`--optimizer onebit_adam` without a --compression is accepted (it was refused) and
    resolves to 1-bit Adam's default for the run's --steps (a warm-up of 20% of them, at
    most 100, and refreshes; golden strings, measured in RESULTS.md); the plan, its settings (the
    run record's) and the rule carry it. A compression given is kept as given."""
    from dpjax.plan import check, settled
    from dpjax.settings import Settings

    s = Settings(optimizer="onebit_adam", steps=steps, seq_len=16, batch_size=16, model_options=TINY)
    check(s)
    assert settled(s).compression == want
    plan = _plan(optimizer="onebit_adam", steps=steps)
    assert (plan.exchange.compression, plan.settings.compression, plan.rule.name) == (want, want, "onebit_adam")
    assert _plan(optimizer="onebit_adam", steps=steps, compression="onebit,start=3").exchange.compression == \
        "onebit,start=3"
    assert settled(Settings(optimizer="adamw", steps=steps)).compression == "none"  # AdamW's exchange is untouched


def test_the_default_warm_up_is_optax_adam():
    """The default's warm-up (12 steps: start=2) moves the parameters as optax.adam (b1 0.9,
    b2 0.95, eps 1e-8, the run's lr) does, on one device (no exchange); the step after it
    (the variance frozen, the momentum compressed) parts from it by orders more. To round-off,
    not bit for bit: XLA:CPU lets LLVM contract a * b + c into one FMA, so Adam's arithmetic
    inside the rule's lax.cond may round its last bit unlike a plain optax step (measured:
    1 ulp, 3.7e-9, at the second step; the first, m / sqrt(v) = +-1, is exact)."""
    import optax

    from dpjax.plan import resolve
    from dpjax.settings import Settings

    one = jax.devices()[:1]
    kw = {"mesh": "1x1", "seq_len": 16, "batch_size": 16, "model_options": TINY, "clip_norm": 0.0, "steps": 12}
    adam = optax.adam(Settings.lr, b1=B1, b2=B2, eps=1e-8)
    want_losses, want = _train(resolve(Settings(**kw), one, optimizer=adam), 3)
    losses, got = _train(resolve(Settings(optimizer="onebit_adam", **kw), one), 3)
    ulp = np.finfo(np.float32).eps
    for step in range(2):
        for a, b in zip(jax.tree.leaves(want[step]), jax.tree.leaves(got[step])):
            np.testing.assert_allclose(b, a, rtol=4 * ulp, atol=4 * ulp * np.max(np.abs(a)))
    apart = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(want[2]), jax.tree.leaves(got[2])))
    assert apart > 1e-4, apart  # the frozen step is 1-bit Adam's, not Adam's
    np.testing.assert_allclose(losses, want_losses, rtol=4 * ulp)


@pytest.mark.parametrize("kw,needle", [
    ({"compression": "bf16"}, "got --compression bf16: leave it out for the default, or give one (e.g. --compression "
                              "onebit,start=40,refresh=2, the default for 200 steps)"),
    ({"compression": "onebit", "steps": 1000}, "freezes Adam's variance after start=S exact steps, S >= 1: "
                                               "--compression onebit,start=S (e.g. --compression "
                                               "onebit,start=100,refresh=2, the default for 1000 steps)"),
    ({"compression": "onebit,start=2", "update": "sparse:4"}, "--update sparse:4 cannot wrap it"),
    ({"compression": "randk:0.1,start=2", "fsdp": True}, "--optimizer onebit_adam with --fsdp over every data axis"),
    ({"compression": "onebit,refresh=2"}, "needs start=S >= 1 and R >= 2"),
    ({"compression": "onebit,start=2,refresh=1"}, "needs start=S >= 1 and R >= 2"),
    ({"compression": "onebit,start=2,bound=x"}, "bound takes a number >= 0, got 'x'"),
    ({"optimizer": "adamw", "compression": "sign,start=2,refresh=2"}, "with --optimizer onebit_adam only"),
    ({"optimizer": "adamw", "compression": "sign,start=2,bound=0.1"}, "with --optimizer onebit_adam only"),
])
def test_refusals_are_one_line(kw, needle):
    from dpjax.errors import UserError

    with pytest.raises(UserError, match=re.escape(needle)) as e:
        _plan(**{"optimizer": "onebit_adam", **kw})
    assert "\n" not in str(e.value)


def test_the_start_warning_for_a_biased_compressor_under_adam():
    """sign, top-k, random-k and onebit with error feedback under AdamW: one line naming
    1-bit Adam; none under SGD, with ef=0, for a quantiser, or under onebit_adam."""
    from dpjax.compression.accounting import optimizer_warning

    line = optimizer_warning(_plan(optimizer="adamw", compression="topk:0.01"))
    assert line.startswith("warning: --compression topk:0.01 with error feedback under --optimizer adamw: a biased "
                           "compressor") and "use --optimizer onebit_adam" in line and "topk:0.01,ef=0" in line
    assert "\n" not in line
    for name in ("sign", "randk:0.01", "onebit"):
        assert optimizer_warning(_plan(optimizer="adamw", compression=name)) is not None, name
    for kw in ({"optimizer": "sgd", "compression": "sign"}, {"optimizer": "adamw", "compression": "sign,ef=0"},
               {"optimizer": "adamw", "compression": "int8"},
               {"optimizer": "onebit_adam", "compression": "onebit,start=2"}):
        assert optimizer_warning(_plan(**kw)) is None, kw
