"""dpjax.sharding_rules: sharding a user's own flax model by parameter-path patterns or by
flax's logical axis names, and FSDP of an unchanged Linen CNN, which must train as on one
device.
"""

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax import sharding_rules as R
from dpjax.sharding import state_specs

TOL = dict(rtol=2e-5, atol=2e-6)  # float32: the 8 partial gradients summed in another order


class CNN(nn.Module):
    """An ordinary Linen CNN: nothing in it knows about devices."""

    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(8, (3, 3))(x)), (2, 2), (2, 2))
        x = nn.relu(nn.Conv(16, (3, 3))(x)).reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(4)(x)


RULES = [(r"params/Conv_\d+/kernel", P(None, None, None, "data")),  # output channels split over data
         (r"params/Dense_\d+/kernel", P("data", None)),  # input features split over data
         (r"params/(Conv_\d+|Dense_0)/bias", P("data")),
         (r".*", P())]  # the rest (Dense_1's 4 biases) replicated


@pytest.fixture(scope="module")
def cnn():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 8, 8, 1)).astype(np.float32), rng.integers(0, 4, 16)
    return CNN(), jax.jit(CNN().init)(jax.random.key(0), x[:1]), x, y


def fsdp_run(cnn, layout, steps=3):
    """The user's Adam loop; the only FSDP line is `layout.gather(p)` before apply."""
    model, params, x, y = cnn
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    ospecs = state_specs(tx, opt_state, layout.specs)

    def train_step(params, opt_state, x, y):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(layout.gather(p), x), y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)  # sharded and averaged by the gather's backward
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    step = dpjax.shard_step(train_step, layout.mesh, batch_argnums=(2, 3), in_specs=(layout.specs, ospecs),
                            out_specs=(layout.specs, ospecs, P()))
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
    return params, losses


def one_device(cnn, steps=3):
    """The same loop on one device with plain jax.jit: no mesh, no gather."""
    model, params, x, y = cnn
    tx = optax.adam(1e-2)

    @jax.jit
    def train_step(params, opt_state):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for _ in range(steps):
        params, opt_state, loss = train_step(params, opt_state)
        losses.append(float(loss))
    return params, losses


def test_fsdp_of_an_unchanged_linen_cnn_equals_one_device(cnn, mesh_of):
    """Path rules that split every parameter over `data` (FSDP) on 8x1 give one device's
    losses and parameters; `fsdp=True` in one call chooses the same split."""
    mesh = mesh_of("8x1", 8)
    layout = R.layout(cnn[1], mesh, RULES)
    auto = R.layout(cnn[1], mesh, fsdp=True)
    assert (auto.specs, auto.gather_dims) == (layout.specs, layout.gather_dims)
    params, losses = fsdp_run(cnn, layout)
    kernel = params["params"]["Conv_1"]["kernel"]
    assert kernel.sharding.spec == P(None, None, None, "data") and kernel.addressable_shards[0].data.shape == (
        3, 3, 8, 2)  # each device holds an eighth
    want_params, want = one_device(cnn)
    np.testing.assert_allclose(losses, want, **TOL)
    assert losses[-1] < losses[0]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(a, b, **TOL)


def test_path_rules_match_the_full_path_first_match_wins(cnn):
    params = cnn[1]
    specs = R.specs_from_rules(params, [(r"params/Dense_0/kernel", P("data", None)), (r".*kernel", P(None, "model")),
                                        (r".*", P())])
    assert specs["params"]["Dense_0"]["kernel"] == P("data", None)  # first match wins
    assert specs["params"]["Dense_1"]["kernel"] == P(None, "model")
    assert specs["params"]["Conv_0"]["bias"] == P()
    # a pattern must match the whole path: 'Dense_0/kernel' and 'kernel' match nothing here
    tail = R.specs_from_rules(params, [(r"Dense_0/kernel", P("data")), (r"kernel", P("data")), (r".*", P("model"))])
    assert set(jax.tree.leaves(tail, is_leaf=lambda s: isinstance(s, P))) == {P("model")}
    for rules in ([(r"Dense_0/kernel", P("data"))], [(r"kernel", P("data"))], []):
        with pytest.raises(dpjax.UserError, match=r"^parameter params/Conv_0/bias \(8,\) matches no sharding rule"):
            R.specs_from_rules(params, rules)
    assert R.specs_from_rules(params, [], default=P())["params"]["Dense_1"]["bias"] == P()


def test_logical_names_map_to_mesh_axes(mesh_of):
    rules = [("mlp", "model"), ("embed", None), ("mlp", "data")]  # the first rule for a name wins

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))(x)

    boxed = jax.eval_shape(Linen().init, jax.random.key(0), jax.ShapeDtypeStruct((1, 4), np.float32))
    specs = R.specs_from_logical(boxed, rules)
    assert specs["params"]["Dense_0"] == {"kernel": P(None, "model"), "bias": P()}
    layout = R.layout(boxed, mesh_of("1x4", 4), logical=rules)  # the layout of the unboxed parameters
    assert layout.specs == {"params": {"Dense_0": {"kernel": P(None, "model"), "bias": P(None)}}}  # padded to ndim
    with nnx.use_eager_sharding(False):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "vocab"))
        linear = nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))
    with pytest.raises(dpjax.UserError, match=r"^parameter kernel has logical axis 'vocab', which no logical rule"):
        R.specs_from_logical(nnx.state(linear), rules)
    linear.kernel.set_metadata(out_sharding=("embed", "mlp"))
    assert R.specs_from_logical(nnx.state(linear), rules)["kernel"] == P(None, "model")
