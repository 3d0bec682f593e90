"""`--dtype fp8` (dpjax.compute.fp8, dpjax.compute.policy): the scaled fp8 matmul against a numpy
emulation, forward and backward; the policy routing the layers' projections (and only
them) through it; the train step of every layout handing XLA fp8 dots; the refusals.

The reference is numpy with ml_dtypes' float8 types (the ones jax uses): each operand
scaled by largest / amax in float32, saturated, rounded to the fp8 grid by ml_dtypes'
cast, then multiplied in float64 and scaled back. Quantisation in numpy and in XLA must
land on the same grid points, so the only difference left is float32 accumulation:
at most K * 2^-24 of the sum of the absolute products (K terms), the bound checked."""

import collections
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dpjax import hlo
from dpjax.compute import fp8
from dpjax import step as S
from dpjax.plan import UsageError, resolve
from dpjax.compute.policy import Policy, fp8_refusal
from dpjax.compute.policy import resolve as resolve_policy
from dpjax.settings import Settings

GRIDS = {"e4m3": (jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0),
         "e5m2": (jnp.float8_e5m2, ml_dtypes.float8_e5m2, 57344.0)}


def np_quantise(x, fmt_np, top):
    """(the fp8 values as float64, 1 / scale) as numpy sees them: scale = top / amax in float32."""
    x = np.asarray(x, np.float32)
    amax = np.float32(np.max(np.abs(x)))
    s = np.float32(top) / amax if amax > 0 else np.float32(1)
    q = np.clip(x * s, -top, top).astype(fmt_np)
    return q.astype(np.float64), np.float64(np.float32(1) / s)


def np_scaled(spec, a, fa, b, fb):
    """einsum(spec) of a and b quantised to the grids fa and fb, float64, scaled back; and
    the same of their magnitudes (what float32 accumulation's error is proportional to)."""
    qa, ia = np_quantise(a, *GRIDS[fa][1:])
    qb, ib = np_quantise(b, *GRIDS[fb][1:])
    return np.einsum(spec, qa, qb) * ia * ib, np.einsum(spec, np.abs(qa), np.abs(qb)) * ia * ib


def assert_accumulated(got, want, mag, K):
    """got within float32 accumulation of K terms of want (and the final scaling's rounding)."""
    bound = K * 2.0**-24 * mag + 2.0**-22 * np.abs(want)
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound), (float(np.max(err - bound)), float(np.max(err)))


@pytest.mark.parametrize("fmt", list(GRIDS))
def test_quantise_lands_on_numpys_fp8_grid(fmt):
    """fp8.quantise's values are ml_dtypes' rounding of x * (top / amax), bit for bit; the
    tensor's largest magnitude lands on the grid's top; an all-zero tensor stays zero."""
    fmt_jax, fmt_np, top = GRIDS[fmt]
    x = np.asarray(jax.random.normal(jax.random.key(0), (64, 48))) * 3.0
    q, inv = fp8.quantise(jnp.asarray(x), fmt_jax)
    want, want_inv = np_quantise(x, fmt_np, top)
    assert q.dtype == fmt_jax and fp8.largest(fmt_jax) == top
    np.testing.assert_array_equal(np.asarray(q).astype(np.float64), want)
    assert float(inv) == want_inv
    assert np.max(np.abs(np.asarray(q, np.float32))) == top
    z, z_inv = fp8.quantise(jnp.zeros((4, 4)), fmt_jax)
    assert float(z_inv) == 1.0 and not np.any(np.asarray(z, np.float32))


