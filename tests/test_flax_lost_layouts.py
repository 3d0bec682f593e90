"""Tensor parallelism lost without a word (issue 49): a Linen model annotated with logical axis names, trained by
shard_step on a 4x2 mesh, splits nothing over `model` when its boxes are unboxed (lm1b's `setup_initial_state`
does it) or when no `nn.logical_axis_rules` map the names; each is now one warning line saying which, and the
annotated model under its rules splits as annotated without one."""

import warnings

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn

import dpjax
from dpjax.wrap.annotations import LayoutWarning

RULES = (("batch", "data"), ("mlp", "model"), ("embed", None))
X = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
Y = np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        return nn.Dense(4, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(nn.relu(h))


def train_once(params):
    """One SGD step of the MLP under shard_step on 4x2 (the batch split over data): the new parameters and the
    warnings of the first call."""
    tx = dpjax.DistributedOptimizer(optax.sgd(0.1))

    def step(params, opt, x, y):
        loss = lambda p: ((MLP().apply({"params": p}, x) - y) ** 2).mean()  # noqa: E731
        updates, opt = tx.update(jax.grad(loss)(params), opt, params)
        return optax.apply_updates(params, updates), opt

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new, _ = dpjax.shard_step(step, "4x2", batch_argnums=(2, 3))(params, tx.init(params), X, Y)
    return new, [str(w.message) for w in caught if issubclass(w.category, LayoutWarning)]


@pytest.fixture(scope="module")
def boxed():
    return MLP().init(jax.random.key(0), X)["params"]


def test_unboxed_parameters_on_a_model_axis_are_said(boxed):
    _, said = train_once(nn.meta.unbox(boxed))
    assert len(said) == 1 and said[0].startswith("dpjax: step: the mesh's 'model' axis of 2 devices splits no "
                                                 "parameter, so every device on it computes the whole model: no "
                                                 "sharding annotation reached the step (parameters unboxed"), said


def test_logical_names_without_rules_are_said(boxed):
    _, said = train_once(boxed)
    assert len(said) == 1 and "logical axis names ('embed', 'mlp') but no nn.logical_axis_rules are in force" in (
        said[0]), said


def test_under_its_rules_the_model_splits_as_annotated_without_a_word(boxed):
    with nn.logical_axis_rules(RULES):
        new, said = train_once(boxed)
    assert said == []
    assert new["Dense_0"]["kernel"].value.sharding.spec == jax.sharding.PartitionSpec(None, "model")


class Attention(nn.Module):
    """Linen's attention annotated as flax's lm1b example annotates it."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.xavier_uniform()
        y = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16, use_bias=False, deterministic=True,
                                            kernel_init=nn.with_logical_partitioning(init, ("embed", "kv")))(
            x, mask=nn.make_causal_mask(x[..., 0]))
        return nn.Dense(4, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(y)


def test_linen_attention_with_lm1b_annotations_splits_by_heads_and_is_the_dense_model():
    from flax.training import train_state

    x = np.random.default_rng(0).standard_normal((8, 6, 8)).astype(np.float32)
    t = np.random.default_rng(1).standard_normal((8, 6, 4)).astype(np.float32)
    model = Attention()
    params = model.init(jax.random.key(0), x)["params"]

    def train_step(state, x, t):
        loss, grads = jax.value_and_grad(lambda p: ((state.apply_fn({"params": p}, x) - t) ** 2).mean())(state.params)
        return state.apply_gradients(grads=grads), loss

    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=dpjax.DistributedOptimizer(optax.sgd(0.1)))
    one = train_state.TrainState.create(apply_fn=model.apply, params=nn.unbox(params), tx=optax.sgd(0.1))
    step = dpjax.shard_step(train_step, "4x2", batch_argnums=(1, 2), out_specs=(jax.sharding.PartitionSpec(), "mean"))
    with nn.logical_axis_rules((("embed", None), ("kv", "model"), ("mlp", "model"))):
        for _ in range(2):
            state, loss = step(state, x, t)
            one, want = jax.jit(train_step)(one, x, t)
            np.testing.assert_allclose(loss, want, rtol=2e-5)
    query = state.params["MultiHeadDotProductAttention_0"]["query"]["kernel"].value
    assert query.shape == (8, 4, 4) and query.sharding.spec == jax.sharding.PartitionSpec(None, "model")  # by heads
    np.testing.assert_allclose(query, one.params["MultiHeadDotProductAttention_0"]["query"]["kernel"], rtol=2e-5,
                               atol=2e-6)


def test_a_mesh_with_explicit_axes_is_one_line_with_the_fix(boxed):
    """jax.make_mesh's default axes are Explicit: the row-parallel Dense then has no output sharding, and JAX's
    ShardingTypeError (a private class, no traceback of ours) becomes one line saying how to make the mesh."""
    from dpjax.errors import UserError

    explicit = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    tx = dpjax.DistributedOptimizer(optax.sgd(0.1))

    def step(params, opt, x, y):
        loss = lambda p: ((MLP().apply({"params": p}, x) - y) ** 2).mean()  # noqa: E731
        updates, opt = tx.update(jax.grad(loss)(params), opt, params)
        return optax.apply_updates(params, updates), opt

    with nn.logical_axis_rules(RULES), pytest.raises(UserError, match=r"^step: the mesh's 'data', 'model' axes are "
                                                                      r"Explicit .* axis_types=\(jax\.sharding\."
                                                                      r"AxisType\.Auto,\) \* 2"):
        dpjax.shard_step(step, explicit, batch_argnums=(2, 3))(boxed, tx.init(boxed), X, Y)


def test_heads_that_do_not_divide_are_not_told_to_pad_a_vocabulary():
    """The refusal of an uneven split says to pad only a leaf that spans a vocabulary (an embedding, the
    output layer); attention heads are told to use an axis that divides them."""
    from dpjax.errors import UserError

    P = jax.sharding.PartitionSpec
    step = dpjax.shard_step(lambda p, x: x.sum(), "2x4", batch_argnums=1,
                            in_specs=({"attn": {"kernel": P(None, "model", None)}}, P("data")), out_specs="mean")
    with pytest.raises(UserError) as e:
        step({"attn": {"kernel": np.ones((8, 6, 4), np.float32)}}, np.ones((8, 2), np.float32))
    assert str(e.value).endswith("its dimension 1 (6) does not divide into 4 parts; use a mesh axis whose size "
                                 "divides 6, or annotate that dimension None to keep it whole"), str(e.value)
