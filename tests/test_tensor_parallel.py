"""Tensor-parallel layers against their dense twins, FSDP's gather against lax, the
layout (spec table, optimizer-state specs, sharded norm), sharded init, and the
per-device bytes read from the compiled program's memory analysis.

Each parallel layer runs inside shard_map over a model axis of size 1, 2, 4 and 8; the
gradients are taken inside the body (as in a training step) against a fixed random
cotangent, and compared with jax.vjp of a plain-jnp dense twin written independently.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax import step as S
from dpjax.compute import tensor_parallel as tp
from dpjax.models import get_model
from dpjax.models.gpt import causal_attention
from dpjax.optim import OptimizerConfig
from dpjax.sharding import make_layout, sq_norm, state_specs
from dpjax.compute.tensor_parallel import Parallel

SIZES = [1, 2, 4, 8]
B, T, D, F, H, K, V = 2, 4, 8, 16, 8, 3, 32
TOL = dict(rtol=2e-5, atol=2e-6)  # float32: the sharded sums add partial products in another order


def rand(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def run_sharded(mesh, body, args, in_specs, out_specs):
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False))
    return jax.tree.map(np.asarray, fn(*placed))


def local_vjp(layer, cot_index):
    """A body returning (output, grads of <cotangent, output> w.r.t. every input but the
    cotangent, which is the argument at `cot_index`)."""
    def body(*args):
        cot = args[cot_index]
        rest = args[:cot_index] + args[cot_index + 1:]

        def f(*xs):
            return layer(*xs)

        out, vjp = jax.vjp(f, *rest)
        return (out, *vjp(cot.astype(out.dtype)))
    return body


def dense_vjp(fn, args, cot):
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(jnp.asarray(cot)))


def check(got, want, scaled: bool = False):
    """`scaled`: the absolute tolerance is per the leaf's largest value. Float32 round-off of a
    sum is relative to the terms summed, not to a result they cancel to: the attention's
    gradients (values up to ~57 here) hold a few elements near 0 that are differences of such
    terms, where the sharded and the dense sums, each as near float64's as the other
    (3.8e-5 and 5.0e-5 at most), land 5.5e-6 apart on an AMD EPYC's XLA:CPU (the fixed 2e-6
    held on the Intel machines the test was written on)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        w = np.asarray(w)
        atol = TOL["atol"] * max(1.0, float(np.abs(w).max())) if scaled else TOL["atol"]
        np.testing.assert_allclose(g, w, rtol=TOL["rtol"], atol=atol)


@pytest.mark.parametrize("n", SIZES)
def test_column_parallel(mesh_of, n):
    mesh, par = mesh_of(f"1x{n}", n), Parallel("model")
    x, w, b, cot = rand(0, B, T, D), rand(1, D, F), rand(2, F), rand(3, B, T, F)
    got = run_sharded(mesh, local_vjp(lambda x, w, b: tp.column_parallel(x, w, b, par), 3), (x, w, b, cot),
                      [P(), P(None, "model"), P("model"), P(None, None, "model")],
                      (P(None, None, "model"), P(), P(None, "model"), P("model")))
    check(got, dense_vjp(lambda x, w, b: jnp.einsum("btd,df->btf", x, w) + b, (x, w, b), cot))


@pytest.mark.parametrize("n", SIZES)
def test_row_parallel(mesh_of, n):
    mesh, par = mesh_of(f"1x{n}", n), Parallel("model")
    h, w, b, cot = rand(0, B, T, F), rand(1, F, D), rand(2, D), rand(3, B, T, D)
    got = run_sharded(mesh, local_vjp(lambda h, w, b: tp.row_parallel(h, w, b, par), 3), (h, w, b, cot),
                      [P(None, None, "model"), P("model", None), P(), P()],
                      (P(), P(None, None, "model"), P("model", None), P()))
    check(got, dense_vjp(lambda h, w, b: jnp.einsum("btf,fd->btd", h, w) + b, (h, w, b), cot))


@pytest.mark.parametrize("n,algorithm", [(n, "ring") for n in SIZES] + [(4, "butterfly"), (4, "psum"), (8, "tree")])
def test_head_parallel_attention(mesh_of, n, algorithm):
    mesh, par = mesh_of(f"1x{n}", n), Parallel("model", algorithm)
    x, wqkv, wo, cot = rand(0, B, T, D), rand(1, D, 3, H, K), rand(2, H, K, D), rand(3, B, T, D)
    got = run_sharded(mesh, local_vjp(lambda x, a, o: tp.head_parallel_attention(x, a, o, causal_attention, par), 3),
                      (x, wqkv, wo, cot), [P(), P(None, None, "model", None), P("model", None, None), P()],
                      (P(), P(), P(None, None, "model", None), P("model", None, None)))

    def dense(x, wqkv, wo):  # written out per head: scaled dot product, causal mask, softmax
        q, k, v = (jnp.einsum("btd,dhk->bthk", x, wqkv[:, i]) for i in range(3))
        s = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(K)
        s = jnp.where(np.tril(np.ones((T, T), bool)), s, -jnp.inf)
        return jnp.einsum("bhts,bshk,hkd->btd", jax.nn.softmax(s, -1), v, wo)

    check(got, dense_vjp(dense, (x, wqkv, wo), cot), scaled=True)


