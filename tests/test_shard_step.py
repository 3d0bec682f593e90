"""dpjax.shard_step's promises. Loud instead of silent: values declared replicated are
checked (dpjax.wrap.replicas), by shard_step on its first calls and on every call under
DPJAX_CHECK=1, and by `python -m dpjax.train` under DPJAX_CHECK=1.

The check is first given arrays whose per-device buffers are built by hand (what a
shard_map with check_vma=False returns when devices disagree), so the expected verdict
and distance are known independently; then the mistakes of the issue: a forgotten
gradient average, BatchNorm without axis_name, a loss of one shard, and the same
mistake planted in dpjax.train's own step. Last, a Linen TrainState with
DistributedOptimizer as its tx against the plain optimizer on one device.
"""

import numpy as np
import optax
import pytest
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax.wrap.replicas import ReplicaCheck, ReplicationError

HOST, DEVICE = 1 << 30, 0  # ReplicaCheck(host_bytes): compare on the host, or hash on the devices


def per_device(mesh, spec, values):
    """A global array declared `spec` whose device at mesh position i holds its block of values[i]."""
    sharding = NamedSharding(mesh, spec)
    order = {d: i for i, d in enumerate(mesh.devices.flat)}
    shape = values[0].shape
    blocks = [jax.device_put(values[order[d]][index], d) for d, index in sharding.devices_indices_map(shape).items()]
    return jax.make_array_from_single_device_arrays(shape, sharding, blocks)


@pytest.mark.parametrize("where", [HOST, DEVICE])
def test_check_names_the_leaf_and_the_distance(mesh_of, where):
    mesh = mesh_of("2x4", 8)
    w = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    bad = [w.copy() for _ in range(8)]
    bad[6][0, 5] += 0.25  # data rank 1, model rank 2: the copy of model block 2 differs (columns 4..5)
    tree = {"ok": per_device(mesh, P(), [w] * 8), "w_model": per_device(mesh, P(None, "model"), bad),
            "key": per_device(mesh, P(), [np.asarray(jax.random.key_data(jax.random.key(1)))] * 8)}
    with pytest.raises(ReplicationError) as e:
        ReplicaCheck(where)(tree, where="step: ")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("step: w_model (4, 8) is declared replicated over data")
    assert "1 of 2 devices" in msg and "max |difference| 0.25" in msg and "more" not in msg


@pytest.mark.parametrize("where", [HOST, DEVICE])
def test_check_passes_replicas_and_sees_one_bit(mesh_of, where):
    mesh = mesh_of("2x4", 8)
    rng = np.random.default_rng(1)
    leaves = {"f32": rng.standard_normal((3, 8)).astype(np.float32),
              "bf16": rng.standard_normal(8).astype(jnp.bfloat16),
              "i32": rng.integers(-5, 5, (2, 4)).astype(np.int32), "bool": rng.random(8) > 0.5}
    same = {k: per_device(mesh, P(None, "model") if v.ndim == 2 else P(), [v] * 8) for k, v in leaves.items()}
    same["key"] = jax.device_put(jax.random.key(0), NamedSharding(mesh, P()))
    ReplicaCheck(where)(same)  # no false alarm
    flipped = leaves["bf16"].copy()
    flipped[3] = np.frombuffer((flipped[3:4].view(np.uint16) ^ 1).tobytes(), jnp.bfloat16)[0]  # last mantissa bit
    with pytest.raises(ReplicationError, match="bf16 .8,. is declared replicated over data, model"):
        ReplicaCheck(where)({**same, "bf16": per_device(mesh, P(), [leaves["bf16"]] * 7 + [flipped])})
    reversed_ = leaves["bf16"][::-1].copy()  # the same numbers in another order: equal sums, other values
    with pytest.raises(ReplicationError, match="bf16 .8,. is declared replicated over data, model"):
        ReplicaCheck(where)({**same, "bf16": per_device(mesh, P(), [leaves["bf16"]] * 7 + [reversed_])})


class Net(nnx.Module):
    def __init__(self, rngs, axis_name=None):
        self.l1 = nnx.Linear(6, 16, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(16, axis_name=axis_name, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x))))


def train_step(model, optimizer, batch):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return jax.lax.pmean(loss, "data")


def batch(rows=32, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((rows, 6)).astype(np.float32), "y": rng.integers(0, 3, rows)}


