"""`check="reference"` (`dpjax.wrap.reference`) where nothing else speaks: steps whose devices
agree with one another, or hold no copies to compare, and compute something else than one
device. Each case runs silently without the check (shown first), and stops with it, in one
line naming the leaf and the cause. The per-device normaliser and the missing average whose
copies differ are in tests/test_jit.py; the examples in tests/test_examples_reference.py.

Adam's first step moves a parameter whose gradient is 0 but for round-off by a full step of
either sign; the check measures how far round-off moves each leaf (a second one-device run on
nudged inputs) and passes such a step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax import lax
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax.compute.tensor_parallel import copy_to_model, reduce_from_model
from dpjax.mesh import bound
from dpjax.wrap import reference

RNG = np.random.default_rng(0)
X = RNG.standard_normal((16, 4)).astype(np.float32)
Y = RNG.standard_normal((16, 4)).astype(np.float32)
Y8 = RNG.standard_normal((16, 8)).astype(np.float32)


class TPMLP(nn.Module):
    """A tensor-parallel MLP written with dpjax's f and g (the identity where `model` is not
    bound, so it runs on one device too), its weights annotated as Megatron splits them."""

    @nn.compact
    def __call__(self, x):
        w1 = self.param("w1", nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")), (4, 8))
        w2 = self.param("w2", nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None)), (8, 4))
        return reduce_from_model(nn.relu(copy_to_model(x) @ w1) @ w2)


def tp_step(params, x, y):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((TPMLP().apply({"params": p}, x) - y) ** 2))(params)
    grads = dpjax.allreduce_gradients(grads) if bound("data") else grads
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


@pytest.fixture(scope="module")
def unboxed():
    """lm1b's setup_initial_state unboxes: the weights then reach the step whole."""
    return nn.meta.unbox(TPMLP().init(jax.random.key(0), X)["params"])


def test_tensor_parallelism_lost_by_unboxing_is_caught(unboxed, recwarn):
    """Each of the two `model` ranks computes the whole product from the whole weights, and g
    sums the two: the copies agree, the loss is twice one device's (test_each_case_is_silent_without_the_check)."""
    with pytest.raises(dpjax.UserError) as e:
        dpjax.shard_step(tp_step, "4x2", batch_argnums=(1, 2), out_specs=(P(), "mean"),
                         check="reference")(unboxed, X, Y)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith('tp_step: check="reference": output/1 () differs from the one-device '
                                              "run of the same batch and state")
    assert msg.endswith("likely cause: the parameters are not split as annotated: the mesh's 'model' axis splits none "
                        "of them (boxes unboxed with nn.meta.unbox, or no in_specs), so each of its devices holds "
                        "whole weights, and a sum of partial products over 'model' (dpjax.compute.tensor_parallel."
                        "reduce_from_model, a row-parallel layer) adds the whole product once per device; keep the "
                        "boxes, or pass in_specs"), msg


def fsdp_step(w_shard, x, y, average):
    """Hand-written FSDP: the rows of w split over `data`, gathered for the step; each device
    updates its own block with the batch's gradient (averaged: pmean) or its rows' (not)."""
    w = lax.all_gather(w_shard, "data", tiled=True)
    loss, g = jax.value_and_grad(lambda w: jnp.mean((jnp.concatenate([x, x ** 2], 1) @ w - y) ** 2))(w)
    if average:
        g = lax.pmean(g, "data")
    k = w_shard.shape[0]
    return w_shard - 0.1 * lax.dynamic_slice_in_dim(g, lax.axis_index("data") * k, k), lax.pmean(loss, "data")


W = RNG.standard_normal((8, 4)).astype(np.float32)


def fsdp(mesh, check):
    return dpjax.shard_step(fsdp_step, mesh, batch_argnums=(1, 2), in_specs=(P("data"), None, None),
                            out_specs=(P("data"), P()), static_argnums=3, check=check)


