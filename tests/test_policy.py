"""The compute policy (dpjax.compute.policy) on every layout: scan equals the Python loop and
remat equals no remat bit for bit in float32; XLA's attention kernel equals the naive
one; bfloat16 compute trains within a few percent of float32; parameters and the
optimizer state stay float32 whatever the compute dtype.

The reference for scan and remat is the same run with the layers as a Python loop and
nothing recomputed (what dpjax did before the stack runner); for the kernels, the naive
T x T attention written out in `dpjax.compute.attention.naive`; for bfloat16, the float32 run."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import step as S
from dpjax.compute import attention
from dpjax.mesh import data_axes
from dpjax.models import get_model
from dpjax.plan import resolve
from dpjax.compute.policy import Policy
from dpjax.settings import Settings
from dpjax.compute.tensor_parallel import Parallel

GPT = dict(d_model=32, n_layers=4, n_heads=4, d_ff=64)
# The fast set runs the two cheapest layouts; the FSDP, pipeline and workers layouts are
# slow (15-30 s each on 2 cores) and run with -m slow. Each property keeps one sharded
# layout in the fast set: scan/remat the tensor-parallel one (its mesh has a data axis
# too; one device, bit for bit: test_scan_and_remat_equal_the_loop_bit_for_bit), bfloat16
# training 8x1 (bfloat16 compute on 2x4 against an exact simulation: test_step.py's fast
# cases with compute dtype bfloat16).
FAST = ("8x1", "2x4 tensor-parallel")
FAST_SCAN = ("2x4 tensor-parallel",)
FAST_BF16 = ("8x1",)
LAYOUTS = {  # name: (mesh, extra settings)
    "8x1": ("8x1", {}),
    "2x4 tensor-parallel": ("2x4", {}),
    "8x1 fsdp": ("8x1", {"fsdp": True}),
    "pipeline stage=2": ("stage=2,data=4", {"microbatches": 2}),
    "2x2x2 fsdp workers=node sparse:2": ("2x2x2", {"fsdp": True, "workers": "node", "update": "sparse:2"}),
}


@functools.cache
def _text():
    from dpjax.data import load_corpus

    return np.asarray(load_corpus("stdlib", max_bytes=200_000))


def run(mesh_of, layout, steps, batch=16, **options):
    """(losses, final parameters as numpy, plan) of `steps` steps (AdamW unless `options`
    say otherwise) of a 4-layer GPT."""
    spec, extra = LAYOUTS[layout]
    mesh = mesh_of(spec, 8)
    s = Settings(mesh=spec, data="synthetic", seq_len=16, batch_size=batch, seed=3,
                 **{"lr": 1e-2, "model_options": GPT, **extra, **options})
    plan = resolve(s, mesh=mesh)
    step = S.for_plan(plan, donate=False)
    params, state = step.init(S.init_params(plan.model, plan.layout, jax.random.key(0), plan.policy))
    rng = np.random.default_rng(0)
    text = _text()
    losses = []
    for _ in range(steps):
        starts = rng.integers(0, len(text) - 17, s.batch_size)
        batch = np.stack([text[i:i + 17] for i in starts])[None].astype(np.int32)  # Python source: learnable
        batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.P(None, data_axes(mesh))))
        params, state, loss = step.train(params, state, batch)
        losses.append(float(loss))
    return losses, jax.tree.map(np.asarray, step.consensus(params)), plan


def test_scan_and_remat_equal_the_loop_bit_for_bit():
    """float32 on one device: the scanned stack under every remat policy gives the loop's
    loss and gradient bit for bit (the same ops, recomputed in the same order)."""
    model = get_model("gpt", seq_len=16, **GPT)
    params = model.init(jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (16, 17), 0, 256)

    def grad(policy):
        return jax.jit(jax.value_and_grad(lambda p, b: model.loss(p, b, Parallel(policy=policy))))(params, batch)

    want_loss, want = grad(Policy(scan=False))
    for remat in ("none", "dots", "full"):
        loss, got = grad(Policy(remat=remat))
        assert loss == want_loss, remat
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, err_msg=remat), got, want)


def layouts(fast=FAST):
    return [pytest.param(name, marks=[] if name in fast else [pytest.mark.slow]) for name in LAYOUTS]


@pytest.mark.parametrize("layout", layouts(FAST_SCAN))
def test_scan_and_remat_equal_the_loop(mesh_of, layout):
    """float32 on every layout: the scanned stack under every remat policy against the
    loop, 3 SGD steps. Not bit for bit here: inside the sharded step XLA:CPU lays out
    some of the scan body's matmuls otherwise than the unrolled loop's and their sums
    round differently in the last bit (gradients 6e-8 apart on 1e-2 values; Adam would
    carry that on to 3e-6 in the parameters, so the comparison uses SGD, where it stays
    round-off)."""
    sgd = dict(batch=128, optimizer="sgd", lr=0.1, clip_norm=0.0)
    want_losses, want_params, _ = run(mesh_of, layout, 3, layer_loop=True, remat="none", **sgd)
    for remat in ("none", "dots", "full"):
        losses, params, plan = run(mesh_of, layout, 3, remat=remat, **sgd)
        assert plan.policy.scan and plan.policy.remat == remat and plan.policy.dtype == "float32"
        np.testing.assert_allclose(losses, want_losses, rtol=1e-6, err_msg=remat)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
            assert np.max(np.abs(a - b)) <= 1e-6 * np.max(np.abs(b)), (remat, np.max(np.abs(a - b)))


@pytest.mark.parametrize("layout", layouts(FAST_BF16))
def test_bfloat16_trains_like_float32(mesh_of, layout):
    """100 steps in bfloat16 compute end within a few percent of float32's loss; the
    master weights stay float32. At width 128 (heads of 32): at width 32 (heads of 8)
    bfloat16 ends 4-6% above float32 over two seeds, where seeds alone move it 1.3%."""
    wide = dict(GPT, d_model=128, n_layers=2, d_ff=256)
    f32, _, _ = run(mesh_of, layout, 100, dtype="float32", model_options=wide)
    bf16, params, plan = run(mesh_of, layout, 100, dtype="bfloat16", model_options=wide)
    assert plan.policy.compute == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float32)}
    end = lambda losses: np.mean(losses[-10:])  # noqa: E731  the same batches: one batch's loss is noisy
    assert end(f32) < 0.8 * f32[0]  # it learned something, so the comparison means something
    assert abs(end(bf16) - end(f32)) < 0.03 * end(f32), (end(bf16), end(f32))
    assert bf16 != f32  # bfloat16 did compute: the runs are not the same program


@pytest.mark.slow
def test_fp8_trains_like_bfloat16(mesh_of):
    """100 steps with the projections in fp8 (dpjax.compute.fp8) end within 3% of bfloat16's loss
    (issue 38), on the same batches; the master weights stay float32."""
    wide = dict(GPT, d_model=128, n_layers=2, d_ff=256)
    bf16, _, _ = run(mesh_of, "8x1", 100, dtype="bfloat16", model_options=wide)
    f8, params, plan = run(mesh_of, "8x1", 100, dtype="fp8", model_options=wide)
    assert plan.policy.compute == jnp.bfloat16 and plan.policy.dtype == "fp8"
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float32)}
    end = lambda losses: np.mean(losses[-10:])  # noqa: E731
    assert end(bf16) < 0.8 * bf16[0]
    assert abs(end(f8) - end(bf16)) < 0.03 * end(bf16), (end(f8), end(bf16))
    assert f8 != bf16  # fp8 did compute: the runs are not the same program


def _dots(mesh, dtype):
    """The dot_general lines of the lowered train step of the 8x1 run in `dtype`."""
    plan = resolve(Settings(mesh="8x1", data="synthetic", seq_len=16, batch_size=16, dtype=dtype,
                            model_options=GPT), mesh=mesh)
    step = S.for_plan(plan, donate=False)
    params = jax.eval_shape(lambda k: S.init_params(plan.model, plan.layout, k, plan.policy), jax.random.key(0))
    text = step.train.lower(*jax.eval_shape(step.init, params), jax.ShapeDtypeStruct((1, 16, 17), jnp.int32)).as_text()
    return [line for line in text.splitlines() if "dot_general" in line]


def test_bfloat16_compute_is_in_the_program(mesh_of):
    """The compiled step multiplies in bfloat16: every matmul of the bfloat16 run takes
    bfloat16 operands but the tied head's (the logits, forward and backward: a
    vocabulary-wide dimension, 256), which stays float32; none of the float32 run's does."""
    mesh = mesh_of("8x1", 8)
    f32, bf16 = _dots(mesh, "float32"), _dots(mesh, "bfloat16")
    assert len(f32) == len(bf16) > 0
    assert not any("bf16" in line for line in f32)
    operands = lambda line: line.split("(")[-1].split("->")[0]  # noqa: E731  "(tensor<..>, tensor<..>) -> .."
    head = [operands(x) for x in bf16 if "256" in operands(x)]
    body = [operands(x) for x in bf16 if "256" not in operands(x)]
    assert len(head) == 3 and len(body) >= 3 * 6, (head, body)  # head: forward, 2 backward; a layer: 6 forward
    assert all(o.count("xf32>") == 2 for o in head), head
    assert all(o.count("xbf16>") == 2 for o in body), body


