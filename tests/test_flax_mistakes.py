"""Issue #30's ways a flax user got hurt, each now caught, said, or made unnecessary:

- flax's own nnx.Linear split by rows over `model` with its bias: the bias was added once
  per model rank and the run trained a little wrong, silently (the copies agree, so the
  replica check cannot see it); split by columns with a whole bias: JAX's broadcast
  error without the reason. shard_step refuses both before anything runs, naming the fix.
- per-row outputs (a prediction) and a loss of this device's rows: `out_specs="rows"` and
  `out_specs="mean"`, no PartitionSpec to look up; a mesh given by its spec ("4x2").
- a model with dpjax's model-axis markers (copy_to_model, reduce_from_model, dpjax.nn's
  layers) evaluates under a plain `nnx.jit`, on one device or on the trained sharded
  parameters, with the dense model's outputs.
- `dpjax.nn.nnx.sync_batchnorm`: every BatchNorm of a model synchronised in one line.
- a step that splits nothing over the data axes, and a CPU run with one device: one
  warning line each, once.
"""

import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax.compute.tensor_parallel import copy_to_model, reduce_from_model
from dpjax.wrap.checks import SingleDeviceWarning

TOL = dict(rtol=2e-5, atol=2e-6)  # float32: the sharded sums add partial products in another order
init = nnx.initializers.lecun_normal()


class Megatron(nnx.Module):
    """flax's layers with Megatron's annotations: `up` split by columns, `down` by rows;
    `down_bias` and `up_bias` choose how their biases are made (what users tried)."""

    def __init__(self, rngs, down_bias=False, up_bias="split"):
        up_bias_init = nnx.initializers.zeros_init()
        if up_bias == "split":
            up_bias_init = nnx.with_partitioning(up_bias_init, ("model",))
        self.up = nnx.Linear(6, 16, kernel_init=nnx.with_partitioning(init, (None, "model")),
                             bias_init=up_bias_init, rngs=rngs)
        self.down = nnx.Linear(16, 3, use_bias=down_bias, kernel_init=nnx.with_partitioning(init, ("model", None)),
                               rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((3,)))

    def __call__(self, x):
        y = reduce_from_model(self.down(nnx.relu(self.up(copy_to_model(x)))))
        return y + self.bias  # the row-parallel layer's bias, once, after the sum


def batch(rows=16, seed=0):
    x = np.random.default_rng(seed).standard_normal((rows, 6)).astype(np.float32)
    return x, (x[:, :3] * 2 - x[:, 3:]).astype(np.float32)


def mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("down_bias, up_bias, want", [
    (True, "split", r"^step: model/down is an nnx\.Linear whose kernel is split by rows over 'model' \(row-parallel\)"
                    r": each 'model' rank's output is a partial sum, and adding its bias there counts the bias once "
                    r"per rank; use dpjax\.nn\.nnx\.RowParallelLinear\(16, 3, rngs=rngs\)"),
    (False, "whole", r"^step: model/up is an nnx\.Linear whose kernel is split by columns over 'model' but whose "
                     r"bias is whole, so it cannot be added to the split output; create it with bias_init=nnx\."
                     r"with_partitioning\(nnx\.initializers\.zeros_init\(\), \('model',\)\)"),
])
def test_flax_linear_biases_that_cannot_be_right_are_refused(down_bias, up_bias, want):
    """Laid out explicitly (each device its block), the row-parallel nnx.Linear with its own
    bias trains (the copies agree) but adds the bias twice on 4x2; shard_step refuses it
    before the first step, one line."""
    with jax.set_mesh(dpjax.make_mesh("4x2")):
        model = Megatron(nnx.Rngs(0), down_bias=down_bias, up_bias=up_bias)
    step = dpjax.shard_step(lambda model, x, y: mse(model, x, y), "4x2", batch_argnums=(1, 2), out_specs="mean",
                            model_axes="explicit")
    step.__name__ = "step"
    with pytest.raises(dpjax.UserError, match=want) as e:
        step(model, *batch())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("down_bias, up_bias", [(True, "split"), (False, "whole")])