@pytest.mark.parametrize("n", SIZES)
def test_vocab_parallel_embed(mesh_of, n):
    mesh, par = mesh_of(f"1x{n}", n), Parallel("model")
    tokens = np.random.default_rng(0).integers(0, V, (B, T)).astype(np.int32)
    table, cot = rand(1, V, D), rand(2, B, T, D)
    body = local_vjp(lambda e: tp.vocab_parallel_embed(jnp.asarray(tokens), e, par), 1)
    got = run_sharded(mesh, body, (table, cot), [P("model", None), P()], (P(), P("model", None)))
    check(got, dense_vjp(lambda e: e[tokens], (table,), cot))


@pytest.mark.parametrize("n", SIZES)
def test_vocab_parallel_cross_entropy(mesh_of, n):
    mesh, par = mesh_of(f"1x{n}", n), Parallel("model")
    logits = 4 * rand(0, B, T, V)  # spread out, so that the max shift matters
    targets = np.random.default_rng(1).integers(0, V, (B, T)).astype(np.int32)
    body = lambda z: jax.value_and_grad(lambda z: tp.vocab_parallel_cross_entropy(z, jnp.asarray(targets), par))(z)  # noqa: E731
    got = run_sharded(mesh, body, (logits,), [P(None, None, "model")], (P(), P(None, None, "model")))

    def dense(z):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z, -1), targets[..., None], -1))

    check(got, jax.value_and_grad(dense)(logits))


@pytest.mark.parametrize("n,dim", [(1, 0), (2, 1), (4, 0), (8, 1), (4, -1)])
def test_fsdp_gather_param(mesh_of, n, dim):
    """Forward: the whole parameter from its shards; backward: every rank's cotangent
    reduce-scattered and averaged (numpy: the mean over ranks, cut into shards).
    dim -1: a parameter too small to split, replicated; its gradient is averaged."""
    mesh = mesh_of(f"{n}x1", n)
    x = rand(0, *[s * (n if i == dim else 1) for i, s in enumerate((4, 6))])  # split over `data` on dim
    cots = rand(1, n, *x.shape)  # each rank's own cotangent of the gathered parameter
    spec = {0: P("data", None), 1: P(None, "data"), -1: P()}[dim]

    def body(x, cot):
        out, vjp = jax.vjp(lambda x: tp.gather_param(x, dim, "data"), x)
        return out, vjp(cot[0])[0]

    got = run_sharded(mesh, body, (x, cots), [spec, P("data")], (P(), spec))
    np.testing.assert_array_equal(got[0], x)
    np.testing.assert_allclose(got[1], cots.mean(0), rtol=1e-6, atol=1e-7)


def test_layout_tables_and_errors(mesh_of):
    gpt = get_model("gpt", seq_len=16, d_model=32, n_layers=1, n_heads=8)
    lay = make_layout(gpt, mesh_of("2x4", 8))
    blk = lay.specs["blocks"]  # the stacked layers: no stage axis here, so L is not split
    assert blk["attn"]["wqkv_LsxDx3xHmxK"] == P(None, None, None, "model", None)
    assert blk["mlp"]["w2_LsxFmxD"] == P(None, "model", None) and blk["mlp"]["b2_LsxD"] == P(None, None)
    fsdp = make_layout(gpt, mesh_of("2x4", 8), fsdp=True)  # the largest free dimension goes to `data`
    assert fsdp.specs["blocks"]["mlp"]["w1_LsxDxFm"] == P(None, "data", "model")  # never the layer axis
    assert fsdp.specs["embed_VmxD"] == P("model", "data") and fsdp.gather_dims["embed_VmxD"] == 1
    with pytest.raises(ValueError, match=r"wo_LsxHmxKxD .*dimension 1 of size 2 does not split over the 4 devices"):
        make_layout(get_model("gpt", seq_len=16, d_model=32, n_layers=1, n_heads=2), mesh_of("2x4", 8))


