"""The per-shard form of the compressed exchange between sites (dpjax.compression.shards):
2 sites of 4 devices (node=2 x data=4), each device sends only its quarter of the
site's gradient across. A cast gives the whole form's mean bit for bit; random-k gives
numpy's mean of the values its shared seed picks; nothing is lost, only delayed, for
every method with error feedback (float64, each device's error buffer its shard's);
the bytes that cross the node axis are each method's formula for the shards, 1/4 of the
whole form's; the plan picks the form; a checkpoint resumes bit for bit."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax import compression
from dpjax.collectives.cost import hlo_comm
from dpjax.compression import randk, topk
from dpjax.compression import Exchange
from dpjax.compression.shards import Shards, shard_shape
from dpjax.fusion import plan_buckets
from dpjax.plan import UsageError

from conftest import assert_resumes_bit_for_bit, tiny_gpt

K, SITES = 4, 2
SH = Shards(("data",), K, ("data",))
# w's matrix view is (12, 40): its shard is 10 rows of w.T (the longer side first)
SHAPES = {"w": (12, 40), "b": (40,), "v": (300,)}
STATEFUL = [n if compression.registry.get(n).number is None else
            f"{n}:{'0.1' if compression.registry.get(n).number_type is float else 2}"
            for n in compression.names() if compression.registry.get(n).stateful]
ALLREDUCE = {"algorithm": "ring", "fusion_mb": 64}


def _exchange(mesh, spec, shapes=SHAPES, per_shard=True):
    """A jitted exchange over `node` of per-site gradients (leading axis SITES, the same on
    every device of a site), in the per-shard form or the whole one; returns (f(grads,
    state) -> (each device's mean, leading axis SITES * K; state), the initial state)."""
    ex = Exchange(**ALLREDUCE, compression=spec, shards=SH if per_shard else None)
    specs = jax.tree.map(lambda s: P("node", *s), ex.specs({k: P() for k in shapes}, "node"),
                         is_leaf=lambda x: isinstance(x, P))
    dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32

    def init(_):
        return jax.tree.map(lambda x: x[None], ex.init({k: jnp.zeros(s, dtype) for k, s in shapes.items()}, "node"))

    def body(g, st):
        g, st = jax.tree.map(lambda x: x[0], (g, st))
        assert g["w"].shape == shapes["w"], g["w"].shape
        m, st = ex.mean(g, "node", st)
        return jax.tree.map(lambda x: x[None], m), jax.tree.map(lambda x: x[None], st)

    smap = lambda fn, i, o: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=i, out_specs=o, check_vma=False))  # noqa
    st = smap(init, P(("node", "data")), specs)(jnp.zeros(SITES * K))
    return smap(body, (P("node"), specs), (P(("node", "data")), specs)), st


def _grads(rng, dtype=np.float32):
    return {k: jnp.asarray(rng.standard_normal((SITES, *s)).astype(dtype)) for k, s in SHAPES.items()}


def _unshard(slots_K, shape):
    """numpy: a tensor of SHAPES from its K shards (w's are rows of w.T; rows padded)."""
    rows = slots_K.reshape(-1, *slots_K.shape[2:])
    if shape == SHAPES["w"]:
        return rows[:shape[1]].T
    return rows[:shape[0]]


def test_a_cast_per_shard_is_the_whole_form_bit_for_bit(mesh_of):
    mesh = mesh_of(f"node={SITES},data={K}", SITES * K)
    g = _grads(np.random.default_rng(0))
    shard, _ = _exchange(mesh, "bf16")
    whole, _ = _exchange(mesh, "bf16", per_shard=False)
    (a, _), (b, _) = shard(g, ()), whole(g, ())
    for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
        assert not np.array_equal(np.asarray(a[k][0]), np.mean(np.asarray(g[k]), 0))  # it really casts


