"""FSDP's reduce-scatter through random-k with error feedback (dpjax.compression.sharded):
nothing is lost, only delayed; the compiled program sends the formula's bytes; training
equals an unsharded reference of the same compressed update; a checkpoint resumes bit
for bit; the methods that are not linear are refused with their reason."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax import compression
from dpjax.collectives.cost import hlo_comm
from dpjax.compression import randk, sharded
from dpjax.compression import Exchange
from dpjax.compression.feedback import State
from dpjax.compression.topk import count

from conftest import assert_resumes_bit_for_bit, tiny_gpt

N = 4
SHAPES = {"b": (6,), "v": (300,), "w": (12, 40)}  # full local shapes, in the tree's order
DIMS = {"b": -1, "v": 0, "w": 1}  # split over the N data ranks on this dimension (-1: replicated)


def _out_spec(d):
    return P() if d < 0 else P(*[("data" if i == d else None) for i in range(d + 1)])


def _exchange(mesh, spec):
    """A jitted FSDP exchange (`Exchange.reduce_scatter_mean`) of per-rank full gradients
    (leading axis N); the means come back assembled (each rank's shard in its place), the
    state per rank."""
    st_specs = State(P(), {k: P("data") for k in SHAPES}, ())

    def body(g, st):
        g = {k: x[0] for k, x in g.items()}
        assert g["w"].shape == SHAPES["w"], g["w"].shape
        m, st = Exchange("ring", 64, spec).reduce_scatter_mean(g, DIMS, "data", st)
        assert m["w"].shape == (12, 40 // N), m["w"].shape
        return m, st

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), st_specs),
                              out_specs=({k: _out_spec(d) for k, d in DIMS.items()}, st_specs), check_vma=False))
    return f, State(jnp.zeros((), jnp.int32), {k: jnp.zeros((N, *s)) for k, s in SHAPES.items()}, ())


def test_nothing_is_lost_only_delayed(mesh_of):
    """sum of the applied means + the mean error buffer == sum of the true means (float64)."""
    mesh = mesh_of(f"data={N}", N)
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        f, st = _exchange(mesh, "randk:0.1")
        applied = true = 0
        for _ in range(4):
            g = {k: jnp.asarray(rng.standard_normal((N, *s))) for k, s in SHAPES.items()}
            m, st = f(g, st)
            applied = applied + np.concatenate([np.ravel(m[k]) for k in SHAPES])
            true = true + np.concatenate([np.ravel(np.mean(g[k], 0)) for k in SHAPES])
        assert st.error["w"].dtype == jnp.float64
        error = np.concatenate([np.ravel(np.mean(st.error[k], 0)) for k in SHAPES])
        assert np.abs(applied - true).max() > 1e-3  # it really compresses
        np.testing.assert_allclose(applied + error, true, rtol=0, atol=1e-12)


def test_compiled_bytes_are_the_formula(mesh_of):
    """The reduce-scatters carry k values a shard (random-k: 3 steps of 12 and 8 floats;
    the replicated tensor's allreduce of one value): what `sharded.wire_bytes` says, and
    far less than FSDP's exact reduce-scatters, which it also predicts."""
    mesh = mesh_of(f"data={N}", N)
    shapes, dims = list(SHAPES.values()), list(DIMS.values())
    for spec in ("randk:0.1", "randk:0.1,start=1"):  # start: the exact branch is compiled in too
        f, st = _exchange(mesh, spec)
        g = {k: jax.ShapeDtypeStruct((N, *s), jnp.float32, sharding=NamedSharding(mesh, P("data")))
             for k, s in SHAPES.items()}
        comm = hlo_comm(f.lower(g, st).compile().as_text())
        packed, plain = (sharded.wire_bytes(shapes, dims, N, c) for c in (spec, None))
        assert packed == 3 * 4 * (12 + 8) + 2 * 3 * 4, packed  # by hand, from the docstring
        assert comm.max_bytes == (packed if spec == "randk:0.1" else packed + plain), (comm.max_bytes, packed, plain)
    exact = jax.jit(jax.shard_map(lambda g: sharded.exact({k: x[0] for k, x in g.items()}, DIMS, "data", "ring"),
                                  mesh=mesh, in_specs=(P("data"),),
                                  out_specs={k: _out_spec(d) for k, d in DIMS.items()}, check_vma=False))
    assert hlo_comm(exact.lower(g).compile().as_text()).max_bytes == plain > 8 * packed


def _plan(**kw):
    from dpjax.plan import resolve
    from dpjax.settings import Settings

    tiny = {"d_model": 32, "n_layers": 1, "n_heads": 8}
    return resolve(Settings(seq_len=16, batch_size=16, **{"model_options": tiny, **kw}))


@pytest.mark.slow  # test_compression_metrics' FSDP rows check the same difference, step by step
def test_a_train_step_sends_the_formula(mesh_of):
    """A GPT step under FSDP through random-k sends, beyond what the exact FSDP step
    sends, exactly the formulas' difference (the all-gathers are the same)."""
    from dpjax import step as S
    from dpjax.compression.accounting import exchange_bytes
    from dpjax.timeline import compiled_text

    def sent(plan):
        st = S.for_plan(plan)
        params, state = st.init(S.init_params(plan.model, plan.layout, jax.random.key(0)))
        batch = jax.ShapeDtypeStruct((1, 16, 17), jnp.int32, sharding=NamedSharding(plan.mesh, P(None, "data")))
        return hlo_comm(compiled_text(st.train, params, state, batch)).max_bytes

    plan = _plan(mesh="8x1", fsdp=True, compression="randk:0.05")
    exact = _plan(mesh="8x1", fsdp=True)
    assert plan.workers == () and plan.layout.fsdp
    packed, plain = exchange_bytes(plan)[1], exchange_bytes(plan, None)[1]
    assert sent(exact) - sent(plan) == plain - packed > 0, (sent(exact), sent(plan), plain, packed)


def _loss(params, batch_BdxK1, par):
    """A small regression through the FSDP gathers (float64 when x64 is on)."""
    p = par.use(params)
    x, y = batch_BdxK1[:, :-1], batch_BdxK1[:, -1]
    pred = jnp.tanh(x @ p["w"]) @ p["v"] + p["b"].sum()
    return jnp.mean((pred - y) ** 2)


def test_training_equals_an_unsharded_reference(mesh_of):
    """3 SGD steps under FSDP through randk:0.25 equal the same compressed update computed
    from each device's gradient by the unsharded loss, with error feedback, the shared
    indices' sums and the SGD step in numpy (float64). The indices are drawn per
    destination shard (`randk.shard_indices`, key(1)), not per fusion bucket as the
    allreduce's random-k draws them, so it is not the non-FSDP randk run."""
    from dpjax import step as S
    from dpjax.compression import Exchange
    from dpjax.plan import for_layout
    from dpjax.sharding import layout_from_specs
    from dpjax.compute.tensor_parallel import DENSE

    mesh = mesh_of(f"data={N}", N)
    B, D, K, lr, spec = 8, 8, 12, 0.3, "randk:0.25"
    rng = np.random.default_rng(5)
    with jax.enable_x64(True):
        params = {"b": jnp.asarray(rng.standard_normal(2)), "v": jnp.asarray(rng.standard_normal(K)),
                  "w": jnp.asarray(rng.standard_normal((D, K)) / 3)}
        abstract = jax.eval_shape(lambda: params)
        layout = layout_from_specs(abstract, {k: P() for k in params}, mesh, fsdp=True)
        dims = {k: d for k, d in zip(params, jax.tree.leaves(layout.gather_dims))}
        assert dims == {"b": -1, "v": 0, "w": 1}, dims
        plan = for_layout(None, layout, global_batch=B, optimizer=optax.sgd(lr), exchange=Exchange(compression=spec))
        st = S.build(_loss, plan, abstract_params=abstract, donate=False)
        p, state = st.init(jax.device_put(params, layout.shardings()))
        batches = [rng.standard_normal((1, B, D + 1)) for _ in range(3)]
        ref = {k: np.asarray(v) for k, v in params.items()}
        err = [{k: np.zeros_like(v) for k, v in ref.items()} for _ in range(N)]
        grad = jax.jit(jax.grad(lambda prm, b: _loss(prm, b, DENSE)))
        for t, batch in enumerate(batches):
            p, state, _ = st.train(p, state, jax.device_put(batch, NamedSharding(mesh, P(None, "data"))))
            rows = np.split(batch[0], N)
            e = [{k: np.asarray(v) + err[r][k] for k, v in grad(ref, rows[r]).items()} for r in range(N)]
            key = jax.random.fold_in(jax.random.key(1), t)
            mean = {}
            for i, k in enumerate(ref):
                d = dims[k]
                if d < 0:  # replicated: the allreduce's random-k of one bucket, key(0)
                    bucket = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), t), 0)
                    picked = np.zeros(ref[k].size, bool)
                    picked[np.asarray(randk.indices(bucket, ref[k].size, count(ref[k].size, 0.25)))] = True
                    picked = picked.reshape(ref[k].shape)
                else:
                    c = ref[k].size // N
                    idx = np.asarray(randk.shard_indices(jax.random.fold_in(key, i), N, c, count(c, 0.25)))
                    rows_mask = np.zeros((N, c), bool)
                    rows_mask[np.arange(N)[:, None], idx] = True
                    picked = np.moveaxis(rows_mask.reshape(np.moveaxis(ref[k], d, 0).shape), 0, d)
                sent = [np.where(picked, e[r][k], 0.0) for r in range(N)]
                mean[k] = sum(sent) / N
                for r in range(N):
                    err[r][k] = e[r][k] - sent[r]
            ref = {k: ref[k] - lr * mean[k] for k in ref}
            for k in ref:
                np.testing.assert_allclose(np.asarray(p[k]), ref[k], rtol=0, atol=1e-12, err_msg=f"{k} step {t}")
        for k in ref:
            np.testing.assert_allclose(np.asarray(state.exchange.error[k]), np.stack([e[k] for e in err]), rtol=0,
                                       atol=1e-12)


