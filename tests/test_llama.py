"""The Llama model sharded against itself unsharded: tensor parallelism with the K/V heads
split (n_kv_heads 4 on a model axis of 4) and replicated (2 on 4, 4 on 8), FSDP, and a
pipeline; one SGD step of lr 1 gives the negated gradient, compared with jax.grad of the
dense loss. Its arithmetic against HuggingFace's own implementation is
tests/test_hf_llama.py's."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dpjax import step as S
from dpjax.errors import UserError
from dpjax.models import get_model
from dpjax.models.llama import rope_table, rotate
from dpjax.optim import OptimizerConfig
from dpjax.sharding import make_layout

TOL = dict(rtol=2e-5, atol=2e-6)  # float32: the sharded sums add partial products in another order
SGD = OptimizerConfig(name="sgd", lr=1.0, clip_norm=0.0)


def llama(**kw):
    return get_model("llama", **{**dict(seq_len=8, d_model=32, n_layers=2, n_heads=8, d_ff=48,
                                        vocab_size=64), **kw})


def batch():
    return np.random.default_rng(0).integers(0, 64, (8, 9)).astype(np.int32)


def sgd_step(model, mesh, put, **layout_kw):
    """(loss, new - old parameters) after one SGD step of lr 1 on `mesh`."""
    layout = make_layout(model, mesh, **layout_kw)
    step = S.for_model(model, layout, global_batch=8, opt=SGD, donate=False)
    params, state = step.init(S.init_params(model, layout, jax.random.key(0)))
    before = jax.tree.map(np.asarray, params)
    params, state, loss = step.train(params, state, put(mesh, batch()[None], P(None, "data")))
    return float(loss), jax.tree.map(lambda a, b: np.asarray(a) - b, params, before)


def dense_loss_and_grads(model):
    params = jax.jit(model.init)(jax.random.key(0))
    loss, grads = jax.jit(jax.value_and_grad(model.loss))(params, jnp.asarray(batch()))
    return float(loss), grads


def check(got_loss, delta, model):
    loss, grads = dense_loss_and_grads(model)
    np.testing.assert_allclose(got_loss, loss, **TOL)
    jax.tree.map(lambda d, g: np.testing.assert_allclose(d, -np.asarray(g), **TOL), delta, grads)


@pytest.mark.parametrize("spec,kv,fsdp,tied", [
    ("2x4", 2, False, True),  # K/V replicated (2 heads, 4 model ranks), tied head
    pytest.param("8x1", 4, True, False, marks=pytest.mark.slow),  # FSDP (fast: the GPT's FSDP tests, same gathers)
    pytest.param("2x4", 4, False, False, marks=pytest.mark.slow),  # K/V split, one head a rank (fast: 2x4 above)
    pytest.param("1x8", 4, False, False, marks=pytest.mark.slow)])  # replicated, 2 ranks a head (fast: 2x4 above)
def test_sharded_equals_dense(mesh_of, put, spec, kv, fsdp, tied):
    model = llama(n_kv_heads=kv, tie_embeddings=tied)
    check(*sgd_step(model, mesh_of(spec, 8), put, fsdp=fsdp), model)


@pytest.mark.slow  # a pipeline's compile; the fast set keeps TP (above) and the GPT's pipelines
def test_pipelined_with_tensor_parallelism_equals_dense(mesh_of, put):
    """1F1B over 2 stages, 2 data ranks and 2 model ranks, one K/V head replicated."""
    from dpjax.plan import resolve
    from dpjax.settings import Settings

    model = llama(n_kv_heads=1, n_heads=4)
    mesh = mesh_of("stage=2,data=2,model=2", 8)
    plan = resolve(Settings(mesh="stage=2,data=2,model=2", batch_size=8, optimizer="sgd", lr=1.0, clip_norm=0.0,
                            model="llama"), mesh=mesh, model=model)
    step = S.for_plan(plan, donate=False)
    params, state = step.init(S.init_params(model, plan.layout, jax.random.key(0)))
    before = jax.tree.map(np.asarray, params)
    params, state, loss = step.train(params, state, put(mesh, batch()[None], P(None, "data")))
    check(float(loss), jax.tree.map(lambda a, b: np.asarray(a) - b, params, before), model)


def test_kv_heads_split_or_replicated(mesh_of):
    """2 K/V heads on a model axis of 4: replicated; 4 on 4: split (no device holds them all)."""
    for kv, local in ((2, 2), (4, 1)):
        model = llama(n_kv_heads=kv)
        layout = make_layout(model, mesh_of("2x4", 8))
        assert layout.specs["blocks"]["attn"]["wkv_LsxDx2xYmxK"] == (P(None, None, None, None, None) if kv == 2 else
                                                                    P(None, None, None, "model", None))
        params = S.init_params(model, layout, jax.random.key(0))
        assert {s.data.shape[3] for s in params["blocks"]["attn"]["wkv_LsxDx2xYmxK"].addressable_shards} == {local}
    with pytest.raises(UserError, match="one must divide the other"):
        llama(n_heads=6, n_kv_heads=2, d_model=36).sharding_table(SimpleNamespace(shape={"data": 1, "model": 3}))


def test_rotary_is_a_rotation_by_position():
    """Rotate-half rotary embedding: q.k after rotating q to position m and k to n depends
    on m - n only, and equals the complex rotation of each pair (i, i + K/2) by
    position x theta^(-2i/K) (an independent form of the same map)."""
    K, theta = 8, 500000.0
    sin, cos = rope_table(16, K, theta)
    x = np.random.default_rng(0).standard_normal((1, 16, 1, K)).astype(np.float32)
    got = np.asarray(rotate(jnp.asarray(x), jnp.asarray(sin)[None], jnp.asarray(cos)[None]))
    z = x[..., :K // 2] + 1j * x[..., K // 2:]
    angle = np.arange(16)[:, None] * theta ** (-np.arange(0, K, 2) / K)
    want = z * np.exp(1j * angle)[None, :, None]
    np.testing.assert_allclose(got, np.concatenate([want.real, want.imag], -1), rtol=1e-5, atol=1e-5)


def test_presets_plan_with_dry_run(capsys):
    """--preset names a shape that --dry-run plans here (for 80 GiB GPUs); a preset of
    another model than --model is one line, exit 2."""
    from dpjax.train.cli import main

    assert main(["--preset", "llama3-8b", "--mesh", "data=1,model=8", "--fsdp", "--device-memory", "80GiB",
                 "--batch-size", "8", "--seq-len", "2048", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "the plan fits" in out and "parameters 3.74 GiB" in out  # 8.03e9 float32 parameters / 8 devices
    assert main(["--preset", "llama3-1b", "--model", "mlp", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == "error: --preset llama3-1b is a llama model, not --model mlp"