def test_a_missing_pmean_in_state_split_over_the_data_axes_is_caught(mesh_of):
    """No device holds a copy of another's block, so the replica check has nothing to compare."""
    fsdp(mesh_of("8x1", 8), "reference")(W, X, Y, True)  # the averaged step passes
    with pytest.raises(dpjax.UserError) as e:
        fsdp(mesh_of("8x1", 8), "reference")(W, X, Y, False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith('fsdp_step: check="reference": output/0 (8, 4) differs from the '
                                              "one-device run")
    assert ("likely cause: output/0 is split over the data axes, so each device computed its own block, and no "
            "copies compare: a gradient not averaged over the data axes before this device's block was taken "
            "(jax.lax.pmean, dpjax.allreduce_gradients)") in msg, msg


@pytest.mark.extended  # two more compiles
def test_each_case_is_silent_without_the_check(mesh_of, unboxed, recwarn):
    """What the check is for: without it both steps run, no error, another result than one device's."""
    want = jnp.mean((TPMLP().apply({"params": unboxed}, X) - Y) ** 2)
    got = dpjax.shard_step(tp_step, "4x2", batch_argnums=(1, 2), out_specs=(P(), "mean"))(unboxed, X, Y)[1]
    assert abs(float(got) - float(want)) > 0.5  # twice: a LayoutWarning was all that was said
    right, wrong = (fsdp(mesh_of("8x1", 8), None)(W, X, Y, average)[0] for average in (True, False))
    assert float(jnp.max(jnp.abs(right - wrong))) > 1e-2


def centred_step(params, opt, x, y, tx):
    """x @ w + b, each group of 2 outputs centred: b shifts a group as a whole, so its gradient
    is 0 but for round-off, and Adam's first step moves it by ±lr on that round-off's sign."""
    def loss_fn(p):
        h = (x @ p["w"]).reshape(-1, 4, 2) + p["b"][None, :, None]
        return jnp.mean((h - h.mean(-1, keepdims=True) - y.reshape(-1, 4, 2)) ** 2)
    updates, opt = tx.update(jax.grad(loss_fn)(params), opt, params)
    return optax.apply_updates(params, updates), opt


@pytest.fixture(scope="module")
def centred():
    params = {"w": RNG.standard_normal((4, 8)).astype(np.float32), "b": np.zeros(4, np.float32)}
    tx = dpjax.DistributedOptimizer(optax.adam(0.01))
    return params, tx.init(params), tx


@pytest.mark.extended  # ~2 s of CPU: Adam's step and its one-device twin compiled
def test_adam_on_a_gradient_of_round_off_passes(mesh_of, centred):
    params, opt, tx = centred
    dpjax.shard_step(centred_step, mesh_of("8x1", 8), batch_argnums=(2, 3), static_argnums=4,
                     check="reference")(params, opt, X, Y8, tx)


@pytest.mark.extended
def test_round_off_is_measured_per_leaf(monkeypatch, mesh_of, centred):
    """Without the nudged run's measure the same step is stopped at b, whose Adam step took the
    round-off's sign (what the measure is for)."""
    params, opt, tx = centred
    monkeypatch.setattr(reference, "SLACK", 0.0)
    with pytest.raises(dpjax.UserError, match=r"^centred_step: check=\"reference\": output/0/b \(4,\) differs"):
        dpjax.shard_step(centred_step, mesh_of("8x1", 8), batch_argnums=(2, 3), static_argnums=4,
                         check="reference")(params, opt, X, Y8, tx)


def test_the_optimizers_default_axis_on_a_mesh_of_other_names_and_one_device():
    """miniGPT's ('batch', 'model') mesh: DistributedOptimizer's default 'data' is the mesh's data
    axes; in the one-device run every one is of size 1, and the average over them is the identity
    (it was an unbound 'data' there, which stopped every such example under the check)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(8, 1), ("batch", "model"))
    tx = dpjax.DistributedOptimizer(optax.sgd(0.1))

    def step(w, opt, x):
        updates, opt = tx.update(jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w), opt, w)
        return optax.apply_updates(w, updates), opt

    w = np.ones((4, 2), np.float32)
    got, _ = dpjax.shard_step(step, mesh, batch_argnums=2, check="reference")(w, tx.init(w), X)
    np.testing.assert_allclose(got, w - 0.1 * jax.grad(lambda w: jnp.mean((X @ w) ** 2))(w), rtol=1e-5)
