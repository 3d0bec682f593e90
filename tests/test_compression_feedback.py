"""Compression with error feedback (dpjax.compression.feedback and the methods that use
it): nothing is lost, only delayed; the start steps are the uncompressed exchange bit for
bit; PowerSGD at full rank is exact; the quantised ring equals a numpy simulation hop by
hop; the compiled program sends each method's formula; EF-SignSGD converges on
Karimireddy et al.'s counterexample where sign alone does not; a checkpoint resumes
bit for bit."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dpjax.horovod as hvd
from dpjax import compression
from dpjax.collectives.cost import hlo_comm
from dpjax.compression import powersgd, quantise
from dpjax.compression import Exchange
from dpjax.data_parallel import DistributedOptimizer, allreduce_gradients

from conftest import assert_resumes_bit_for_bit, tiny_gpt

N = 4
SHAPES = {"w": (12, 40), "b": (40,), "v": (300,)}


def _example(name: str) -> str:
    """A spec of every registered method with error feedback (its number, if it takes one)."""
    method = compression.registry.get(name)
    return name if method.number is None else f"{name}:{'0.1' if method.number_type is float else 2}"


STATEFUL = [_example(n) for n in compression.names() if compression.registry.get(n).stateful]


def _exchange(mesh, spec, shapes=SHAPES):
    """A jitted exchange of per-rank trees (leading axis N) through `spec`, its state
    per rank; returns (f(grads, state) -> (means, state), the initial state)."""
    params = {k: jnp.zeros(s) for k, s in shapes.items()}
    ex = Exchange("ring", 64, spec)
    lead = jax.tree.map(lambda s: P("data", *s), ex.specs({k: P() for k in shapes}, "data"),
                        is_leaf=lambda x: isinstance(x, P))

    def body(g, st):
        g, st = jax.tree.map(lambda x: x[0], (g, st))
        assert g["w"].shape == shapes["w"], g["w"].shape
        m, st = ex.mean(g, "data", st)
        return jax.tree.map(lambda x: x[None], (m, st))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), lead), out_specs=(P("data"), lead),
                              check_vma=False))
    st = jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *x.shape)), ex.init(params, "data"))
    return f, st


@pytest.mark.parametrize("spec", STATEFUL)
def test_nothing_is_lost_only_delayed(mesh_of, spec):
    """sum of the applied means + the mean error buffer == sum of the true means (float64)."""
    mesh = mesh_of(f"data={N}", N)
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        f, st = _exchange(mesh, spec, {k: s for k, s in SHAPES.items()})
        st = jax.tree.map(lambda x: x.astype(jnp.float64) if x.dtype == jnp.float32 else x, st)
        applied = true = 0
        for _ in range(4):
            g = {k: jnp.asarray(rng.standard_normal((N, *s))) for k, s in SHAPES.items()}
            m, st = f(g, st)
            for k in SHAPES:  # every rank applies the same mean
                np.testing.assert_array_equal(m[k][0], m[k][N - 1])
            applied = applied + np.concatenate([np.ravel(m[k][0]) for k in SHAPES])
            true = true + np.concatenate([np.ravel(np.mean(g[k], 0)) for k in SHAPES])
        error = np.concatenate([np.ravel(np.mean(st.error[k], 0)) for k in SHAPES])
        if spec == "onebit":  # 1-bit Adam's servers keep an error too: rank r's chunk in its buffer
            error = error + np.concatenate([np.ravel(np.sum(st.method[k], 0)) for k in SHAPES])
        assert np.abs(applied - true).max() > 1e-3  # it really compresses
        np.testing.assert_allclose(applied + error, true, rtol=0, atol=1e-12)


@pytest.mark.parametrize("spec", ["powersgd:2,start=3", "int8,start=3"])
def test_before_start_the_exchange_is_the_uncompressed_one(mesh_of, spec):
    mesh = mesh_of(f"data={N}", N)
    f, st = _exchange(mesh, spec)
    exact = jax.jit(jax.shard_map(
        lambda g: jax.tree.map(lambda x: x[None], allreduce_gradients(jax.tree.map(lambda x: x[0], g), "data",
                                                                       algorithm="ring", fusion_mb=64)),
        mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
    rng = np.random.default_rng(1)
    for step in range(4):
        g = {k: jnp.asarray(rng.standard_normal((N, *s)), jnp.float32) for k, s in SHAPES.items()}
        m, st = f(g, st)
        same = all(np.array_equal(m[k], v) for k, v in exact(g).items())
        assert same == (step < 3), step
    assert st.t[0] == 4


def test_powersgd_at_full_rank_is_the_exact_mean(mesh_of):
    mesh = mesh_of(f"data={N}", N)
    a, b = 5, 3
    rng = np.random.default_rng(2)
    M = rng.standard_normal((N, a, b))
    Q = rng.standard_normal((b, b))

    def run(rank):
        def body(m):
            assert m.shape == (1, a, b), m.shape
            mean = lambda xs: allreduce_gradients(xs, "data", algorithm="ring")  # noqa: E731
            approx, _ = powersgd.factor_mean([m[0]], [jnp.asarray(Q[:, :rank])], mean)
            return approx[0][None]

        return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                                check_vma=False))(jnp.asarray(M)))

    with jax.enable_x64(True):
        np.testing.assert_allclose(run(b)[0], M.mean(0), rtol=0, atol=1e-12)
        assert np.abs(run(b - 1)[0] - M.mean(0)).max() > 1e-3  # below full rank it is not


def _np_quantise(x, bits):
    """numpy's own quantiser: per block of BLOCK values the smallest power of two 2^k with
    L 2^k >= max|x| (found by search, not by dpjax's frexp arithmetic), q = round(x / 2^k)."""
    L = 2 ** (bits - 1) - 1
    c = x.shape[0]
    blocks = math.ceil(c / quantise.BLOCK)
    xb = np.pad(x, (0, blocks * quantise.BLOCK - c)).reshape(blocks, quantise.BLOCK)
    out = np.empty_like(xb)
    for i, block in enumerate(xb):
        top, k = float(np.abs(block).max()), -128
        while L * 2.0 ** k < top:
            k += 1
        out[i] = np.clip(np.round(block / np.float32(2.0 ** k)), -L, L) * np.float32(2.0 ** k)
    return out.reshape(-1)[:c]


def _np_ring(xs, bits):
    """The ring of quantised messages, every hop simulated in numpy: (means, errors)."""
    n, d = xs.shape
    c = math.ceil(d / n)
    rows = np.pad(xs, ((0, 0), (0, c * n - d))).reshape(n, n, c)
    err = np.zeros_like(rows)
    partial = [rows[r, r].copy() for r in range(n)]
    for s in range(n - 1):
        sent = []
        for r in range(n):
            q = _np_quantise(partial[r], bits)
            err[r, (r - s) % n] += partial[r] - q
            sent.append(q)
        partial = [sent[(r - 1) % n] + rows[r, (r - s - 1) % n] for r in range(n)]
    out = np.zeros((n, c), np.float32)
    for r in range(n):
        q = _np_quantise(partial[r], bits)
        err[r, (r + 1) % n] += partial[r] - q
        out[(r + 1) % n] = q
    mean = (out / np.float32(n)).astype(np.float32).reshape(-1)[:d]
    return mean, err.reshape(n, -1)[:, :d]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_ring_equals_numpy_hop_by_hop(mesh_of, bits):
    """Each rank's error holds the rounding of each of its hops at that hop's chunk, so
    equal errors mean every hop equals numpy's."""
    mesh = mesh_of(f"data={N}", N)
    d = 2 * N * quantise.BLOCK + 37  # several blocks a chunk, and a ragged tail
    xs = np.random.default_rng(3).standard_normal((N, d)).astype(np.float32)
    xs[1, :50] *= 1e3  # one rank's large values set their blocks' scales
    f = jax.jit(jax.shard_map(lambda x: tuple(v[None] for v in quantise.ring_mean(x[0], "data", bits)),
                              mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
    mean, err = f(jnp.asarray(xs))
    want_mean, want_err = _np_ring(xs, bits)
    for r in range(N):
        np.testing.assert_array_equal(np.asarray(mean[r]), want_mean)
    np.testing.assert_array_equal(np.asarray(err), want_err)


@pytest.mark.parametrize("spec", STATEFUL + ["topk:0.01", "powersgd:1"])
def test_compiled_bytes_are_the_formula(mesh_of, spec):
    mesh = mesh_of(f"data={N}", N)
    f, st = _exchange(mesh, spec)
    g = {k: jax.ShapeDtypeStruct((N, *s), jnp.float32, sharding=NamedSharding(mesh, P("data")))
         for k, s in SHAPES.items()}
    text = f.lower(g, st).compile().as_text()
    comm = hlo_comm(text)
    want = compression.check(spec).wire_bytes(list(SHAPES.values()), N, compression.parse(spec),
                                              {"algorithm": "ring", "fusion_mb": 64})
    assert comm.max_bytes == want, (comm.max_bytes, want)
    dense = hlo_comm(jax.jit(jax.shard_map(
        lambda x: allreduce_gradients(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data"),
        check_vma=False)).lower(g).compile().as_text()).max_bytes
    assert want < dense, (want, dense)


def test_ef_signsgd_converges_where_sign_does_not(mesh_of):
    """Karimireddy et al. (ICML 2019), counterexample 1: f(x) = <a1,x>^2 + <a2,x>^2 with
    a1 = [1, -1+e], a2 = [-1, 1+e], each worker holding one term, x0 = [1, 1]. Every
    (scaled) sign is +-[1, -1], so without feedback x1 + x2 never moves off 2; with it
    x reaches the optimum 0. Run through DistributedOptimizer on 2 ranks."""
    mesh = mesh_of("data=2", 2)
    eps = 0.5
    A = jnp.asarray([[1.0, -1 + eps], [-1.0, 1 + eps]])

    def run(spec):
        tx = DistributedOptimizer(optax.sgd(0.05), "data", compression=spec)

        def body(a):
            assert a.shape == (1, 2), a.shape
            x = jnp.ones(2)
            grad = jax.grad(lambda x: jnp.dot(a[0], x) ** 2)

            def one(carry, _):
                x, state = carry
                updates, state = tx.update(grad(x), state, x)
                return (optax.apply_updates(x, updates), state), None

            (x, _), _ = jax.lax.scan(one, (x, tx.init(x)), None, length=2000)
            return x[None]

        x = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))(A)
        return float(jnp.sum((A @ x[0]) ** 2)), np.asarray(x[0])

    plain, x = run("sign,ef=0")
    assert plain > 0.4 and abs(x.sum() - 2) < 1e-5, (plain, x)
    ef, x = run("sign")
    assert ef < 1e-6, (ef, x)


@pytest.mark.parametrize("extra", [
    ("--mesh", "8x1", "--compression", "powersgd:2,start=2"),
    pytest.param(("--mesh", "2x4x1", "--update", "sparse:2,outer=0.7", "--compress-axes", "node", "--compression",
                  "int4"), marks=pytest.mark.slow),
    pytest.param(("--mesh", "8x1", "--update", "delayed:2", "--compression", "topk:0.05"), marks=pytest.mark.slow)])
def test_a_checkpoint_mid_run_resumes_bit_for_bit(corpus, tmp_path, extra):
    """The error buffers and PowerSGD's Q are in the checkpoint: 3 steps, a restart, 3
    more equal 6 straight steps exactly."""
    assert_resumes_bit_for_bit(tiny_gpt(corpus, *extra), tmp_path)


@pytest.mark.parametrize("make", [lambda spec: DistributedOptimizer(optax.sgd(1.0), "data", compression=spec),
                                  lambda spec: hvd.DistributedOptimizer(optax.sgd(1.0), compression=spec)],
                         ids=["dpjax", "horovod"])
def test_distributed_optimizers_take_the_methods(mesh_of, make):
    """One SGD step (lr 1) through int8 moves the parameters by numpy's ring mean, and
    each rank's state holds numpy's error buffer; hvd.allreduce refuses a stateful method."""
    mesh = mesh_of(f"data={N}", N)
    d = N * quantise.BLOCK + 5
    xs = np.random.default_rng(4).standard_normal((N, d)).astype(np.float32)
    tx = make(hvd.Compression.int8)

    def body(g):
        assert g.shape == (1, d), g.shape
        w = jnp.zeros(d)
        updates, state = tx.update(g[0], tx.init(w), w)
        return optax.apply_updates(w, updates)[None], state.compression.error[None]

    w, err = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))(
        jnp.asarray(xs))
    want_mean, want_err = _np_ring(xs, 8)
    np.testing.assert_array_equal(np.asarray(w[0]), -want_mean)
    np.testing.assert_array_equal(np.asarray(err), want_err)
    assert hvd.Compression.powersgd(4, start=10) == "powersgd:4,start=10"
    with pytest.raises(ValueError, match="keeps error-feedback state across steps"):
        jax.jit(jax.shard_map(lambda g: hvd.allreduce(g, compression=hvd.Compression.sign), mesh=mesh,
                              in_specs=P("data"), out_specs=P("data"), check_vma=False))(jnp.asarray(xs))


