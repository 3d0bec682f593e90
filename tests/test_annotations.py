"""dpjax.wrap.annotations: shard_step with a flax model's own annotations. A Linen model with
logical axis rules (its attention split by heads over 'model') trains as on one device;
flax's attention laid out explicitly is one line naming the parameter; a mesh without a
model axis leaves the annotated layers whole, said once; a step naming an automatic axis
in a collective, and an unknown layout, are one line each.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training.train_state import TrainState
from jax.lax import with_sharding_constraint
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax.wrap.annotations import LayoutWarning

TOL = {"rtol": 2e-5, "atol": 2e-6}  # float32: sums over 4 data and 2 model ranks in another order
RULES = [("batch", None), ("embed", None), ("heads", "model"), ("kv", None), ("mlp", "model")]
init = nn.initializers.lecun_normal()
JAX_CONSTRAINT = jax.lax.with_sharding_constraint


class LinenBlock(nn.Module):
    """flax's Linen attention as it comes (its parameters unannotated: flax cannot apply
    DenseGeneral's boxes under a mesh, its kernel_init_wrap constrains the flat kernel
    with the 3-d names), then a dense layer."""

    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, bias_init=nn.initializers.normal(0.1))(x)
        return nn.Dense(16)(x).mean(axis=(1, 2))


HEADS = [(r".*/(query|key|value)/kernel", P(None, "model")), (r".*/(query|key|value)/bias", P("model")),
         (r".*/out/kernel", P("model")), (".*", P())]  # split by heads, as Megatron does


def data(seed=0):
    x = np.random.default_rng(seed).standard_normal((16, 6, 16)).astype(np.float32)
    return x, x[:, 0, :4].sum(axis=1)


def linen_step(state, x, y):
    def loss_fn(params):
        return jnp.mean((state.apply_fn(params, x) - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def train_both(variables, apply_fn, specs=None, model_axes=None, rules=RULES):
    """Two SGD steps on 4x2 under shard_step (the variables as given: boxes, or raw with the
    specs as in_specs) and on one device under jax.jit; the losses and parameters, each pair."""
    tx = optax.sgd(0.1)
    plain = TrainState.create(apply_fn=apply_fn, params=nn.unbox(variables), tx=tx)
    ours = TrainState.create(apply_fn=apply_fn, params=variables, tx=dpjax.DistributedOptimizer(tx))
    in_specs = None if specs is None else (ours.replace(step=P(), params=specs, opt_state=P()),)
    step = dpjax.shard_step(linen_step, "4x2", batch_argnums=(1, 2), out_specs=(P(), "mean"), in_specs=in_specs,
                            model_axes=model_axes)
    one = jax.jit(linen_step)
    with nn.logical_axis_rules(rules):
        for seed in range(2):
            ours, loss = step(ours, *data(seed))
            plain, want = one(plain, *data(seed))
            np.testing.assert_allclose(loss, want, **TOL)
    for a, b in zip(jax.tree.leaves(nn.unbox(ours.params)), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    return ours


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
                             bias_init=nn.with_logical_partitioning(nn.initializers.normal(0.1), ("mlp",)))(x))
        return nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(h).mean(axis=(1, 2))


def test_a_linen_model_with_logical_axis_rules_trains_as_on_one_device():
    """Its boxes (nn.with_logical_partitioning) read under nn.logical_axis_rules: the model
    axes automatic, the MLP split by columns then rows, as on one device."""
    model = LinenMLP()
    ours = train_both(model.init(jax.random.key(0), data()[0][:1]), model.apply)
    kernel = ours.params["params"]["Dense_0"]["kernel"]
    assert isinstance(kernel, nn.LogicallyPartitioned) and kernel.value.sharding.spec == P(None, "model")


def test_linen_attention_split_by_heads_trains_as_on_one_device():
    """flax's Linen attention with its own parameters, split by heads through path rules
    (dpjax.sharding_rules), the model axes "auto"."""
    model = LinenBlock()
    params = model.init(jax.random.key(0), data()[0][:1])
    ours = train_both(params, model.apply, dpjax.sharding_rules.specs_from_rules(params, HEADS), model_axes="auto")
    query = ours.params["params"]["MultiHeadDotProductAttention_0"]["query"]["kernel"]
    assert query.sharding.spec == P(None, "model") and query.shape == (16, 4, 4)


def attention(mesh="4x2"):
    # flax shards annotated Variables as it makes them, on the mesh in context
    with jax.set_mesh(dpjax.make_mesh(mesh, jax.devices()[:1] if mesh == "1x1" else None)):
        return NNXAttention(nnx.Rngs(0))


class NNXAttention(nnx.Module):
    def __init__(self, rngs):
        self.mha = nnx.MultiHeadAttention(num_heads=4, in_features=16, decode=False, rngs=rngs,
                                          kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                                            (None, "model")),
                                          bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)))

    def __call__(self, x):
        return self.mha(x).mean(axis=(1, 2))


def test_flax_attention_laid_out_explicitly_is_one_line_naming_the_parameter():
    step = dpjax.shard_step(lambda model, x: model(x), "4x2", batch_argnums=1, out_specs="rows",
                            model_axes="explicit")
    step.__name__ = "step"
    with pytest.raises(dpjax.UserError) as e:
        step(attention(), data()[0])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(("step: TypeError while tracing the step, at model/mha/",
                           "step: ValueError while tracing the step, at model/mha/")), msg
    assert "on each device of the mesh {'data': 4, 'model': 2} (explicit model axes)" in msg, msg
    assert "leave model_axes to shard_step" in msg, msg


def test_flax_attention_under_automatic_model_axes_is_the_dense_layer():
    model, dense = attention(), attention("1x1")
    rows = dpjax.shard_step(lambda model, x: model(x), "4x2", batch_argnums=1, out_specs="rows")(model, data()[0])
    np.testing.assert_allclose(rows, dense(data()[0]), **TOL)


def test_a_mesh_without_a_model_axis_leaves_the_layers_whole_said_once():
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    model, dense = attention("8x1"), attention("1x1")
    step = dpjax.shard_step(lambda model, x: model(x), mesh, batch_argnums=1, out_specs="rows")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rows = step(model, data()[0])
        step(model, data()[0])
    said = [str(w.message) for w in seen if issubclass(w.category, LayoutWarning)]
    assert len(said) == 2 and said[0].startswith("dpjax: <lambda>: the model was made on the mesh {'data': 8, "), said
    assert said[1:] == ["dpjax: <lambda>: the mesh {'batch': 8} has no 'model' axis, so the 8 parameters annotated "
                    "over it (model/mha/key/bias first) stay whole on every device; add the axis to the mesh to split "
                    "them"], said
    np.testing.assert_allclose(rows, dense(data()[0]), **TOL)


def test_a_collective_over_an_automatic_axis_is_one_line():
    def step(model, x):
        return jax.lax.psum(model(x), "model")
    with pytest.raises(dpjax.UserError, match=r"^step: NameError while tracing the step, at model/mha/.*the model "
                                              r"axes are automatic here .* pass model_axes=\"explicit\""):
        dpjax.shard_step(step, "4x2", batch_argnums=1, out_specs="rows")(attention(), data()[0])


def test_an_unknown_layout_is_one_line():
    with pytest.raises(dpjax.UserError, match=r"^shard_step: model_axes='gspmd' is not one of 'auto', 'explicit' "
                                              r"or None$"):
        dpjax.shard_step(lambda x: x, model_axes="gspmd")


def test_a_mesh_of_your_own_axis_names_maps_to_dpjax_s():
    """A ('dp', 'tp') mesh with annotations over 'tp': axes={"tp": "model"} makes 'tp' the
    model axis (else it would be a data axis: every axis but model and stage is)."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "tp"))
    ann = lambda *names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731
    with jax.set_mesh(mesh):
        model = nnx.Linear(16, 8, kernel_init=ann(None, "tp"), use_bias=False, rngs=nnx.Rngs(0))
    dense = nnx.Linear(16, 8, use_bias=False, rngs=nnx.Rngs(0))
    step = dpjax.shard_step(lambda model, x: model(x), mesh, batch_argnums=1, out_specs="rows",
                            axes={"dp": "data", "tp": "model"})
    x = data()[0][:, 0]
    np.testing.assert_allclose(step(model, x), dense(x), **TOL)
    assert step.mesh.shape == {"data": 4, "model": 2} and model.kernel[...].sharding.shard_shape((16, 8)) == (16, 4)
    with pytest.raises(dpjax.UserError, match=r"^<lambda>: axes=\{'mp': 'model', 'dp': 'data'\} names 'mp', not an "
                                              r"axis of the mesh \{'dp': 4, 'tp': 2\}; map each"):
        dpjax.shard_step(lambda x: x, mesh, batch_argnums=0, axes={"mp": "model", "dp": "data"})(x)


