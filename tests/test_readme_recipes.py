"""The README's recipes for your own flax code, as a reader tries them: `dpjax.nn` after
a plain `import dpjax`, the decorator with an explicit mesh, flax's own layers with
their sharding annotations plus one psum over `model` (against the dense model on one
device), what a `with_sharding_constraint` inside `shard_step` does, and the replica
check naming the axis the copies differ along."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.lax import with_sharding_constraint as early
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax.wrap.replicas import ReplicationError


def test_dpjax_nn_after_import_dpjax_without_flax():
    code = ("import sys, dpjax; assert 'flax' not in sys.modules; "
            "print(dpjax.nn.nnx.ColumnParallelLinear.__name__, dpjax.nn.linen.__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["ColumnParallelLinear", "dpjax.nn.linen"]


class MLP(nnx.Module):
    """flax's own layers with Megatron's sharding annotations (the GSPMD guide's way):
    w1 split by columns over `model`, w2 by rows; the one line dpjax needs is the sum of
    w2's partial products over `model` (its bias added after it, once). `psum`: how that
    sum is written; None leaves it out."""

    def __init__(self, rngs, psum=dpjax.compute.tensor_parallel.reduce_from_model):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Linear(6, 16, kernel_init=nnx.with_partitioning(init, (None, "model")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)), rngs=rngs)
        self.w2 = nnx.Linear(16, 3, use_bias=False, kernel_init=nnx.with_partitioning(init, ("model", None)),
                             rngs=rngs)
        self.b2 = nnx.Param(nnx.initializers.zeros_init()(rngs.params(), (3,)))  # the key nnx.Linear's bias draws
        self.psum = psum

    def __call__(self, x):
        y = self.w2(nnx.relu(self.w1(dpjax.compute.tensor_parallel.copy_to_model(x))))
        if self.psum is not None:
            y = self.psum(y, "model")  # dpjax: the row-parallel sum
        return y + self.b2


def data(steps=4, batch=16):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps, batch, 6)).astype(np.float32)
    return x, (x[..., :3] * 2 - x[..., 3:]).astype(np.float32)


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("psum", ["reduce_from_model", "lax.psum"])
def test_flax_layers_with_annotations_and_one_sum_equal_one_device(psum):
    """dpjax.compute.tensor_parallel.reduce_from_model (Megatron's g: a sum forward, the identity
    backward) trains exactly like the dense model with SGD; a bare jax.lax.psum does not:
    under shard_step (an unchecked shard_map) its backward sums the gradient over
    `model` too, so every gradient before it is n times too large."""
    mesh = dpjax.make_mesh("4x2")
    reduce = dpjax.compute.tensor_parallel.reduce_from_model if psum == "reduce_from_model" else jax.lax.psum

    @dpjax.shard_step(mesh, batch_argnums=(2, 3), model_axes="explicit")  # the decorator form, with a mesh
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return jax.lax.pmean(loss, "data")

    @nnx.jit
    def plain_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    xs, ys = data()
    with jax.set_mesh(mesh):  # flax places annotated parameters (and the optimizer's state) on the mesh in context
        model = MLP(nnx.Rngs(0), reduce)
        opt = nnx.Optimizer(model, dpjax.DistributedOptimizer(optax.sgd(0.1, momentum=0.9)), wrt=nnx.Param)
    with jax.set_mesh(dpjax.make_mesh("1x1", jax.devices()[:1])):  # the reference: the same values, one device
        ref = MLP(nnx.Rngs(0), psum=None)
        ref_opt = nnx.Optimizer(ref, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    got = [float(step(model, opt, x, y)) for x, y in zip(xs, ys)]
    want = [float(plain_step(ref, ref_opt, x, y)) for x, y in zip(xs, ys)]
    assert want[-1] < want[0]
    if psum == "lax.psum":
        assert got[0] == pytest.approx(want[0], rel=2e-5) and got[1] != pytest.approx(want[1], rel=1e-2)
        return
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=0)
    assert model.w1.kernel[...].sharding.spec == P(None, "model")  # it stayed split
    np.testing.assert_allclose(np.asarray(model.w2.kernel[...]), np.asarray(ref.w2.kernel[...]), rtol=2e-5, atol=1e-6)


class FlaxMLP(nnx.Module):
    """The same layers as flax writes them for jax.jit: annotations only, w2 with its own bias."""

    def __init__(self, rngs, annotate=True):
        init = nnx.initializers.lecun_normal()
        ann = (lambda f, names: nnx.with_partitioning(f, names)) if annotate else (lambda f, names: f)
        self.w1 = nnx.Linear(6, 16, kernel_init=ann(init, (None, "model")),
                             bias_init=ann(nnx.initializers.zeros_init(), ("model",)), rngs=rngs)
        self.w2 = nnx.Linear(16, 3, kernel_init=ann(init, ("model", None)), rngs=rngs)
        self.after = nnx.Linear(3, 3, rngs=rngs)  # a layer made after: its keys show any shift in the draws

    def __call__(self, x):
        return self.after(self.w2(nnx.relu(self.w1(x))))


def test_flax_layers_as_written_for_jit_train_as_one_device_and_keep_the_initialisation():
    """The README's first recipe: no sum to write (the model axes automatic), and the
    initialisation is the unannotated model's, the layer made after them included; the
    explicit recipe's MLP (use_bias=False, its b2 drawn from the same key) keeps it too."""
    mesh = dpjax.make_mesh("4x2")
    with jax.set_mesh(mesh):
        model = FlaxMLP(nnx.Rngs(0))
        opt = nnx.Optimizer(model, dpjax.DistributedOptimizer(optax.sgd(0.1, momentum=0.9)), wrt=nnx.Param)
    ref = FlaxMLP(nnx.Rngs(0), annotate=False)
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    rngs = nnx.Rngs(0)
    with jax.set_mesh(mesh):
        MLP(rngs)
    after = nnx.Linear(3, 3, rngs=rngs)  # drawn after the explicit recipe's layers
    np.testing.assert_array_equal(np.asarray(after.kernel[...]), np.asarray(ref.after.kernel[...]))
    np.testing.assert_array_equal(np.asarray(model.after.kernel[...]), np.asarray(ref.after.kernel[...]))

    @dpjax.shard_step(mesh, batch_argnums=(2, 3), out_specs="mean")
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def plain_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    xs, ys = data()
    got = [float(step(model, opt, x, y)) for x, y in zip(xs, ys)]
    want = [float(plain_step(ref, ref_opt, x, y)) for x, y in zip(xs, ys)]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=0)
    assert model.w1.kernel[...].sharding.spec == P(None, "model")  # it trained split
    np.testing.assert_allclose(np.asarray(model.w2.bias[...]), np.asarray(ref.w2.bias[...]), rtol=2e-5, atol=1e-6)