def _plan(**kw):
    from dpjax.plan import resolve
    from dpjax.settings import Settings

    return resolve(Settings(seq_len=16, batch_size=16, **kw))


TINY = {"d_model": 32, "n_layers": 1, "n_heads": 8}


def test_compress_axes_node_compresses_only_what_crosses_sites():
    """2 sites of 4 (2x4x1), int8 over node: every uint8 point-to-point step pairs devices
    of different sites, and every step inside a site is exact float32."""
    from dpjax import step as S
    from dpjax.timeline import compiled_text

    plan = _plan(mesh="2x4x1", compression="int8", compress_axes="node", model_options=TINY)
    assert plan.workers == ("node",) and plan.exchange.inside().compression is None
    st = S.for_plan(plan)
    params, state = st.init(S.init_params(plan.model, plan.layout, jax.random.key(0)))
    batch = jax.ShapeDtypeStruct((1, 16, 17), jnp.int32, sharding=NamedSharding(plan.mesh, P(None, ("node", "data"))))
    text = compiled_text(st.train, params, state, batch)
    sends = re.findall(r"= (\w+)\[[\d,]*\]\{[^}]*\} collective-permute\(.*source_target_pairs=\{([\d,{}]*)\}", text)
    assert {d for d, _ in sends} == {"u8", "f32"}, sends
    for dtype, pairs in sends:
        cross = [int(s) // 4 != int(t) // 4 for s, t in re.findall(r"\{(\d+),(\d+)\}", pairs)]
        assert all(cross) if dtype == "u8" else not any(cross), (dtype, pairs)


def test_the_warning_when_compression_cannot_pay():
    from dpjax.compression.accounting import warning as compression_warning

    link = ["node=183ms,23mbit"]
    tiny = _plan(mesh="2x4x1", compression="bf16", link=link, model_options=TINY)
    # 14 ring steps of 183 ms dwarf 324 kB at 23 Mbit/s: halving the bytes cannot pay
    assert compression_warning(tiny).startswith("warning: --compression bf16 cannot pay on --link node=183ms,23mbit")
    assert compression_warning(_plan(mesh="2x4x1", compression="int8", compress_axes="node", link=link)) is None
    assert compression_warning(_plan(mesh="2x4x1", compression="bf16", model_options=TINY)) is None  # no link


@pytest.mark.parametrize("kw,needle", [
    ({"fsdp": True, "compression": "sign"},
     "--compression sign cannot run inside FSDP's reduce-scatter, it is not linear"),
    ({"compression": "powersgd"}, "--compression: compression 'powersgd' needs the rank R: e.g. powersgd:4"),
    ({"compression": "topk:0.01,ef=2"}, "ef takes 0 or 1"),
    ({"mesh": "2x4x1", "compression": "int8", "compress_axes": "node", "workers": "data"},
     "name the same axes in --workers"),
    ({"mesh": "2x4x1", "compress_axes": "node"}, "--compress-axes node needs a --compression")])
def test_refusals_are_one_line(kw, needle):
    from dpjax.errors import UserError

    with pytest.raises(UserError, match=re.escape(needle)) as e:
        _plan(**{"model_options": TINY, **kw})
    assert "\n" not in str(e.value)