def test_the_same_layers_under_automatic_model_axes_are_the_dense_model(down_bias, up_bias):
    """Left to shard_step (no dpjax.nn layer: the model axes automatic), the layers the
    explicit layout refuses compute what they compute on one device: GSPMD adds the
    row-split layer's bias once and splits the whole one as it needs."""
    with jax.set_mesh(dpjax.make_mesh("4x2")):
        model = Megatron(nnx.Rngs(0), down_bias=down_bias, up_bias=up_bias)
    with jax.set_mesh(dpjax.make_mesh("1x1", jax.devices()[:1])):
        dense = Megatron(nnx.Rngs(0), down_bias=down_bias, up_bias=up_bias)
    dense.down.bias = None if dense.down.bias is None else nnx.Param(dense.down.bias[...] + 0.5)
    model.down.bias = None if model.down.bias is None else nnx.Param(model.down.bias[...] + 0.5)  # seen if twice
    step = dpjax.shard_step(lambda model, x, y: (mse(model, x, y), model(x)), "4x2", batch_argnums=(1, 2),
                            out_specs=("mean", "rows"))
    loss, rows = step(model, *batch())
    np.testing.assert_allclose(rows, dense(batch()[0]), **TOL)
    np.testing.assert_allclose(loss, mse(dense, *batch()), **TOL)


def test_the_same_layers_split_on_a_model_axis_of_one_are_fine():
    with jax.set_mesh(dpjax.make_mesh("8x1")):
        model = Megatron(nnx.Rngs(0), down_bias=True)
    step = dpjax.shard_step(lambda model, x, y: mse(model, x, y), "8x1", batch_argnums=(1, 2), out_specs="mean")
    assert np.isfinite(step(model, *batch()))


def test_out_specs_words_give_the_dense_models_loss_and_rows():
    """On 4x2: "mean" is the global batch's loss, "rows" every row's output in batch
    order (replicated over `model`, checked), both the one-device model's."""
    with jax.set_mesh(dpjax.make_mesh("4x2")):
        model = Megatron(nnx.Rngs(0))
    with jax.set_mesh(dpjax.make_mesh("1x1", jax.devices()[:1])):
        dense = Megatron(nnx.Rngs(0))
    x, y = batch()
    step = dpjax.shard_step(lambda model, x, y: (mse(model, x, y), model(x)), "4x2", batch_argnums=(1, 2),
                            out_specs=("mean", "rows"))
    loss, rows = step(model, x, y)
    assert step.mesh.shape == {"data": 4, "model": 2}
    assert rows.shape == (16, 3) and rows.sharding.spec == P(("data",))
    np.testing.assert_allclose(loss, mse(dense, x, y), **TOL)
    np.testing.assert_allclose(rows, dense(x), **TOL)


def test_an_unknown_out_specs_word_is_one_line():
    step = dpjax.shard_step(lambda x: x.sum(), batch_argnums=0, out_specs="avg")
    with pytest.raises(dpjax.UserError, match=r"^<lambda>: out_specs 'avg' is not one of 'mean', 'rows' or a "
                                              r"PartitionSpec$"):
        step(np.ones((8, 2), np.float32))


def test_model_markers_evaluate_under_plain_nnx_jit():
    """copy_to_model / reduce_from_model and dpjax.nn's layers are the identity and the dense
    layer where `model` is not bound: a pred_step under nnx.jit gives the dense model's
    outputs, on one device and on parameters trained sharded on 4x2."""

    class Swapped(nnx.Module):
        def __init__(self, rngs):
            self.up = dpjax.nn.nnx.ColumnParallelLinear(6, 16, rngs=rngs)
            self.down = dpjax.nn.nnx.RowParallelLinear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    class Plain(Swapped):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(6, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs)

    pred_step = nnx.jit(lambda model, x: model(x))
    x, y = batch()
    with jax.set_mesh(dpjax.make_mesh("1x1", jax.devices()[:1])):
        m = Megatron(nnx.Rngs(0))
        dense = jax.nn.relu(x @ m.up.kernel[...] + m.up.bias[...]) @ m.down.kernel[...] + m.bias[...]
        np.testing.assert_allclose(pred_step(m, x), dense, **TOL)
    swapped, plain = Swapped(nnx.Rngs(0)), Plain(nnx.Rngs(0))
    np.testing.assert_allclose(pred_step(swapped, x), plain(x), **TOL)

    def update(model, opt, x, y):
        opt.update(model, nnx.grad(mse)(model, x, y))

    train = dpjax.shard_step(update, "4x2", batch_argnums=(2, 3))
    opts = [nnx.Optimizer(m, tx, wrt=nnx.Param) for m, tx in
            ((swapped, dpjax.DistributedOptimizer(optax.sgd(0.1))), (plain, optax.sgd(0.1)))]
    train(swapped, opts[0], x, y)
    nnx.jit(update)(plain, opts[1], x, y)
    assert swapped.up.kernel[...].sharding.spec == P(None, "model")
    np.testing.assert_allclose(pred_step(swapped, x), plain(x), **TOL)


