"""Experts beside the update rules whose workers diverge (issue #40): with the workers over
the data axes other than `expert` (--workers node), each worker holds all E experts across
its expert axis, the experts are replicas between workers, and the rule's averages over
the workers are those of a mesh without the expert axis. A run on node=2,expert=4 must
then equal the same run on node=2 (two devices, every expert on each) when the capacity
drops nothing, step for step, to float32 round-off; workers spanning `expert` and
compression with error feedback (its fused buckets mix each device's own experts with the
replicated leaves, so a top-k selection differs: seen as a 6e-5 loss difference) are
refused in one line."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dpjax import step as S
from dpjax.mesh import data_axes
from dpjax.models import get_model
from dpjax.plan import UsageError, resolve
from dpjax.settings import Settings

SEQ, B, STEPS = 8, 8, 3
# 8 experts, top 2: a capacity factor of E/k = 4 drops no token, and without the balance loss (a product of
# each routing group's means: one device's rows, 1 on node=2,expert=4 and 4 on node=2) a token's loss does not
# depend on its group (the z loss is a mean over tokens)
MODEL = get_model("gpt", seq_len=SEQ, d_model=16, n_layers=1, n_heads=2, d_ff=16, experts=8, top_k=2,
                  capacity_factor=4.0, router_aux_weight=0.0)


def run(mesh_of, put, mesh, count, update, compression):
    """(plan, losses, final per-worker parameters) of STEPS SGD steps of MODEL on `mesh`, workers over node."""
    s = Settings(mesh=mesh, data="synthetic", batch_size=B, seq_len=SEQ, update=update, compression=compression,
                 workers="node")
    plan = resolve(s, mesh=mesh_of(mesh, count), model=MODEL, optimizer=optax.sgd(0.5))
    step = S.for_plan(plan, donate=False)
    params, state = step.init(S.init_params(MODEL, plan.layout, jax.random.key(0)))
    rng, losses = np.random.default_rng(1), []
    for _ in range(STEPS):
        tokens = rng.integers(0, 256, (1, B, SEQ + 1)).astype(np.int32)
        params, state, loss = step.train(params, state, put(plan.mesh, tokens, P(None, data_axes(plan.mesh))))[:3]
        losses.append(float(loss))  # (a fourth output: the router's figures)
    return plan, losses, jax.device_get(params)


@pytest.mark.parametrize("update,compression", [
    ("sparse:2", "none"),  # local SGD: the two workers diverge, then average every 2nd step
    pytest.param("delayed:1", "none", marks=pytest.mark.slow),
    pytest.param("async:1", "none", marks=pytest.mark.slow),
])
def test_experts_beside_a_diverging_rule_equal_every_expert_on_each_device(mesh_of, put, update, compression):
    """The rule's parameters (each worker's) and losses on node=2,expert=4 equal those on
    node=2: an average over `expert` of the expert leaves (treating each device's experts
    as replicas) or a missing 1/n on their gradient would move them far more than
    round-off."""
    plan, losses, params = run(mesh_of, put, "node=2,expert=4", 8, update, compression)
    assert plan.layout.workers == ("node",) and plan.layout.expert_split
    _, want_losses, want = run(mesh_of, put, "node=2", 2, update, compression)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-6)
    assert len(set(losses)) == STEPS  # the parameters moved
    experts = jax.tree.leaves(plan.layout.expert_leaves())
    assert any(experts)
    for got, w, is_expert in zip(jax.tree.leaves(params), jax.tree.leaves(want), experts):
        assert got.shape == w.shape, (got.shape, w.shape, is_expert)
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flags,says", [
    (dict(update="sparse:2"), "with --update sparse:2: its workers are every data axis"),
    (dict(compression="topk:0.25", workers="node"), "with --compression topk:0.25: error feedback selects and scales"),
    (dict(compression="bf16", compress_axes="node"), "the per-shard exchange splits a worker's gradient"),
])
def test_workers_over_the_expert_axis_are_refused_in_one_line(flags, says):
    s = Settings(mesh="node=2,expert=4", data="synthetic", model_options={"experts": 8}, **flags)
    with pytest.raises(UsageError) as e:
        resolve(s)
    assert says in str(e.value) and "\n" not in str(e.value)