SPECS = {  # the contractions the models make: (spec, a's shape, b's shape, contracted size K)
    "matmul": ("nd,df->nf", (24, 32), (32, 16), 32),
    "qkv": ("btd,dihk->ibthk", (2, 6, 32), (32, 3, 4, 8), 32),
    "attention output": ("bthk,hkd->btd", (2, 6, 4, 8), (4, 8, 32), 32),
    "experts": ("etd,edf->etf", (3, 5, 16), (3, 16, 24), 16),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_scaled_einsum_equals_the_numpy_emulation_forward_and_backward(name):
    """y = e4m3(x) . e4m3(w) scaled back; dx = e5m2(g) . e4m3(w) and dw = e4m3(x) . e5m2(g),
    each scaled back, against numpy's emulation; and not the exact product (it did
    quantise: fp8 is a few percent off)."""
    spec, xs, ws, K = SPECS[name]
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x, w = jax.random.normal(kx, xs), 0.05 * jax.random.normal(kw, ws)
    g = 1e-3 * jax.random.normal(kg, jax.eval_shape(lambda: jnp.einsum(spec, x, w)).shape)

    @jax.jit  # one program (eager, each op would compile on its own)
    def forward_backward(x, w, g):
        y, vjp = jax.vjp(lambda a, b: fp8.einsum(spec, a, b), x, w)
        return y, *vjp(g)

    y, dx, dw = forward_backward(x, w, g)
    a, b, out = spec.replace("->", ",").split(",")
    want, mag = np_scaled(spec, x, "e4m3", w, "e4m3")
    assert_accumulated(y, want, mag, K)
    # the backward's contractions: over the output's letters not in the operand kept
    want, mag = np_scaled(f"{out},{b}->{a}", g, "e5m2", w, "e4m3")
    assert_accumulated(dx, want, mag, np.prod([y.shape[out.index(c)] for c in out if c not in a]))
    want, mag = np_scaled(f"{a},{out}->{b}", x, "e4m3", g, "e5m2")
    assert_accumulated(dw, want, mag, np.prod([y.shape[out.index(c)] for c in out if c not in b]))
    exact = np.einsum(spec, np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert np.max(np.abs(np.asarray(y) - exact)) > 1e-3 * np.max(np.abs(exact))
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32


def test_the_policy_sends_compute_dtype_projections_to_fp8_and_nothing_else():
    """Under dtype=fp8 the layers compute in bfloat16 and their projections (bfloat16
    operands) go through fp8.einsum / fp8.matmul; a float32 projection (the tied head's
    logits) stays the plain float32 einsum; other dtypes never touch fp8."""
    pol = Policy(dtype="fp8")
    assert pol.compute == jnp.bfloat16
    x, w = jax.random.normal(jax.random.key(2), (2, 6, 32)), jax.random.normal(jax.random.key(3), (32, 16))
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    got = pol.matmul(xb, wb)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(fp8.einsum("nd,df->nf", xb.reshape(12, 32), wb), np.float32).reshape(
                                      2, 6, 16))
    assert not np.array_equal(np.asarray(got, np.float32), np.asarray(xb @ wb, np.float32))
    np.testing.assert_array_equal(pol.matmul(x, w), x @ w)  # float32 operands: as they are
    np.testing.assert_array_equal(pol.einsum("btd,df->btf", x, w), jnp.einsum("btd,df->btf", x, w))
    np.testing.assert_array_equal(Policy(dtype="bfloat16").matmul(xb, wb), xb @ wb)
    with pytest.raises(ValueError, match="no index repeated|explicit letters"):
        fp8.einsum("...d,df->...f", x, w)
    with pytest.raises(ValueError, match="must be in the other or the output"):
        fp8.einsum("nd,df->n", x[0], w)


GPT = dict(d_model=32, n_layers=2, n_heads=4, d_ff=64)
LLAMA = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)


def _matmuls(mesh_of, spec, **options):
    """Counter of (operand types) of the dots in the train step's HLO as handed to XLA."""
    mesh = mesh_of(spec, 8)  # every mesh here spans the 8 devices
    s = Settings(mesh=spec, data="synthetic", seq_len=16, batch_size=16, dtype="fp8",
                 **{"model_options": GPT, **options})
    plan = resolve(s, mesh=mesh)
    step = S.for_plan(plan, donate=False)
    params = jax.eval_shape(lambda k: S.init_params(plan.model, plan.layout, k, plan.policy), jax.random.key(0))
    low = step.train.lower(*jax.eval_shape(step.init, params), jax.ShapeDtypeStruct((1, 16, 17), jnp.int32))
    return collections.Counter(hlo.matmul_operand_types(low.as_text(dialect="hlo")))


E4, E5 = "f8e4m3fn", "f8e5m2"


@pytest.mark.parametrize("mesh", ["8x1", "2x4"])
def test_the_train_step_multiplies_the_projections_in_fp8(mesh_of, mesh):
    """GPT's scanned layer (one body for the 2 layers), replicated and tensor-parallel: its
    4 projections (QKV, attention output, MLP in and out) are e4m3 x e4m3 dots forward,
    and each has its two backward dots, e5m2 gradient x e4m3 (dx) and e4m3 x e5m2 (dw);
    attention's two products and their 4 gradients stay bfloat16, the tied head's forward
    and 2 backward float32."""
    got = _matmuls(mesh_of, mesh)
    assert got == {(E4, E4): 4, (E5, E4): 4, (E4, E5): 4, ("bf16", "bf16"): 6, ("f32", "f32"): 3}, got