class Norms(nnx.Module):
    def __init__(self, rngs):
        self.inner = nnx.Sequential(nnx.Linear(6, 4, rngs=rngs), nnx.BatchNorm(4, rngs=rngs))
        self.norms = nnx.List([nnx.BatchNorm(4, rngs=rngs) for _ in range(2)])

    def __call__(self, x):
        x = self.inner(x)
        for norm in self.norms:
            x = norm(x)
        return x


def test_sync_batchnorm_converts_every_batchnorm():
    """Three BatchNorms, nested and in a list, in one line; in training mode on 8 devices
    the outputs and the running statistics are the one-device model's."""
    model = dpjax.nn.nnx.sync_batchnorm(Norms(nnx.Rngs(0)))
    norms = [n for _, n in nnx.iter_graph(model) if isinstance(n, nnx.BatchNorm)]
    assert len(norms) == 3 and all(n.axis_name == "data" for n in norms)
    x, _ = batch()
    rows = dpjax.shard_step(lambda model, x: model(x), batch_argnums=1, out_specs="rows")(model, x)
    dense = Norms(nnx.Rngs(0))
    np.testing.assert_allclose(rows, dense(x), **TOL)
    stats = [jax.tree.leaves(nnx.state(m, nnx.BatchStat)) for m in (model, dense)]
    for got, want in zip(*stats):
        np.testing.assert_allclose(got, want, **TOL)


def test_a_step_that_splits_nothing_over_data_warns_once():
    step = dpjax.shard_step(lambda x: x.sum())
    with pytest.warns(SingleDeviceWarning, match=r"^dpjax: <lambda> splits nothing over the data axes \(8 devices\), "
                                                 r"so every device computes the whole batch; pass batch_argnums="):
        step(np.ones((8, 2), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(np.ones((8, 2), np.float32))  # once
        dpjax.shard_step(lambda x: x.sum(), batch_argnums=0, out_specs="mean")(np.ones((8, 2), np.float32))
        dpjax.shard_step(lambda x: x.sum(), "1x8")(np.ones((8, 2), np.float32))  # a data axis of 1: nothing to split
        dpjax.shard_step(lambda w: w * 2, batch_argnums=())(np.ones(3))  # (): nothing, on purpose
        dpjax.shard_step(dpjax.broadcast_params)({"w": np.ones(3)})  # dpjax's broadcasts say it themselves
        dpjax.shard_step(dpjax.horovod.broadcast_parameters)({"w": np.ones(3)})


def test_a_cpu_run_with_one_device_says_so_once():
    """Without simulate_cpu_devices a CPU run has one device: two steps, one warning line."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    code = ("import numpy as np, dpjax\n"
            "x = np.ones((4, 2), np.float32)\n"
            "for _ in range(2):\n"
            "    dpjax.shard_step(lambda x: x.sum(), batch_argnums=0)(x)\n"
            "    dpjax.shard_step(lambda x: x.mean(), batch_argnums=0)(x)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if "one CPU device" in line]
    assert len(lines) == 1, r.stderr
    assert lines[0].endswith("SingleDeviceWarning: dpjax: one CPU device, so shard_step runs unsplit; call "
                             "dpjax.simulate_cpu_devices(8) before JAX starts (or set XLA_FLAGS=--xla_force_host_"
                             "platform_device_count=8) to simulate 8 devices")


def test_a_row_parallel_layer_fed_a_whole_input_is_one_line():
    class Unpaired(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(6, 16, rngs=rngs)  # whole, where a ColumnParallelLinear belongs
            self.down = dpjax.nn.nnx.RowParallelLinear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.down(self.up(x))

    step = dpjax.shard_step(lambda model, x: model(x), "4x2", batch_argnums=1, out_specs="rows")
    with pytest.raises(dpjax.UserError, match=r"^RowParallelLinear\(16, 3\): its input's last dimension is 16, not "
                                              r"this device's 8 rows: feed it a ColumnParallelLinear's output"):
        step(Unpaired(nnx.Rngs(0)), batch()[0])
