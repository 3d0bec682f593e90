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


def test_after_the_freeze_nothing_of_the_momentum_is_lost(mesh_of):
    """float64, 4 workers, start=2: after the freeze, the momenta applied + the mean
    worker error + the servers' errors == the sum of the true means of the workers'
    momenta b1 m + (1 - b1) g_i, over 4 compressed steps; the variance does not move and
    every worker holds the same parameters."""
    from dpjax.updates.onebit_adam import _find, onebit_adam

    n, shapes = 4, {"w": (12, 40), "b": (40,), "v": (300,)}
    mesh = mesh_of(f"data={n}", n)
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        rule = onebit_adam(optax.adamw(1e-3, b1=B1, b2=B2, eps=1e-8), lambda g: g, lambda c: 1e-3, "data",
                           b1=B1, b2=B2, eps=1e-8, weight_decay=0.0, compression="onebit,start=2",
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
        applied = true = 0
        for step in range(6):
            g = {k: jnp.asarray(rng.standard_normal((n, *s))) for k, s in shapes.items()}
            before = _find(state.inner, optax.ScaleByAdamState)
            params, state = f(params, state, g)
            after = _find(state.inner, optax.ScaleByAdamState)
            for k in shapes:  # every worker applies the same update
                np.testing.assert_array_equal(params[k][0], params[k][n - 1])
            if step < 2:
                continue
            np.testing.assert_array_equal(flat(after.nu), flat(before.nu))  # frozen
            m_prev = flat(jax.tree.map(lambda x: x[0], before.mu))
            true = true + B1 * m_prev + (1 - B1) * flat(jax.tree.map(lambda x: np.mean(x, 0), g))
            applied = applied + flat(jax.tree.map(lambda x: x[0], after.mu))
        ex = state.exchange
        buffers = flat(jax.tree.map(lambda x: np.mean(x, 0), ex.error)) + flat(jax.tree.map(lambda x: np.sum(x, 0),
                                                                                             ex.method))
        assert np.abs(applied - true).max() > 1e-3  # it really compresses
        np.testing.assert_allclose(applied + buffers, true, rtol=0, atol=1e-12)


@pytest.mark.parametrize("extra", [
    ("--mesh", "8x1"),
    pytest.param(("--mesh", "2x4x1", "--compress-axes", "node"), marks=pytest.mark.slow)], ids=["8x1", "sites"])
def test_a_checkpoint_across_the_freeze_resumes_bit_for_bit(corpus, tmp_path, extra):
    """m, v, the worker and server errors are in the checkpoint: 3 steps (the freeze after
    2), a restart, 3 more equal 6 straight steps exactly."""
    assert_resumes_bit_for_bit(tiny_gpt(corpus, *extra, "--optimizer", "onebit_adam", "--lr", "0.003",
                                        "--compression", "onebit,start=2"), tmp_path)


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

    plain, onebit = _plan(mesh="8x1"), _plan(mesh="8x1", optimizer="onebit_adam", compression="onebit,start=2")
    shapes = [tuple(x.shape) for x in jax.tree.leaves(jax.eval_shape(plain.model.init, jax.random.key(0)))]
    scalar = sent(plain).at(True) - compressed_bytes(None, shapes, 8)
    got = sent(onebit)
    assert got.at(True) == compressed_bytes("onebit", shapes, 8) + scalar, (got.at(True), scalar)
    assert got.at(False) == sent(plain).at(True)
    assert got.at(True) * 16 < got.at(False)


@pytest.mark.parametrize("extra", [
    ("--mesh", "4x2"),  # tensor parallel: the momentum of each model shard
    ("--mesh", "2x4x1", "--workers", "node", "--fsdp"),  # HSDP: FSDP inside a site, 1-bit Adam between sites
    ("--mesh", "2x4x1", "--compress-axes", "node", "--compression", "int4,start=2"),  # another method, per shard
], ids=["tp", "hsdp", "sites-int4"])
def test_it_trains_on_the_layouts_it_composes_with(corpus, tmp_path, extra):
    path = tmp_path / "m.jsonl"
    args = tiny_gpt(corpus, "--optimizer", "onebit_adam", "--lr", "0.003", "--compression", "onebit,start=2",
                    *extra, "--steps", "5", "--metrics", str(path))
    from dpjax.train import main

    assert main(args) == 0
    losses = read_losses(path)
    assert len(losses) == 5 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("kw,needle", [
    ({}, "--optimizer onebit_adam sends the momentum through a compression with error feedback after S exact "
         "AdamW steps, got --compression none"),
    ({"compression": "bf16"}, "got --compression bf16"),
    ({"compression": "onebit"}, "freezes Adam's variance after start=S exact steps, S >= 1"),
    ({"compression": "onebit,start=2", "update": "sparse:4"}, "--update sparse:4 cannot wrap it"),
    ({"compression": "randk:0.1,start=2", "fsdp": True}, "--optimizer onebit_adam with --fsdp over every data axis"),
])
def test_refusals_are_one_line(kw, needle):
    from dpjax.errors import UserError

    with pytest.raises(UserError, match=re.escape(needle)) as e:
        _plan(optimizer="onebit_adam", **kw)
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