@pytest.mark.parametrize("kernel", ["xla"])
def test_attention_kernels_equal_the_naive_one(kernel):
    """jax.nn.dot_product_attention (CPU: its XLA kernel) against the scores written out,
    forward and backward, and through the GPT's loss."""
    keys = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(key, (2, 24, 4, 8)) for key in keys)
    np.testing.assert_allclose(attention.causal(q, k, v, kernel), attention.naive(q, k, v), rtol=2e-6, atol=2e-6)
    # the naive kernel against numpy, so that the reference itself is checked
    s = np.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(8)
    s = np.where(np.tril(np.ones((24, 24), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(attention.naive(q, k, v), np.einsum("bhqt,bthk->bqhk", p, v), rtol=2e-6, atol=2e-6)
    model = get_model("gpt", seq_len=16, **GPT)
    params = model.init(jax.random.key(0))
    batch = jax.random.randint(jax.random.key(2), (4, 17), 0, 256)

    def grad(policy):  # jitted: eager dispatch compiles each op of the 4 layers alone (several CPU-s)
        return jax.jit(jax.value_and_grad(lambda p: model.loss(p, batch, Parallel(policy=policy))))(params)

    (want, g_want), (got, g_got) = grad(Policy()), grad(Policy(attention=kernel))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g_got, g_want)


def test_param_dtype_makes_bfloat16_master_weights(mesh_of):
    losses, params, plan = run(mesh_of, "8x1", 2, dtype="bfloat16", param_dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    assert all(np.isfinite(losses))


def test_policy_refuses_what_cannot_run():
    from dpjax.plan import UsageError

    with pytest.raises(UsageError, match="--attention cudnn: cuDNN attention needs an NVIDIA GPU"):
        resolve(Settings(mesh="8x1", data="synthetic", attention="cudnn"))
    with pytest.raises(ValueError, match="remat='some'"):
        Policy(remat="some")
    with pytest.raises(ValueError, match="attention kernel 'flash'"):
        attention.causal(*(jnp.zeros((1, 4, 1, 8)),) * 3, "flash")
