"""LoRA over a stage axis (dpjax.pipeline.staged with the model's Split): the adapters live
with their stage's layers and are the only thing the schedule differentiates; the base is
not touched. Against the same LoRA run without a pipeline (8 data ranks), step for step."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dpjax import step as S
from dpjax.models import get_model
from dpjax.models.lora import Lora, LoraConfig, Split
from dpjax.optim import OptimizerConfig
from dpjax.pipeline import Pipeline
from dpjax.sharding import make_layout

from test_lora_step import start  # fresh parameters with B not zero

MOMENTUM = OptimizerConfig(name="momentum", lr=0.5, clip_norm=0.0)
SPLIT = Split("blocks")
STEPS = 3


def lora_llama():
    base = get_model("llama", seq_len=8, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=48, vocab_size=64)
    return Lora(base, LoraConfig(r=4, alpha=8.0))


def batches():
    """One batch, STEPS times: its loss must fall."""
    return np.repeat(np.random.default_rng(0).integers(0, 64, (1, 8, 9)).astype(np.int32), STEPS, axis=0)


def run(mesh, put, model, layout):
    """(losses of STEPS steps, the parameters after them as the model's own tree, numpy)."""
    step = S.for_model(model, layout, global_batch=8, opt=MOMENTUM, donate=False)
    params, state = step.init(jax.device_put(layout.store(start(model)), layout.shardings()))
    state_leaves = sorted(x.shape for x in jax.tree.leaves(state) if x.ndim)
    assert state_leaves == sorted(x.shape for x in jax.tree.leaves(SPLIT.trained(layout.store(start(model)))))
    losses = []
    for b in batches():
        params, state, loss = step.train(params, state, put(mesh, b[None], P(None, "data")))
        losses.append(float(loss))
    return losses, jax.tree.map(np.asarray, layout.unstore(step.consensus(params)))


@pytest.fixture(scope="module")
def unpipelined(mesh_of, put):
    model = lora_llama()
    mesh = mesh_of("8x1", 8)
    return run(mesh, put, model, make_layout(model, mesh))


CASES = [pytest.param("stage=2,data=4", "1f1b", False, marks=pytest.mark.slow),
         pytest.param("stage=2,data=2,model=2", "interleaved", True, marks=pytest.mark.slow),
         pytest.param("stage=4,data=2", "gpipe", True, marks=pytest.mark.slow)]


@pytest.mark.parametrize("spec,schedule,fsdp", CASES)
def test_lora_on_a_stage_axis_equals_it_without(mesh_of, put, unpipelined, spec, schedule, fsdp):
    """The same losses within 1e-5 over the steps, the adapters trained alike, and the
    frozen base bit-identical to where it started (FSDP inside the stages too)."""
    model = lora_llama()
    mesh = mesh_of(spec, 8)
    pipe = Pipeline(schedule, 2 * mesh.shape["stage"] if schedule == "interleaved" else None,
                    2 if schedule == "interleaved" else 1)
    layout = make_layout(model, mesh, fsdp=fsdp, pipeline=pipe)
    losses, after = run(mesh, put, model, layout)
    want_losses, want = unpipelined
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    assert losses[-1] < losses[0]  # the adapters learn
    before = jax.tree.map(np.asarray, start(model))
    same = jax.tree.map(np.array_equal, SPLIT.frozen(after), SPLIT.frozen(before))
    assert all(jax.tree.leaves(same))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), SPLIT.trained(after),
                 SPLIT.trained(want))
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), SPLIT.trained(after), SPLIT.trained(before))
    assert min(jax.tree.leaves(moved)) > 0  # every adapter leaf trained, on every stage