@pytest.mark.parametrize("mesh,options,projections", [  # 3-5 s each to trace: the pipeline's in the fast set
    pytest.param("8x1", {"fsdp": True}, 4, marks=pytest.mark.slow),
    ("stage=2,data=4", {"microbatches": 2}, 4),
    pytest.param("data=2,context=4", {}, 4, marks=pytest.mark.slow),
    pytest.param("data=2,model=4", {"model": "llama", "model_options": LLAMA}, 6,  # q, kv, o, gate, up, down
                 marks=pytest.mark.slow),
    pytest.param("expert=2,data=4", {"model_options": {**GPT, "experts": 4}}, 4,  # QKV, output, the experts' two
                 marks=pytest.mark.slow),
])
def test_every_layout_gets_fp8_without_code_of_its_own(mesh_of, mesh, options, projections):
    """FSDP, a pipeline, a context axis, Llama over a model axis and a mixture of experts:
    fp8 comes through the policy, so each projection is an e4m3 forward dot with its e5m2
    dx and dw (a pipeline traces the layer's forward again inside its backward ticks: more
    forward dots there, never fewer)."""
    got = _matmuls(mesh_of, mesh, **options)
    n, m = got[(E4, E4)], got[(E5, E4)]
    assert m >= projections and m % projections == 0 and got[(E4, E5)] == m, got
    assert n >= m and n % projections == 0, got
    assert not {t for t in got if any(d.startswith("f8") for d in t)} - {(E4, E4), (E5, E4), (E4, E5)}, got


@pytest.mark.slow
def test_the_compiled_cpu_step_keeps_the_fp8_rounding(mesh_of):
    """XLA:CPU has no fp8 GEMM: its compiled step converts the fp8 operands to float32
    around each dot (as it does bfloat16's), but the rounding to e4m3 and e5m2 survives
    its passes (on a GPU the dots become cuBLASLt fp8 calls: the device check's)."""
    mesh = mesh_of("8x1", 8)
    plan = resolve(Settings(mesh="8x1", data="synthetic", seq_len=16, batch_size=16, dtype="fp8",
                            model_options=GPT), mesh=mesh)
    step = S.for_plan(plan, donate=False)
    params = jax.eval_shape(lambda k: S.init_params(plan.model, plan.layout, k, plan.policy), jax.random.key(0))
    text = step.train.lower(*jax.eval_shape(step.init, params),
                            jax.ShapeDtypeStruct((1, 16, 17), jnp.int32)).compile().as_text()
    converts = [line for line in text.splitlines() if " convert(" in line]
    assert any(f"{E4}[" in line.split("=")[1] for line in converts)  # rounded to e4m3
    assert any(f"{E5}[" in line.split("=")[1] for line in converts)  # the gradient to e5m2


def test_fp8_is_refused_where_it_cannot_run_and_said_in_the_plan(mesh_of):
    """One-line refusals: fp8 master weights, TPU, ROCm and an NVIDIA GPU older than 8.9;
    a plan in fp8 says what fp8 does; CPU notes that it emulates; MFU against bf16's peak."""
    with pytest.raises(UsageError, match="unknown --param-dtype 'fp8'"):
        resolve(Settings(mesh="8x1", data="synthetic", dtype="fp8", param_dtype="fp8"))
    with pytest.raises(ValueError, match="Policy param_dtype='fp8'"):
        Policy(dtype="fp8", param_dtype="fp8")
    for platform in ("tpu", "rocm"):
        with pytest.raises(ValueError, match="^--dtype fp8: .*; use --dtype bfloat16$"):
            resolve_policy("fp8", platform=platform)
    a100 = types.SimpleNamespace(device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")
    h100 = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
    assert "compute capability 8.0" in fp8_refusal("gpu", [a100]) and fp8_refusal("gpu", [h100]) is None
    from dpjax.train.plan_table import plan_lines

    plan = resolve(Settings(mesh="8x1", data="synthetic", dtype="fp8", model_options=GPT), mesh=mesh_of("8x1", 8))
    assert plan.policy.dtype == "fp8" and plan.policy.compute == jnp.bfloat16
    assert any("XLA:CPU emulates" in n for n in plan.notes)
    assert any("dtype fp8 (the layers' projection matmuls in float8" in line for line in plan_lines(plan))
    from dpjax.train.efficiency import peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4