def test_state_specs_and_sharded_norm(mesh_of, put):
    mesh = mesh_of("2x4", 8)
    params = {"w": rand(0, 8, 16), "b": rand(1, 16), "s": rand(2, 4)}
    specs = {"w": P("data", "model"), "b": P("model"), "s": P()}
    tx = optax.adamw(1e-3)
    sspecs = state_specs(tx, tx.init(params), specs)
    assert sspecs[0].mu == specs and sspecs[0].nu == specs and sspecs[0].count == P()
    args = [put(mesh, params[k], specs[k]) for k in "wbs"]
    got = run_sharded(mesh, lambda w, b, s: sq_norm({"w": w, "b": b, "s": s}, specs), args,
                      [specs[k] for k in "wbs"], P())
    np.testing.assert_allclose(got, float(optax.tree.norm(params)) ** 2, rtol=1e-6)


@pytest.fixture(scope="module")
def gpt():
    return get_model("gpt", seq_len=16, d_model=32, n_layers=2, n_heads=8)


@pytest.mark.slow
def test_init_is_the_same_on_every_mesh(mesh_of, gpt):
    ref = jax.tree.map(np.asarray, S.init_params(gpt, make_layout(gpt, mesh_of("1x1", 1)), jax.random.key(3)))
    for spec, fsdp in [("2x4", False), ("1x8", False), ("8x1", True)]:
        params = S.init_params(gpt, make_layout(gpt, mesh_of(spec, 8), fsdp=fsdp), jax.random.key(3))
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), ref)
    params = S.init_params(gpt, make_layout(gpt, mesh_of("1x8", 8)), jax.random.key(3))
    w1 = params["blocks"]["mlp"]["w1_LsxDxFm"]  # 2 x 32 x 512: no device holds it whole
    assert {s.data.shape for s in w1.addressable_shards} == {(2, 32, 64)}


def sync_step(model, layout, opt=OptimizerConfig(), batch=8):
    step = S.for_model(model, layout, global_batch=batch, opt=opt, donate=False)
    params, state = step.init(S.init_params(model, layout, jax.random.key(0)))
    return step, params, state


@pytest.mark.slow
def test_without_tensor_parallelism_parameters_are_replicated(mesh_of, gpt, put):
    """tensor_parallel=False: parameters replicated over `model`, the dense model, a local
    clipping norm. AdamW with clipping on 2x4 then trains like one device (a split
    layout with a local norm would not)."""
    opt = OptimizerConfig(clip_norm=0.05)
    batches = [np.random.default_rng(i).integers(0, 256, (1, 8, 17)).astype(np.int32) for i in range(3)]

    def losses(mesh):
        step, params, state = sync_step(gpt, make_layout(gpt, mesh, tensor_parallel=False), opt)
        assert params["blocks"]["mlp"]["w1_LsxDxFm"].sharding.is_fully_replicated
        out = []
        for b in batches:
            params, state, loss = step.train(params, state, put(mesh, b, P(None, "data")))
            out.append(float(loss))
        return out

    np.testing.assert_allclose(losses(mesh_of("2x4", 8)), losses(mesh_of("1x1", 1)), rtol=2e-5)


def compiled_argument_bytes(model, mesh, fsdp):
    step, params, state = sync_step(model, make_layout(model, mesh, fsdp=fsdp))
    batch = jax.device_put(np.zeros((1, 8, 17), np.int32), NamedSharding(mesh, P(None, "data")))
    compiled = step.train.lower(params, state, batch).compile()
    return compiled.memory_analysis().argument_size_in_bytes, params, state


@pytest.mark.slow  # tests/test_nn.py and test_pipeline.py read the memory analysis in the quick set
def test_per_device_bytes_from_memory_analysis(mesh_of, gpt):
    """Parameters + Adam state per device, from the compiled step: the model-split leaves
    take a quarter on 2x4, and everything but scalars an eighth under FSDP on 8x1."""
    batch_bytes = 8 * 17 * 4
    full, params, opt_state = compiled_argument_bytes(gpt, mesh_of("1x1", 1), False)
    split_names = {k for k, s in gpt.SPECS.items() if "model" in tuple(s)}

    def bytes_of(tree, keep):
        return sum(x.nbytes for path, x in jax.tree_util.tree_flatten_with_path(tree)[0] if keep(path, x))

    def is_split(path, x):
        return any(getattr(k, "key", None) in split_names for k in path)

    state = (params, opt_state)
    split = bytes_of(state, is_split)
    rest = bytes_of(state, lambda p, x: not is_split(p, x))
    assert full == split + rest + batch_bytes
    tp_bytes, _, _ = compiled_argument_bytes(gpt, mesh_of("2x4", 8), False)
    assert tp_bytes - rest - batch_bytes // 2 == split // 4
    fsdp_bytes, _, _ = compiled_argument_bytes(gpt, mesh_of("8x1", 8), True)
    scalars = bytes_of(state, lambda p, x: np.ndim(x) == 0)
    assert fsdp_bytes - scalars - batch_bytes // 8 == (full - scalars - batch_bytes) // 8
