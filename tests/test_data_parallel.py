"""DistributedOptimizer and broadcast_params against independent references."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dpjax import DistributedOptimizer, broadcast_params
from dpjax.collectives import ALGORITHMS, cost
from dpjax.data_parallel import allreduce_gradients
from dpjax.fusion import plan_buckets

from conftest import flat_algorithms

N = 8


def _per_rank_tree(seed=0):
    """A gradient-like tree with a leading rank axis: leaf[r] is rank r's value."""
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((N, 6, 5)).astype(np.float32),
            "b": rng.standard_normal((N, 5)).astype(np.float32),
            "s": rng.standard_normal((N, 1)).astype(np.float32)}


def _shard_tree(mesh, put, tree):
    return jax.tree.map(lambda x: put(mesh, x.reshape(-1, *x.shape[2:]) if x.ndim > 2 else x, P("data")), tree)


@pytest.mark.parametrize("algorithm", flat_algorithms(ALGORITHMS))
@pytest.mark.parametrize("fusion_mb", [0, 64])
def test_allreduce_gradients_is_the_mean(mesh_of, put, algorithm, fusion_mb):
    mesh = mesh_of("8x1", N)
    tree = _per_rank_tree()
    local = jax.tree.map(lambda x: x.reshape(N * x.shape[1], *x.shape[2:]), tree)

    def body(g):
        return allreduce_gradients(g, "data", algorithm=algorithm, fusion_mb=fusion_mb)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
    out = f(jax.tree.map(lambda x: put(mesh, x), local))
    for k, x in tree.items():
        want = np.broadcast_to(x.astype(np.float64).mean(0), x.shape).reshape(local[k].shape)
        np.testing.assert_allclose(np.asarray(out[k]), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("compression,tol", [("bf16", 2**-8), ("fp16", 2**-11)])
def test_compression_rounds_on_the_wire_only(mesh_of, put, compression, tol):
    mesh = mesh_of("8x1", N)
    tree = _per_rank_tree(1)
    local = {k: x.reshape(N * x.shape[1], *x.shape[2:]) for k, x in tree.items()}
    f = jax.jit(jax.shard_map(
        lambda g: allreduce_gradients(g, "data", algorithm="ring", compression=compression,
                                      gradient_predivide_factor=2.0),
        mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
    steps = np.random.default_rng(2).integers(-50, 50, (N, 3)).astype(np.int32)  # an integer "gradient"
    out = f({**{k: put(mesh, v) for k, v in local.items()}, "steps": put(mesh, steps.reshape(-1))})
    # integers travel uncompressed and keep their dtype; as Horovod scales them: each rank's
    # value times 1/2 (the predivide), truncated, summed, times 2/8, truncated
    assert out["steps"].dtype == jnp.int32
    halves = np.trunc(steps * np.float32(0.5)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(out["steps"]).reshape(N, 3)[5],
                                  np.trunc(halves.sum(0) * np.float32(2 / N)).astype(np.int32))
    for k, x in tree.items():
        assert out[k].dtype == jnp.float32
        want = x.astype(np.float64).mean(0)
        got = np.asarray(out[k]).reshape(x.shape)[3]
        # each of the 8 terms and each of the 7 partial sums is rounded once to the wire dtype
        bound = tol * 16 * np.abs(x).max()
        assert np.max(np.abs(got - want)) <= bound
        assert not np.array_equal(got, want.astype(np.float32))  # it really was compressed


def test_broadcast_makes_different_ranks_equal(mesh_of, put):
    mesh = mesh_of("8x1", N)
    tree = _per_rank_tree(2)  # rank r initialised differently from every other rank
    local = {k: x.reshape(N * x.shape[1], *x.shape[2:]) for k, x in tree.items()}
    for root in (0, 5):
        f = jax.jit(jax.shard_map(lambda p: broadcast_params(p, "data", root=root, fusion_mb=0.0001),
                                  mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
        out = f({k: put(mesh, v) for k, v in local.items()})
        for k, x in tree.items():
            got = np.asarray(out[k]).reshape(x.shape)
            np.testing.assert_array_equal(got, np.broadcast_to(x[root], x.shape))


def _sgd_step(mesh, tx, model_loss):
    def step(params, opt_state, batch):
        grads = jax.grad(model_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()),
                                 check_vma=False))


def _linear_loss(params, batch):
    x, y = batch[:, :-1], batch[:, -1]
    return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2)


@pytest.mark.parametrize("k", [2, 3])
def test_accumulation_equals_k_times_larger_batch(mesh_of, put, k):
    mesh = mesh_of("8x1", N)
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
              "v": jnp.asarray(rng.standard_normal(3), jnp.float32)}
    b = 16  # per-pass global batch
    data = rng.standard_normal((3, k * b, 5)).astype(np.float32)  # 3 optimizer steps

    acc = DistributedOptimizer(optax.sgd(0.1), "data", backward_passes_per_step=k)
    big = DistributedOptimizer(optax.sgd(0.1), "data")
    step_acc, step_big = _sgd_step(mesh, acc, _linear_loss), _sgd_step(mesh, big, _linear_loss)
    pa, sa = params, acc.init(params)
    pb, sb = params, big.init(params)
    for s in range(3):
        # pass i takes rows i::k of the big batch's per-rank slices, so each rank sees the same data
        per_rank = data[s].reshape(N, k * b // N, 5)
        before = np.asarray(pa["w"])
        for i in range(k):
            pa, sa = step_acc(pa, sa, put(mesh, per_rank[:, i::k].reshape(-1, 5)))
            if i < k - 1:  # no update until the k-th pass
                np.testing.assert_array_equal(np.asarray(pa["w"]), before)
        pb, sb = step_big(pb, sb, put(mesh, per_rank.reshape(-1, 5)))
        for name in params:
            np.testing.assert_allclose(np.asarray(pa[name]), np.asarray(pb[name]), rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("algorithm", ["ring", "psum"])
def test_one_allreduce_per_bucket_in_compiled_step(mesh_of, put, algorithm):
    mesh = mesh_of("8x1", N)
    rng = np.random.default_rng(4)
    params = {f"p{i}": jnp.asarray(rng.standard_normal((64, 64)), jnp.float32) for i in range(5)}
    cap_mb = 2 * 64 * 64 * 4 / 2**20  # two leaves per bucket -> 3 buckets
    plan = plan_buckets(params, cap_mb * 2**20)
    assert len(plan.buckets) == 3
    tx = DistributedOptimizer(optax.sgd(0.1), "data", algorithm=algorithm, fusion_mb=cap_mb)

    def loss(p, batch):
        return sum(jnp.sum(jnp.tanh(batch @ w)) for w in p.values())

    step = _sgd_step(mesh, tx, loss)
    batch = put(mesh, rng.standard_normal((16, 64)).astype(np.float32))
    lowered = step.lower(params, tx.init(params), batch)
    hlo = cost.hlo_comm(lowered.compile().as_text())
    if algorithm == "psum":
        # dpjax emits one all-reduce per bucket; XLA's all-reduce combiner may then merge
        # them in the compiled program (it does on CPU), which only the baseline allows.
        assert lowered.as_text().count("stablehlo.all_reduce") == 3
        assert 1 <= hlo.ops["all-reduce"] <= 3 and set(hlo.ops) == {"all-reduce"}
    else:
        assert hlo.ops == {"collective-permute": 3 * 2 * (N - 1)}
        bucket_bytes = 2 * 64 * 64 * 4
        assert hlo.max_bytes == sum(cost.schedule("ring", N, b.nbytes // 4).bytes for b in plan.buckets)
        assert hlo.max_bytes == 2 * bucket_bytes * 2 * (N - 1) / N + 64 * 64 * 4 * 2 * (N - 1) / N


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'nccl'"):
        DistributedOptimizer(optax.sgd(0.1), algorithm="nccl")
    with pytest.raises(ValueError, match="unknown compression .int3."):
        DistributedOptimizer(optax.sgd(0.1), compression="int3")  # int8 is a method now (issue 20)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="unknown gradient op 'average'; choose one of mean, sum, adasum"):
        DistributedOptimizer(optax.sgd(0.1), op="average")
    with pytest.raises(ValueError, match="gradient_predivide_factor applies to op='mean' only, not to op='sum'"):
        DistributedOptimizer(optax.sgd(0.1), op="sum", gradient_predivide_factor=2.0)