def constraints_in(step) -> list:
    """The sharding constraints on values the step computes (Shardy's, in its lowered
    program; not those on its arguments), as text."""
    program, args = step._last
    return re.findall(r"sdy\.sharding_constraint %(?!arg)\w+ <@mesh, (\[.*?\])>", program.lower(*args).as_text())


@pytest.mark.parametrize("spec, over_model", [(P("data", "model"), True), (P(("data",), None), False),
                                              (P("dp", "tp"), True), ("named", True), (P("data", P.UNCONSTRAINED),
                                                                                       False)])
def test_a_constraint_naming_a_data_axis_keeps_what_it_says_of_the_model_axes(spec, over_model):
    """flax's GSPMD guide's `with_sharding_constraint(y, P('data', 'model'))` inside shard_step:
    the data axis is dropped (each device already holds its rows), the model axis kept
    (Shardy's constraint on the local rows), the user's axis names mapped; the rows are
    the dense layer's, and JAX's own function is back after the trace."""
    own = spec == P("dp", "tp")  # the user's own axis names
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "tp")) if own else dpjax.make_mesh("4x2")
    axes = {"dp": "data", "tp": "model"} if own else None
    ann = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "tp" if axes else "model"))
    with jax.set_mesh(mesh):
        model = nnx.Linear(16, 8, kernel_init=ann, use_bias=False, rngs=nnx.Rngs(0))
    dense = nnx.Linear(16, 8, use_bias=False, rngs=nnx.Rngs(0))
    spec = NamedSharding(mesh, P("data", "model")) if spec == "named" else spec
    step = dpjax.shard_step(lambda model, x: jax.lax.with_sharding_constraint(model(x), spec), mesh,
                            batch_argnums=1, out_specs="rows", axes=axes)
    x = data()[0][:, 0]
    np.testing.assert_allclose(step(model, x), dense(x), **TOL)
    assert ('[{}, {"model"}]' in constraints_in(step)) == over_model
    assert jax.lax.with_sharding_constraint is JAX_CONSTRAINT