def test_without_the_psum_the_check_names_model_and_the_cause():
    mesh = dpjax.make_mesh("4x2")
    step = dpjax.shard_step(lambda model, x, y: jax.lax.pmean(loss_fn(model, x, y), "data"), mesh,
                            batch_argnums=(1, 2), model_axes="explicit")
    xs, ys = data()
    with jax.set_mesh(mesh):
        model = MLP(nnx.Rngs(0), psum=None)
    with pytest.raises(ReplicationError) as e:
        step(model, xs[0], ys[0])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("<lambda>: output () is declared replicated over data, model but its copies differ: 4 of 8")
    assert msg.endswith("the copies differ along 'model': a value computed from a weight split over 'model' was used "
                        "as if whole (usually a plain matmul, x @ w, against a split w); sum the partial results with "
                        "dpjax.compute.tensor_parallel.reduce_from_model(x) (a psum whose gradient is right here) and "
                        "pass the layer's input through dpjax.compute.tensor_parallel.copy_to_model, or use dpjax.nn's "
                        "parallel layers, which do both")


def test_copies_that_differ_along_node_are_told_node():
    mesh = dpjax.make_mesh("2x2x2")  # node x data x model
    step = dpjax.shard_step(lambda x: jax.lax.pmean(x.sum(), "data"), mesh, batch_argnums=0)
    with pytest.raises(ReplicationError, match=r"average it inside the step \(jax\.lax\.pmean\(x, 'node'\)"):
        step(np.arange(8.0).reshape(8, 1))


def test_a_sharding_constraint_where_every_axis_is_manual_is_passed_over_or_told_what_to_do():
    """No annotations: every axis manual ("explicit"), a GSPMD hint has nothing to constrain.
    Called as jax.lax.with_sharding_constraint it is passed over (the numpy sum); bound to a
    name of its own before the trace, it is JAX's, and one line says what to do."""
    mesh = dpjax.make_mesh("4x2")
    x, w = np.arange(32.0, dtype=np.float32).reshape(8, 4), np.ones((4, 4), np.float32)

    def step(w, x, constrain=None):  # None: jax.lax's, looked up while the step is traced
        h = (constrain or jax.lax.with_sharding_constraint)(x @ w, NamedSharding(mesh, P("data", None)))  # GSPMD hint
        return jax.lax.psum(h.sum(), "data")

    assert float(dpjax.shard_step(step, mesh, batch_argnums=1)(w, x)) == (x @ w).sum()
    with pytest.raises(dpjax.UserError) as e:
        dpjax.shard_step(lambda w, x: step(w, x, early), mesh, batch_argnums=1)(w, x)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("<lambda>: with_sharding_constraint inside shard_step: every mesh axis")
    assert msg.endswith("call it as jax.lax.with_sharding_constraint (it is passed over here: a GSPMD hint has "
                        "nothing to constrain), or remove it")