def test_randk_per_shard_is_numpy_mean_of_the_picked_values(mesh_of):
    """Each device's shard is one fusion bucket; random-k picks the same indices of it on
    both sites (the shared seed: exchange 0, bucket 0) and averages them; the rest is 0."""
    mesh = mesh_of(f"node={SITES},data={K}", SITES * K)
    g = _grads(np.random.default_rng(1))
    f, st = _exchange(mesh, "randk:0.1")
    m, st = f(g, st)
    shapes = {k: shard_shape(s, K) for k, s in SHAPES.items()}
    assert len(plan_buckets([jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes.values()], 64 * 2**20).buckets) == 1
    d = sum(int(np.prod(s)) for s in shapes.values())
    idx = np.asarray(randk.indices(jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 0), 0), d,
                                   topk.count(d, 0.1)))
    for i in range(K):  # device i's shards, numpy: padded, longer side first, rows i*r..(i+1)*r
        flat = []
        for k in sorted(SHAPES):  # the tree's leaf order: the bucket's
            x = np.asarray(g[k])
            x = np.swapaxes(x, 1, 2) if k == "w" else x
            r = shapes[k][0]
            x = np.concatenate([x, np.zeros((SITES, r * K - x.shape[1], *x.shape[2:]), x.dtype)], 1)
            flat.append(x[:, i * r:(i + 1) * r].reshape(SITES, -1))
        flat = np.concatenate(flat, 1)
        want = np.zeros(d, np.float32)
        want[idx] = (flat[0, idx] + flat[1, idx]) / 2
        at = 0
        for k in sorted(SHAPES):
            n = int(np.prod(shapes[k]))
            got = np.asarray(m[k][i]).T if k == "w" else np.asarray(m[k][i])  # device i of site 0
            r = shapes[k][0]
            got_rows = np.concatenate([got, np.zeros((r * K - got.shape[0], *got.shape[1:]), got.dtype)])
            np.testing.assert_array_equal(got_rows[i * r:(i + 1) * r].reshape(-1), want[at:at + n])
            at += n
    for k in SHAPES:  # every device of both sites applies the same mean
        assert all(np.array_equal(np.asarray(m[k][0]), np.asarray(m[k][j])) for j in range(SITES * K))


@pytest.mark.parametrize("spec", STATEFUL)
def test_nothing_is_lost_only_delayed_per_shard(mesh_of, spec):
    """sum of the applied means + the sites' mean error buffer (each device's its shard's,
    put together in numpy) == sum of the true means (float64)."""
    mesh = mesh_of(f"node={SITES},data={K}", SITES * K)
    rng = np.random.default_rng(2)
    with jax.enable_x64(True):
        f, st = _exchange(mesh, spec)
        applied = true = 0
        for _ in range(4):
            g = _grads(rng, np.float64)
            m, st = f(g, st)
            for k in SHAPES:
                assert all(np.array_equal(np.asarray(m[k][0]), np.asarray(m[k][j])) for j in range(SITES * K))
            applied = applied + np.concatenate([np.ravel(m[k][0]) for k in SHAPES])
            true = true + np.concatenate([np.ravel(np.mean(np.asarray(g[k]), 0)) for k in SHAPES])
        for k, s in SHAPES.items():  # the error buffer mirrors the shard: (sites, K slots, shard)
            assert st.error[k].shape == (SITES, K, *shard_shape(s, K)), st.error[k].shape
        error = np.concatenate([np.ravel(np.mean([_unshard(np.asarray(st.error[k][w]), s) for w in range(SITES)], 0))
                                for k, s in SHAPES.items()])
        if spec == "onebit":  # 1-bit Adam's servers keep an error too: each site's device its shard's chunk
            error = error + np.concatenate([np.ravel(np.sum([_unshard(np.asarray(st.method[k][w]), s)
                                                             for w in range(SITES)], 0)) for k, s in SHAPES.items()])
        assert np.abs(applied - true).max() > 1e-3  # it really compresses
        np.testing.assert_allclose(applied + error, true, rtol=0, atol=1e-12)