def run(tx, axis_name="data", calls=1, fn=train_step):
    model = Net(nnx.Rngs(0), axis_name)
    step = dpjax.shard_step(fn, batch_argnums=2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    return [float(step(model, optimizer, batch(seed=i))) for i in range(calls)], step


def test_forgotten_gradient_average_is_one_line_naming_the_leaf():
    with pytest.raises(ReplicationError) as e:
        run(optax.sgd(0.1))  # the mistake: the optimizer is not wrapped
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("train_step: model/")
    assert "differ" in msg and "dpjax.DistributedOptimizer" in msg


def test_correct_loop_passes_every_call_under_dpjax_check(monkeypatch):
    monkeypatch.setenv("DPJAX_CHECK", "1")
    losses, step = run(dpjax.DistributedOptimizer(optax.sgd(0.1)), calls=4)  # past replicas.FIRST_CALLS
    assert step.calls == 4 and losses[-1] < losses[0]


def test_batchnorm_without_axis_name_is_named():
    with pytest.raises(ReplicationError, match=r"model/bn/mean .* axis_name='data'.*dpjax\.nn\.nnx\.sync_batchnorm"):
        run(dpjax.DistributedOptimizer(optax.sgd(0.1)), axis_name=None)


def test_loss_of_one_shard_is_named():
    def local_loss(model, optimizer, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    with pytest.raises(ReplicationError, match=r"^local_loss: output \(\) is declared replicated .*lax\.pmean.*"
                                               r"out_specs=\"mean\"\), sum it if it is a sum over this device's "
                                               r"rows \(dpjax\.global_sum\(x\).*, or, for one value per batch row, .*"
                                               r"out_specs=\"rows\"$"):
        run(dpjax.DistributedOptimizer(optax.sgd(0.1)), fn=local_loss)


def test_bad_batch_is_one_line():
    def forward(model, batch):
        return model(batch["x"]).sum()

    with pytest.raises(dpjax.UserError, match=r"^forward: batch/x \(12, 6\) is split over 'data', but its rows do "
                                              r"not divide into 8 parts; use a multiple of 8$"):
        dpjax.shard_step(forward, batch_argnums=1)(Net(nnx.Rngs(0), "data"), batch(rows=12))


def test_dpjax_train_checks_its_step_under_dpjax_check(monkeypatch):
    """dpjax.train's Trainer with DPJAX_CHECK=1: silent on a correct step; with the gradient
    average taken out of dpjax's step builder, an AssertionError (our bug: a traceback)
    naming a parameter."""
    from dpjax.compression import Exchange
    from dpjax.train import Settings, Trainer

    monkeypatch.setenv("DPJAX_CHECK", "1")
    cfg = Settings(model="mlp", mesh="2x2", data="synthetic", steps=1, batch_size=8, seq_len=8,
                      progress="none", model_options={"d_hidden": 16, "d_embed": 8})

    def one_step():
        t = Trainer(cfg)
        return t.step.train(t.params, t.opt_state, t.batch())

    one_step()
    monkeypatch.setattr(Exchange, "allreduce", lambda self, grads, axis, **kw: grads)
    with pytest.raises(AssertionError, match=r"^dpjax.train step: params/\w+ .* differ"):
        one_step()


def test_train_state_with_distributed_optimizer_equals_one_device(mesh_of):
    """A Linen TrainState whose tx is DistributedOptimizer, in one shard_step (decorator
    form, an explicit mesh), steps like the plain optimizer on one device."""
    from flax import linen as nn
    from flax.training.train_state import TrainState

    model = nn.Dense(3)
    data = batch()
    params = jax.jit(model.init)(jax.random.key(0), data["x"][:1])

    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn(params, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

    dist = dpjax.shard_step(mesh_of("8x1", 8), batch_argnums=1)(train_step)
    plain = jax.jit(train_step)
    a = TrainState.create(apply_fn=model.apply, params=params, tx=dpjax.DistributedOptimizer(optax.adam(0.1)))
    b = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(0.1))
    for _ in range(3):
        a, b = dist(a, data), plain(b, data)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)


def test_logical_names_need_rules_around_the_call():
    """An NNX parameter annotated with logical names is one error line naming it, and runs
    once flax's logical_axis_rules map the names to mesh axes (here: replicated)."""
    with nnx.use_eager_sharding(False):
        model = nnx.Linear(6, 4, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")),
                           rngs=nnx.Rngs(0))

    def forward(model, batch):
        return jax.lax.psum(model(batch["x"]).sum(), "data")

    step = dpjax.shard_step(forward, batch_argnums=1)
    with pytest.raises(dpjax.UserError, match=r"^forward: model/kernel is annotated with sharding \('embed', 'mlp'\), "
                                              r"naming 'embed', 'mlp', not an axis of the mesh"):
        step(model, batch())
    with nnx.logical_axis_rules([("embed", None), ("mlp", None)]):
        got = step(model, batch())
    np.testing.assert_allclose(got, model(batch()["x"]).sum(), rtol=1e-5)
