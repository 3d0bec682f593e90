"""Tensor fusion: bucket plans respect the cap and the dtype split; pack/unpack is the identity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.fusion import pack, plan_buckets, unpack


def _tree():
    rng = np.random.default_rng(0)
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return {
        "a": f32(10, 10),          # 400 B
        "b": [f32(3), f32(50)],    # 12 B, 200 B
        "c": jnp.asarray(rng.standard_normal(7), jnp.bfloat16),  # 14 B
        "d": f32(200),             # 800 B
        "e": jnp.float32(2.5),     # scalar, 4 B
        "f": jnp.asarray(rng.standard_normal((2, 3)), jnp.bfloat16),
    }


@pytest.mark.parametrize("cap", [0, 100, 450, 1000, 10**9])
def test_plan_respects_cap_and_dtype(cap):
    tree = _tree()
    leaves = jax.tree.leaves(tree)
    plan = plan_buckets(tree, cap)
    seen = sorted(i for b in plan.buckets for i in b.leaves)
    assert seen == list(range(len(leaves)))  # every leaf exactly once
    for b in plan.buckets:
        assert all(leaves[i].dtype == b.dtype for i in b.leaves)
        nbytes = sum(leaves[i].size * leaves[i].dtype.itemsize for i in b.leaves)
        assert nbytes == b.nbytes
        # over the cap only when a single leaf is itself bigger than the cap
        assert nbytes <= cap or len(b.leaves) == 1, (cap, b)
    if cap <= 0:
        assert len(plan.buckets) == len(leaves)
    if cap >= 10**9:
        assert len(plan.buckets) == 2  # one per dtype


def test_plan_greedy_in_tree_order():
    tree = _tree()
    plan = plan_buckets(tree, 450)
    # float32 leaves in tree order: a(400) b0(12) b1(200) d(800) e(4)
    f32 = [b.leaves for b in plan.buckets if b.dtype == np.float32]
    leaves = jax.tree.leaves(tree)
    sizes = [[leaves[i].size * 4 for i in b] for b in f32]
    assert sizes == [[400, 12], [200], [800], [4]]


@pytest.mark.parametrize("cap", [0, 100, 10**9])
def test_pack_unpack_identity(cap):
    tree = _tree()
    plan = plan_buckets(tree, cap)
    bufs = pack(plan, tree)
    assert len(bufs) == len(plan.buckets)
    assert all(buf.ndim == 1 for buf in bufs)
    back = unpack(plan, bufs)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_plan_from_shapes_only():
    tree = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _tree())
    plan = plan_buckets(tree, 450)
    assert plan == plan_buckets(_tree(), 450)
