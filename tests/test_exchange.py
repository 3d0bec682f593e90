"""The exchange object itself (`dpjax.compression.exchange.Exchange`) against references
that do not run through it: `lax.pmean` for the plain form, numpy for error feedback
(nothing lost, only delayed; the start steps exact), for the per-shard form across
sites (a bf16 cast simulated in numpy; error feedback per shard) and for FSDP's
reduce-scatter form. Gradients are small integers where a test compares bit for bit,
so every summation order gives the same float."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from dpjax.compression import Exchange
from dpjax.compression.shards import Shards

SHAPES = {"b": (40,), "w": (12, 40)}


def _ints(rng, lead, shapes=SHAPES):
    return {k: jnp.asarray(rng.integers(-8, 9, (lead, *s)), jnp.float32) for k, s in shapes.items()}


def _smap(mesh, fn, i, o):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=i, out_specs=o, check_vma=False))


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_the_plain_mean_is_pmean(mesh_of, algorithm):
    """Over two axes at once, through a small fusion cap (several buckets)."""
    mesh = mesh_of("node=2,data=4", 8)
    ex = Exchange(algorithm, 0.001)
    g = _ints(np.random.default_rng(0), 8)

    def body(g):
        g = jax.tree.map(lambda x: x[0], g)
        m, st = ex.mean(g, ("node", "data"))
        assert st == () and not ex.keeps_state(("node", "data"))
        want = lax.pmean(g, ("node", "data"))
        return jax.tree.map(lambda x: x[None], (m, want))

    got, want = _smap(mesh, body, P(("node", "data")), P(("node", "data")))(g)
    for k in SHAPES:
        np.testing.assert_array_equal(got[k], want[k])
        np.testing.assert_array_equal(got[k][0], np.mean(np.asarray(g[k]), 0))
    assert ex.mean(g, ())[0] is g  # over no axes: the tree as it is


def _feedback(mesh, ex, axes, lead):
    """A jitted mean of per-device trees (leading axis = the devices) with its state per device."""
    specs = jax.tree.map(lambda s: P(lead, *s), ex.specs({k: P() for k in SHAPES}, axes),
                         is_leaf=lambda x: isinstance(x, P))

    def init(_):
        return jax.tree.map(lambda x: x[None], ex.init({k: jnp.zeros(s) for k, s in SHAPES.items()}, axes))

    def body(g, st):
        g, st = jax.tree.map(lambda x: x[0], (g, st))
        m, st = ex.mean(g, axes, st)
        return jax.tree.map(lambda x: x[None], (m, st))

    n = mesh.size
    return _smap(mesh, body, (P(lead), specs), (P(lead), specs)), _smap(mesh, init, P(lead), specs)(jnp.zeros(n))


def test_error_feedback_starts_exact_and_loses_nothing(mesh_of):
    """sign,start=1 over 4 devices: the first mean is numpy's, bit for bit; after 4
    exchanges, sum(applied means) + mean(error buffers) == sum(true means) (float64)."""
    mesh = mesh_of("data=4", 4)
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        ex = Exchange("ring", 64, "sign,start=1")
        f, st = _feedback(mesh, ex, "data", "data")
        st = jax.tree.map(lambda x: x.astype(jnp.float64) if x.dtype == jnp.float32 else x, st)
        applied = true = 0
        for step in range(4):
            g = jax.tree.map(lambda x: x.astype(jnp.float64), _ints(rng, 4))
            m, st = f(g, st)
            mean = {k: np.mean(np.asarray(g[k]), 0) for k in SHAPES}
            if step == 0:
                for k in SHAPES:
                    np.testing.assert_array_equal(m[k][0], mean[k])
            for k in SHAPES:  # every device applies the same mean
                np.testing.assert_array_equal(m[k][0], m[k][3])
            applied = applied + np.concatenate([np.ravel(m[k][0]) for k in SHAPES])
            true = true + np.concatenate([np.ravel(mean[k]) for k in SHAPES])
        assert np.asarray(st.t).tolist() == [4] * 4
        error = np.concatenate([np.ravel(np.mean(st.error[k], 0)) for k in SHAPES])
        assert np.abs(applied - true).max() > 1e-3  # it really compresses
        np.testing.assert_allclose(applied + error, true, rtol=0, atol=1e-12)


SITES, K = 2, 4
SH = Shards(("data",), K, ("data",))


def test_per_shard_cast_is_numpy_bf16_of_the_sites(mesh_of):
    """bf16 per shard across 2 sites of 4: each device sends its shard, the site gathers;
    every device ends with numpy's (bf16(a) + bf16(b)) rounded to bf16, then halved."""
    mesh = mesh_of(f"node={SITES},data={K}", SITES * K)
    ex = Exchange("ring", 64, "bf16", shards=SH)
    site = _ints(np.random.default_rng(2), SITES)
    site = {k: x + 0.3 for k, x in site.items()}  # not integers: the cast rounds them

    def body(g):
        m, st = ex.mean(jax.tree.map(lambda x: x[0], g), "node")
        assert st == ()
        return jax.tree.map(lambda x: x[None], m)

    got = _smap(mesh, body, P("node"), P(("node", "data")))(site)
    bf = ml_dtypes.bfloat16
    for k in SHAPES:
        a, b = (np.asarray(site[k][i]).astype(bf) for i in range(SITES))
        want = (a.astype(np.float32) + b.astype(np.float32)).astype(bf).astype(np.float32) / 2
        assert not np.array_equal(want, np.mean(np.asarray(site[k]), 0))  # it really casts
        for d in range(SITES * K):
            np.testing.assert_array_equal(got[k][d], want)