def test_a_mesh_of_explicit_axes_from_jax_make_mesh_works_as_under_jax_jit():
    """`jax.make_mesh`'s default axis type is Explicit (the sharding in the arrays' types, where
    a constraint is an assertion): an annotated layer on such a mesh gives the dense layer's
    rows, its kernel stays split, and a constraint over the model axis is passed over."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    ann = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    with jax.set_mesh(mesh):
        model = nnx.Linear(16, 8, kernel_init=ann, use_bias=False, rngs=nnx.Rngs(0))
    dense = nnx.Linear(16, 8, use_bias=False, rngs=nnx.Rngs(0))
    x = data()[0][:, 0]
    for constrain in (False, True):
        step = dpjax.shard_step(
            lambda m, x: jax.lax.with_sharding_constraint(m(x), P("data", "model")) if constrain else m(x),
            mesh, batch_argnums=1, out_specs="rows")
        np.testing.assert_allclose(step(model, x), dense(x), **TOL)
    assert model.kernel[...].sharding.spec == P(None, "model")


def test_a_linen_logical_constraint_naming_the_data_axis_trains_as_on_one_device():
    """`nn.with_logical_constraint(h, ("batch", None, "mlp"))` with 'batch' mapped to the data
    axis (MaxText's way): the constraint keeps its model axis, and two steps equal one device's."""
    class Constrained(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(32, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
            h = nn.with_logical_constraint(nn.relu(h), ("batch", None, "mlp"))
            return nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(h).mean(axis=(1, 2))

    model = Constrained()
    train_both(model.init(jax.random.key(0), data()[0][:1]), model.apply, rules=[("batch", "data")] + RULES[1:])


def test_a_constraint_bound_before_the_trace_naming_a_data_axis_is_one_line():
    """A constraint imported under a name of its own is JAX's, which refuses a manual axis:
    one line saying how to write it, and JAX's own function back after the failed trace."""
    def step(model, x):
        return with_sharding_constraint(model(x), P("data"))  # flax's guide writes P('data', 'model')
    with pytest.raises(dpjax.UserError, match=r"^step: with_sharding_constraint inside shard_step names a data axis "
                                              r"\(data\), which is manual here .*imported under a name of its own "
                                              r".*: call it as jax\.lax\.with_sharding_constraint, or write None for "
                                              r"the data axes \(P\(None, 'model'\) for P\('data', 'model'\)\)$"):
        dpjax.shard_step(step, "4x2", batch_argnums=1, out_specs="rows")(attention(), data()[0])
    assert jax.lax.with_sharding_constraint is JAX_CONSTRAINT


def test_a_model_made_on_another_mesh_is_said_once():
    model = attention("2x4")  # tuple annotations, placed by flax on the 2x4 mesh in context
    step = dpjax.shard_step(lambda model, x: model(x), "4x2", batch_argnums=1, out_specs="rows")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rows = step(model, data()[0])
        step(model, data()[0])
    said = [str(w.message) for w in seen if issubclass(w.category, LayoutWarning)]
    assert said == ["dpjax: <lambda>: the model was made on the mesh {'data': 2, 'model': 4}, and shard_step lays "
                    "it out on {'data': 4, 'model': 2} instead (its annotations' axes, this mesh's sizes)"], said
    np.testing.assert_allclose(rows, attention("1x1")(data()[0]), **TOL)


def test_dpjax_nn_layers_on_a_mesh_without_a_model_axis_are_said_once():
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    layer = dpjax.nn.nnx.ColumnParallelLinear(16, 8, rngs=nnx.Rngs(0))
    step = dpjax.shard_step(lambda layer, x: layer(x), mesh, batch_argnums=1, out_specs="rows")
    with pytest.warns(LayoutWarning, match=r"has no 'model' axis, so the 2 parameters annotated over it"):
        rows = step(layer, data()[0][:, 0])
    np.testing.assert_allclose(rows, data()[0][:, 0] @ np.asarray(layer.kernel[...]) + np.asarray(layer.bias[...]),
                               **TOL)
