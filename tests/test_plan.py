"""dpjax.plan: settings are checked once, where the plan is made; a plan can be made
again for another device count; and a gradient-scale bug cannot hide (the step's SGD
update against the unsharded model's gradient, computed in plain JAX)."""


import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dpjax.plan import memory
from dpjax import step as S
from dpjax.mesh import data_axes
from dpjax.models import get_model
from dpjax.plan import UsageError, resolve
from dpjax.settings import Settings
from dpjax.train import main


@pytest.mark.parametrize("flags,says", [
    (["--timeline", "/no/such/dir/t.json"], "--timeline /no/such/dir/t.json: the folder /no/such/dir does not exist"),
    (["--metrics", "/no/such/dir/m.jsonl"], "--metrics /no/such/dir/m.jsonl: the folder /no/such/dir does not exist"),
    (["--lr", "-1"], "--lr cannot be negative"),
    (["--seq-len", "100000", "--data", "synthetic"], "this run needs about"),
    (["--update", "nosuchrule:3"], "bad --update 'nosuchrule:3'"),
    (["--mesh", "2x4", "--microbatches", "2"], "--microbatches needs a stage axis"),
])
def test_bad_settings_are_one_line_before_any_step(monkeypatch, capsys, tmp_path, flags, says):
    """Each is refused by the plan in one line with exit 2, and nothing is built or run:
    no step is ever made (a step would fail this test with a traceback)."""
    def no_step(*a, **k):
        raise AssertionError("a step was built for settings the plan should have refused")

    monkeypatch.setattr(S, "for_plan", no_step)
    monkeypatch.chdir(tmp_path)
    assert main([*flags, "--steps", "2", "--progress", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_memory_refusal_says_what_it_needs_and_has():
    s = Settings(mesh="8x1", data="synthetic", seq_len=100_000)
    with pytest.raises(UsageError, match=r"needs about [\d,.]+ GiB per device .* a device has [\d,.]+ GiB"):
        resolve(s)


def test_the_default_run_fits():
    plan = resolve(Settings())  # the main job on this machine's 8 devices: not refused
    need = memory.estimate(plan.model, plan.layout, plan.global_batch)
    assert 0 < need["total"] < memory.device_memory(plan.mesh)


def test_a_plan_is_made_again_for_fewer_devices():
    """An elastic restart's plan: the same settings on the devices that are left. The
    global batch, the rule and the workers' axes stay; the mesh and the ranks change."""
    s = Settings(data="synthetic", update="sparse:4", batch_size=16, fsdp=True)
    eight = resolve(s, jax.devices())
    four = eight.for_devices(jax.devices()[:4])
    assert dict(eight.mesh.shape) == {"data": 8, "model": 1} and dict(four.mesh.shape) == {"data": 4, "model": 1}
    assert four.global_batch == eight.global_batch == 16
    assert (four.layout.num_workers, eight.layout.num_workers) == (4, 8)
    assert str(four.update) == str(eight.update) == "sparse:4"
    assert four.settings is eight.settings
    with pytest.raises(UsageError, match="--batch-size 16 is not divisible by the 3 data-parallel ranks"):
        eight.for_devices(jax.devices()[:3])


def test_the_plan_describes_itself_in_plain_values():
    import json

    plan = resolve(Settings(mesh="stage=2,data=2,model=2", data="synthetic", update="sparse:4", workers="data",
                            link=["data=5ms,1gbit"], backward_passes=2))
    d = json.loads(json.dumps(plan.describe()))
    assert d["mesh"] == {"stage": 2, "data": 2, "model": 2} and d["workers"] == ["data"] and d["num_workers"] == 2
    assert d["update"] == "sparse:4" and d["passes"] == 2 and d["global_batch"] == 32
    assert d["links"] == ["data=5ms,1000mbit"] and d["pipeline"]["schedule"] == "1f1b"
    assert d["pipeline"]["microbatches"] == 2 and d["exchange"]["algorithm"] == "ring"


def test_with_exchange_changes_only_the_exchange():
    plan = resolve(Settings(mesh="2x2x2", data="synthetic", fsdp=True, allreduce="auto"))
    assert plan.autotune == ("allreduce",) and plan.exchange.algorithm == "ring"
    other = plan.with_exchange("butterfly", 0.5)
    assert (other.exchange.algorithm, other.exchange.fusion_mb) == ("butterfly", 0.5)
    assert other.layout.fsdp_algorithm == "butterfly" and other.layout.specs == plan.layout.specs
    assert other.mesh is plan.mesh and other.global_batch == plan.global_batch


# ---------------------------------------------------------------------------------------
# A golden test that sees the gradient's scale: SGD with lr 1 and no clipping moves the
# parameters by exactly minus the gradient of the mean loss over the global batch.


# 8x1 is slow: 2x4 with 2 micro-batches keeps the property fast (a sum for a mean over its
# data ranks, its model shards or its micro-batches is off by a factor; its pinned norm
# moves with the loss's scale)
@pytest.mark.parametrize("mesh,passes", [("2x4", 2), pytest.param("8x1", 1, marks=pytest.mark.slow)])
def test_one_sgd_step_moves_by_the_unsharded_gradient(mesh_of, put, mesh, passes):
    """Tensor parallelism over model, data parallelism over data, micro-batches: the
    update equals -grad of the plain single-device model's loss on the whole batch (a
    sum instead of a mean over ranks or micro-batches, or a gradient missing its model
    shard, is off by a factor). The norm is pinned too: a change of the model's loss
    scale (say a sum over tokens) moves it."""
    B, T = 8, 16
    model = get_model("gpt", seq_len=T, d_model=32, n_heads=4, d_ff=64)
    s = Settings(mesh=mesh, data="synthetic", batch_size=B, seq_len=T, backward_passes=passes)
    plan = resolve(s, mesh=mesh_of(mesh, 8), model=model, optimizer=optax.sgd(1.0))
    step = S.for_plan(plan, donate=False)
    p0 = S.init_params(model, plan.layout, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 256, (passes, B, T + 1)).astype(np.int32)
    params, state = step.init(p0)
    p1, _, _ = step.train(params, state, put(plan.mesh, tokens, P(None, data_axes(plan.mesh))))

    whole = jax.tree.map(np.asarray, model.init(jax.random.key(0)))
    grads = [jax.jit(jax.grad(model.loss))(whole, tokens[k]) for k in range(passes)]  # plain JAX, one device
    want = jax.tree.map(lambda *g: sum(g) / passes, *grads)
    got = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), jax.device_get(p0), jax.device_get(p1))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        # float32 sums in another order (the ring, the model shards, the micro-batches):
        # at most 6e-8 apart on CPU (measured on both meshes), where a wrong factor is 100%
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-7)
    norm = float(np.sqrt(sum(np.sum(np.square(w)) for w in jax.tree.leaves(want))))
    assert norm == pytest.approx(GOLDEN_GRAD_NORM[passes], rel=1e-4)


GOLDEN_GRAD_NORM = {1: 0.8953168, 2: 0.6679512}  # plain JAX on one device, pinned