def test_per_shard_error_feedback_loses_nothing(mesh_of):
    """sign per shard across 2 sites: the devices' error buffers hold their shards (with
    their slot); the sites' gathered means plus the mean error make the true sum."""
    mesh = mesh_of(f"node={SITES},data={K}", SITES * K)
    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        ex = Exchange("ring", 64, "sign", shards=SH)
        specs = jax.tree.map(lambda s: P("node", *s), ex.specs({k: P() for k in SHAPES}, "node"),
                             is_leaf=lambda x: isinstance(x, P))

        def init(_):
            zeros = {k: jnp.zeros(s, jnp.float64) for k, s in SHAPES.items()}
            return jax.tree.map(lambda x: x[None], ex.init(zeros, "node"))

        def body(g, st):
            g, st = jax.tree.map(lambda x: x[0], (g, st))
            m, st = ex.mean(g, "node", st)
            return jax.tree.map(lambda x: x[None], m), jax.tree.map(lambda x: x[None], st)

        st = _smap(mesh, init, P(("node", "data")), specs)(jnp.zeros(SITES * K))
        f = _smap(mesh, body, (P("node"), specs), (P(("node", "data")), specs))
        applied = true = 0
        for _ in range(3):
            g = {k: jnp.asarray(rng.standard_normal((SITES, *s))) for k, s in SHAPES.items()}
            m, st = f(g, st)
            for k in SHAPES:
                assert all(np.array_equal(m[k][0], m[k][d]) for d in range(SITES * K))
            applied = applied + np.concatenate([np.ravel(m[k][0]) for k in SHAPES])
            true = true + np.concatenate([np.ravel(np.mean(np.asarray(g[k]), 0)) for k in SHAPES])
        # each site's error, its K shards put back together: the slot of device (site, i) is shard i
        rows = {k: np.asarray(st.error[k]).reshape(SITES, K, *st.error[k].shape[2:]) for k in SHAPES}
        error = 0
        for s in range(SITES):
            whole = {"b": rows["b"][s].reshape(-1)[:40], "w": rows["w"][s].reshape(-1, 12)[:40].T}
            error = error + np.concatenate([np.ravel(whole[k]) for k in SHAPES]) / SITES
        assert np.abs(applied - true).max() > 1e-3
        np.testing.assert_allclose(applied + error, true, rtol=0, atol=1e-12)


def test_fsdp_form_starts_as_numpy_reduce_scatter(mesh_of):
    """reduce_scatter_mean with randk,start=1: the first exchange puts on each device its
    shard of numpy's mean (dimension 1 of w, b replicated); the second compresses."""
    n = 4
    mesh = mesh_of(f"data={n}", n)
    dims = {"b": -1, "w": 1}
    ex = Exchange("ring", 64, "randk:0.1,start=1")
    from dpjax.compression import sharded

    def init(_):
        return jax.tree.map(lambda x: x[None], sharded.init(ex.compression, {"b": jnp.zeros(40),
                                                                          "w": jnp.zeros((12, 10))}, dims, n))

    st_specs = jax.tree.map(lambda _: P("data"), jax.eval_shape(init, jnp.zeros(1)))

    def body(g, st):
        g, st = jax.tree.map(lambda x: x[0], (g, st))
        m, st = ex.reduce_scatter_mean(g, dims, "data", st)
        assert m["w"].shape == (12, 40 // n), m["w"].shape
        return m, jax.tree.map(lambda x: x[None], st)

    out = {"b": P(), "w": P(None, "data")}
    st = _smap(mesh, init, P("data"), st_specs)(jnp.zeros(n))
    f = _smap(mesh, body, (P("data"), st_specs), (out, st_specs))
    rng = np.random.default_rng(4)
    for step in range(2):
        g = _ints(rng, n)
        m, st = f(g, st)
        same = all(np.array_equal(m[k], np.mean(np.asarray(g[k]), 0)) for k in SHAPES)
        assert same == (step == 0), step