def _crossing_bytes(text: str) -> int:
    """What the busiest device sends across the node axis: the compiled point-to-point
    steps whose pairs join devices of different sites (node-major numbering)."""
    crossing = []
    for line in text.splitlines():
        pairs = re.search(r"source_target_pairs=\{([\d,{}]*)\}", line)
        if "collective-permute" in line and pairs:
            cross = [int(s) // K != int(t) // K for s, t in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
            assert all(cross) or not any(cross), line  # a step is across or inside, not both
            if all(cross):
                crossing.append(line)
    return hlo_comm("\n".join(crossing)).max_bytes


@pytest.mark.parametrize("spec", STATEFUL + ["powersgd:1"])
def test_bytes_across_sites_are_the_formula_of_the_shards(mesh_of, spec):
    """(Not the casts: XLA's CPU backend widens a bf16 point-to-point step to float32.)"""
    mesh = mesh_of(f"node={SITES},data={K}", SITES * K)
    shapes = {"w": (512, 64), "b": (2048,), "v": (4096,)}  # a shard: 19 x 512 values, whole blocks of 256 a rank

    def crossing(per_shard):
        f, st = _exchange(mesh, spec, shapes, per_shard)
        g = {k: jax.ShapeDtypeStruct((SITES, *s), jnp.float32, sharding=NamedSharding(mesh, P("node")))
             for k, s in shapes.items()}
        return _crossing_bytes(f.lower(g, st).compile().as_text())

    from dpjax.compression.accounting import compressed_bytes

    shard = crossing(True)
    want = compressed_bytes(spec, [shard_shape(s, K) for s in shapes.values()], SITES, **ALLREDUCE)
    assert shard == want, (shard, want)
    whole = crossing(False)
    assert whole == compressed_bytes(spec, list(shapes.values()), SITES, **ALLREDUCE)
    if spec.split(":")[0] in ("int8", "int4"):  # linear in the values: exactly 1/K
        assert shard * K == whole, (shard, whole)
    elif spec.startswith("randk"):  # ceil(F d) values: 1/K up to that rounding
        assert shard * K == pytest.approx(whole, rel=1e-2), (shard, whole)  # 973 x 4 vs 3892 values
    else:
        assert shard < whole, (shard, whole)


def _plan(**kw):
    from dpjax.plan import resolve
    from dpjax.settings import Settings

    return resolve(Settings(seq_len=16, batch_size=16, model_options={"d_model": 32, "n_layers": 1, "n_heads": 8},
                            **kw))


def test_the_plan_picks_the_form():
    plan = _plan(mesh="2x4x1", compression="int8", compress_axes="node")
    assert plan.exchange.shards == Shards(("data",), 4, ("data", "model"))
    assert plan.describe()["exchange"]["per_shard"] == ["data"]
    from dpjax.compression.accounting import compressed_bytes

    shapes = [shard_shape(x.shape, 4) for x in jax.tree.leaves(jax.eval_shape(plan.model.init, jax.random.key(0)))]
    ratio = compressed_bytes(None, shapes, 2) / compressed_bytes("int8", shapes, 2)
    assert plan.describe()["compression_ratio"] == ratio
    assert _plan(mesh="2x4x1", compression="int8", compress_axes="node", compress_whole=True).exchange.shards is None
    assert _plan(mesh="2x2x2", fsdp=True, compression="int8", compress_axes="node").exchange.shards is None
    assert _plan(mesh="2x4x1", compression="int8", workers="node").exchange.shards is None  # no --compress-axes
    with pytest.raises(UsageError, match="--compress-whole") as info:
        _plan(mesh="2x4x1", compression="int8", compress_whole=True)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("extra", [
    ("--mesh", "2x4x1", "--compress-axes", "node", "--compression", "powersgd:2"),
    pytest.param(("--mesh", "2x4x1", "--update", "delayed:2", "--compress-axes", "node", "--compression", "topk:0.05"),
                 marks=pytest.mark.slow)])
def test_a_checkpoint_mid_run_resumes_bit_for_bit_per_shard(corpus, tmp_path, extra):
    """Each device's error buffer and Q (its shard's) are in the checkpoint: 3 steps, a
    restart, 3 more equal 6 straight steps exactly."""
    assert_resumes_bit_for_bit(tiny_gpt(corpus, *extra), tmp_path)
