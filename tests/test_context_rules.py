"""The context axis beside the update rules and compression (issue #40): a context axis only
splits each sequence's tokens, and the mean over it (`dpjax.step.gradient.inner_mean`) is exact, so
the workers a rule sees (over `data`) and the error-feedback exchange between them are the
same as on a mesh without it. A run on data=2,context=4 must then equal the same run on
data=2 (two devices, whole sequences) step for step, to float32 round-off."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dpjax import step as S
from dpjax.mesh import data_axes
from dpjax.models import get_model
from dpjax.plan import resolve
from dpjax.settings import Settings

SEQ, STEPS = 16, 3
MODEL = get_model("gpt", seq_len=SEQ, d_model=16, n_layers=1, n_heads=4, d_ff=32)


def run(mesh_of, put, mesh, count, update, compression):
    """(losses, final per-worker parameters) of STEPS SGD steps of MODEL on `mesh`."""
    s = Settings(mesh=mesh, data="synthetic", batch_size=4, seq_len=SEQ, update=update, compression=compression)
    plan = resolve(s, mesh=mesh_of(mesh, count), model=MODEL, optimizer=optax.sgd(0.5))
    step = S.for_plan(plan, donate=False)
    params, state = step.init(S.init_params(MODEL, plan.layout, jax.random.key(0)))
    rng, losses = np.random.default_rng(1), []
    for _ in range(STEPS):
        tokens = rng.integers(0, 256, (1, 4, SEQ + 1)).astype(np.int32)
        params, state, loss = step.train(params, state, put(plan.mesh, tokens, P(None, data_axes(plan.mesh))))
        losses.append(float(loss))
    return plan, losses, jax.device_get(params)


@pytest.mark.parametrize("update,compression", [
    ("sparse:2", "none"),  # local SGD: the two workers diverge, then average every 2nd step
    pytest.param("sync", "topk:0.25", marks=pytest.mark.slow),  # top-k with error feedback between the data ranks
    pytest.param("delayed:1", "none", marks=pytest.mark.slow),
    pytest.param("async:1", "none", marks=pytest.mark.slow),
])
def test_a_context_axis_leaves_the_rule_and_the_compressed_exchange_as_without_it(mesh_of, put, update, compression):
    """A rule whose workers diverge, or top-k's exchange with its error-feedback state, run
    with each sequence split over a context axis of 4: its losses and parameters (each
    worker's, for a rule that keeps them apart) equal the run without the context axis.
    A mean over `context` missing or taken twice, a compression applied inside the worker
    (to each device's share of the gradient) or workers spanning `context` move them far
    more than round-off."""
    plan, losses, params = run(mesh_of, put, "data=2,context=4", 8, update, compression)
    assert plan.layout.context_axes == ("context",) and plan.layout.workers == ("data",)
    _, want_losses, want = run(mesh_of, put, "data=2", 2, update, compression)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-6)
    assert len(set(losses)) == STEPS  # the parameters moved
    for got, w in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        assert got.shape == w.shape
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