# 35-60 s on 2 cores (the FSDP + randk programs' compile). The fast set keeps per-device
# error buffers resumed bit for bit (test_compression_shards.py's
# test_a_checkpoint_mid_run_resumes_bit_for_bit_per_shard, test_compression_feedback.py's
# with start=2) and an FSDP checkpoint resumed (test_train.py's test_resume_on_another_mesh).
@pytest.mark.slow
def test_a_checkpoint_mid_run_resumes_bit_for_bit(corpus, tmp_path):
    """The error buffers (full-size, per device) are in the checkpoint: 3 steps, a
    restart, 3 more equal 6 straight steps exactly (the start step falls in the first 3)."""
    extra = ("--mesh", "8x1", "--fsdp", "--compression", "randk:0.1,start=2")
    assert_resumes_bit_for_bit(tiny_gpt(corpus, *extra), tmp_path)


NONLINEAR = [n for n in compression.names() if compression.registry.get(n).stateful
             and compression.registry.get(n).reduce_scatter is None]


@pytest.mark.parametrize("name", NONLINEAR)
def test_the_methods_that_are_not_linear_are_refused_with_their_reason(name):
    from dpjax.errors import UserError

    method = compression.registry.get(name)
    spec = name if method.number is None else f"{name}:{'0.1' if method.number_type is float else 2}"
    with pytest.raises(UserError) as e:
        _plan(mesh="8x1", fsdp=True, compression=spec)
    text = str(e.value)
    assert "\n" not in text and method.nonlinear and method.nonlinear in text, text
    assert "--workers node --compress-axes node" in text and "randk" in text, text
    plan = _plan(mesh="2x4x1", fsdp=True, compression=spec, workers="node", compress_axes="node")
    assert plan.workers == ("node",)  # the alternative the refusal names is accepted


def test_the_error_buffer_is_counted_where_it_lives():
    """Under FSDP through random-k each device keeps its full local gradient: n times
    its parameter shards (all split here), in the memory estimate and in describe()."""
    from dpjax.plan import memory

    plan = _plan(mesh="8x1", fsdp=True, compression="randk:0.1")
    need = memory.estimate(plan.model, plan.layout, plan.global_batch, plan.exchange)
    assert all(d >= 0 for d in jax.tree.leaves(plan.layout.gather_dims))
    assert need["error"] == 8 * need["params"] > 0
    assert plan.describe()["compression_error_buffer"]["bytes_per_device"] == need["error"]
    plain = _plan(mesh="8x1", fsdp=True, compression="randk:0.1,ef=0")
    assert memory.estimate(plain.model, plain.layout, 16, plain.exchange)["error"] == 0
    from dpjax.errors import UserError

    with pytest.raises(UserError, match=re.escape("--fsdp with --compression randk:0.1 and a stage axis")):
        _plan(mesh="stage=2,data=4", fsdp=True, compression="randk:0.1",
              model_options={"d_model": 32, "n_layers": 2, "n_heads": 8})
