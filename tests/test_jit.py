"""`dpjax.jit`, a drop-in for `jax.jit`, and what it stands on: shard_step's static, keyword and
donated arguments (`dpjax.wrap.call`), and the global batch's sums (`dpjax.global_sum`,
`dpjax.weighted_mean`). Every result is compared with plain `jax.jit` on one device.

The training script is written for `jax.jit` as flax's lm1b writes one: a Linen model with
logical axis annotations, its state unboxed and laid out by `nn.logical_to_mesh_sharding`, a
loss normalised by the batch's count of real tokens, a static argument, the state donated.
Distributing it changes `jax.jit` to `dpjax.jit` (same arguments) and wraps the optimizer.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax.mesh import bound

VOCAB, WIDTH, ROWS, LEN = 16, 8, 16, 6
RULES = [("batch", "data"), ("vocab", None), ("embed", None), ("mlp", "model")]
init = nn.initializers.normal(0.5)


class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(VOCAB, WIDTH, embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")))(ids)
        h = nn.relu(nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
                             bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)))(h))
        return nn.Dense(VOCAB, kernel_init=nn.with_logical_partitioning(init, ("mlp", "vocab")))(h)


def train_step(state, batch, smoothing):
    """lm1b's shape: a token-weighted loss (padding weighs 0), a static label smoothing."""
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["inputs"])
        targets = optax.smooth_labels(jax.nn.one_hot(batch["targets"], VOCAB), smoothing)
        return dpjax.weighted_mean(optax.softmax_cross_entropy(logits, targets), batch["weights"])
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss, "tokens": dpjax.global_sum(batch["weights"].sum())}


def batches(steps=2):
    rng = np.random.default_rng(0)
    for _ in range(steps):
        ids = rng.integers(0, VOCAB, (ROWS, LEN + 1)).astype(np.int32)
        lengths = rng.integers(1, LEN + 1, ROWS)  # real tokens per row: the devices' counts differ
        weights = (np.arange(LEN)[None] < lengths[:, None]).astype(np.float32)
        yield {"inputs": ids[:, :-1], "targets": ids[:, 1:], "weights": weights}


@pytest.fixture(scope="module")
def one_device():
    """Plain jax.jit on one device: the losses, token counts and final parameters of 2 steps."""
    variables = TinyLM().init(jax.random.key(0), np.zeros((1, LEN), np.int32))
    state = TrainState.create(apply_fn=TinyLM().apply, params=nn.unbox(variables)["params"], tx=optax.sgd(0.5))
    step = jax.jit(train_step, static_argnums=2, donate_argnums=0)
    metrics = []
    for batch in batches():
        state, m = step(state, batch, 0.1)
        metrics.append(m)
    return metrics, state.params


def lm1b_port(mesh, rules=RULES, **options):
    """The script above as lm1b lays it out, with dpjax's changes: dpjax.jit, the optimizer wrapped.
    options: more of dpjax.jit's arguments."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        variables = TinyLM().init(jax.random.key(0), np.zeros((1, LEN), np.int32))
        boxed = TrainState.create(apply_fn=TinyLM().apply, params=variables["params"],
                                  tx=dpjax.DistributedOptimizer(optax.sgd(0.5)))             # dpjax
        state_sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
        state = jax.device_put(nn.unbox(boxed), state_sharding)
        data_sharding = NamedSharding(mesh, P("data"))
        step = dpjax.jit(train_step, in_shardings=(state_sharding, data_sharding), out_shardings=(state_sharding, None),
                         static_argnums=(2,), donate_argnums=0, **options)                    # dpjax: was jax.jit
        metrics = []
        for batch in batches():
            state, m = step(state, batch, 0.1)
            metrics.append(m)
    return metrics, state


@pytest.mark.parametrize("spec", [pytest.param("8x1", marks=pytest.mark.slow), "4x2"])  # 8x1: data alone, slow
def test_lm1b_style_script_equals_one_device(mesh_of, one_device, spec):
    want, params = one_device
    got, state = lm1b_port(mesh_of(spec, 8))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g["loss"], w["loss"], rtol=1e-5)
        assert float(g["tokens"]) == float(w["tokens"])  # the global batch's count, on every device
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), state.params, params)
    kernel = state.params["Dense_0"]["kernel"]
    if spec == "4x2":  # split over `model` as the rules say, kept so by out_shardings
        assert kernel.sharding.spec == P(None, "model") and kernel.addressable_shards[0].data.shape == (8, 8)


@pytest.mark.extended  # ~3 s of CPU: the TinyLM compiled on another mesh
def test_lm1b_style_script_on_an_fsdp_named_mesh_equals_one_device(one_device):
    """lm1b's default mesh: ('data', 'fsdp', 'tensor') with every device on `fsdp` and the batch
    on `data` (of size 1). `fsdp` splits the state and no batch, so it is laid out as jax.jit
    lays it out; the parameters come back split over it, on the user's mesh."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(1, 8, 1), ("data", "fsdp", "tensor"))
    got, state = lm1b_port(mesh, [("batch", "data"), ("vocab", None), ("embed", "fsdp"), ("mlp", "tensor")])
    want, params = one_device
    for g, w in zip(got, want):
        np.testing.assert_allclose(g["loss"], w["loss"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), state.params, params)
    kernel = state.params["Dense_0"]["kernel"]  # ('embed', 'mlp'): embed -> fsdp
    assert kernel.sharding.mesh == mesh and kernel.sharding.spec[0] == "fsdp"
    assert kernel.addressable_shards[0].data.shape == (1, 16)


def test_a_mesh_of_explicit_axes_is_one_line():
    """jax.make_mesh's default axes are Explicit: flax's Dense over a split dimension names no
    output sharding, and JAX's ShardingTypeError becomes one line with the fix (the state made
    off the mesh: flax's own init refuses such a mesh in `jax.set_mesh` before dpjax is called)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    variables = TinyLM().init(jax.random.key(0), np.zeros((1, LEN), np.int32))
    boxed = TrainState.create(apply_fn=TinyLM().apply, params=variables["params"],
                              tx=dpjax.DistributedOptimizer(optax.sgd(0.5)))
    state_sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, RULES)
    step = dpjax.jit(train_step, in_shardings=(state_sharding, NamedSharding(mesh, P("data"))),
                     out_shardings=(state_sharding, None), static_argnums=2)
    with nn.logical_axis_rules(RULES), pytest.raises(dpjax.UserError) as e:
        step(jax.device_put(nn.unbox(boxed), state_sharding), next(batches()), 0.1)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("train_step: the mesh's 'data', 'model' axes are Explicit "
                                              "(jax.make_mesh's default), so JAX asks each operation over a split "
                                              "dimension for its output's sharding (")
    assert msg.endswith("); make the mesh with axis_types=(jax.sharding.AxisType.Auto,) * 2, as code written for "
                        "jax.jit's sharding propagation expects, or give those operations out_sharding="), msg


def sgd_step(params, x, y, act, *, lr):
    """A step with a static argument (`act`), a keyword-only one (`lr`), the batch (x, y): y's
    last column weighs each row (1 to 3: the devices' sums of weights differ)."""
    def loss_fn(p):
        return dpjax.weighted_mean((act(x @ p["w"]) - y[:, :3]) ** 2, y[:, 3:])
    loss, grads = jax.value_and_grad(loss_fn)(params)
    if bound("data"):  # in the sharded step; plain jax.jit has no axis to average over
        grads = dpjax.allreduce_gradients(grads)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss, jnp.asarray(x.shape[0])


@pytest.fixture(scope="module")
def regression():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    weights = rng.integers(1, 4, (16, 1)).astype(np.float32)
    return {"w": rng.standard_normal((4, 3)).astype(np.float32)}, x, np.concatenate([np.tanh(x[:, :3]), weights], 1)


def _same(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got[:2], want[:2])


def test_static_argnums_and_keywords_as_jax_jit(mesh_of, regression):
    params, x, y = regression
    plain = jax.jit(sgd_step, static_argnums=3)
    step = dpjax.shard_step(sgd_step, mesh_of("8x1", 8), batch_argnums=(1, 2), static_argnums=3)
    for act in (jnp.tanh, jax.nn.relu):  # another static value: another program, as jax.jit compiles
        want = plain(params, x, y, act, lr=0.1)
        got = step(params, x, y, act, lr=0.1)
        _same(got, want)
        assert int(got[2]) == 2 and int(want[2]) == 16  # the rows split over 8 devices
    _same(step(params, y=y, act=jnp.tanh, x=x, lr=0.1), plain(params, x, y, jnp.tanh, lr=0.1))  # by keyword
    assert len(step._programs) == 2  # x and y by keyword are still the batch: the first program again
    by_name = dpjax.shard_step(sgd_step, mesh_of("8x1", 8), batch_argnums=(1, 2), static_argnames="act")
    _same(by_name(params, x, y, act=jnp.tanh, lr=0.1), plain(params, x, y, jnp.tanh, lr=0.1))
    with pytest.raises(dpjax.UserError, match="^sgd_step: the static argument act is a list, which is not hashable"):
        step(params, x, y, [jnp.tanh], lr=0.1)
    with pytest.raises(dpjax.UserError, match="^sgd_step: missing a required argument: 'y'"):
        step(params, x, act=jnp.tanh, lr=0.1)


@pytest.mark.parametrize("donate", [dict(donate_argnums=0), dict(donate_argnames="params")])
def test_donated_state_as_jax_jit(mesh_of, regression, donate):
    params, x, y = regression
    mesh = mesh_of("8x1", 8)
    mine = jax.device_put(params, NamedSharding(mesh, P()))  # placed as the step places it: donated as is
    one = jax.device_put(params, jax.devices()[0])
    want = jax.jit(sgd_step, static_argnums=3, **donate)(one, x, y, jnp.tanh, lr=0.1)
    got = dpjax.jit(sgd_step, in_shardings=(None, NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data"))),
                    static_argnums=3, **donate)(mine, x, y=y, act=jnp.tanh, lr=0.1)  # y, act by name: as placed
    _same(got, want)
    assert one["w"].is_deleted() and mine["w"].is_deleted()


def average_step(params, x, y, average):
    grads = jax.grad(lambda p: dpjax.weighted_mean((x @ p["w"] - y[:, :3]) ** 2, y[:, 3:]))(params)
    if average:
        grads = dpjax.allreduce_gradients(grads)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@pytest.mark.parametrize("how", ["check", "env"])
def test_reference_check_catches_a_missing_average_and_passes_a_right_step(mesh_of, regression, monkeypatch, how):
    params, x, y = regression
    mesh = mesh_of("8x1", 8)
    if how == "env":
        monkeypatch.setenv("DPJAX_CHECK", "reference")
    check = "reference" if how == "check" else None
    step = dpjax.shard_step(average_step, mesh, batch_argnums=(1, 2), static_argnums=3, check=check)
    with pytest.raises(dpjax.UserError, match=r"^average_step: check=\"reference\": output/w \(4, 3\) differs from "
                                              r"the one-device run.*likely cause: the devices' copies differ: .*"
                                              r"dpjax.allreduce_gradients"):
        step(params, x, y, False)
    right = dpjax.shard_step(average_step, mesh, batch_argnums=(1, 2), static_argnums=3, check=check)
    right(params, x, y, True)


def per_device(x, w):
    """lm1b's normaliser, sum(loss * w) / sum(w): inside a sharded step, this device's."""
    return jnp.sum(x * w) / jnp.sum(jnp.broadcast_to(w, x.shape))


def test_per_device_normaliser_is_another_objective(mesh_of, regression, monkeypatch):
    """Each device divides by its own sum of weights: the averaged gradients descend another
    objective than one device's (whose weighted_mean is the same formula); the global
    weighted_mean equals one device's (test_static_argnums_and_keywords_as_jax_jit)."""
    params, x, y = regression
    want = jax.jit(sgd_step, static_argnums=3)(params, x, y, jnp.tanh, lr=0.1)
    monkeypatch.setattr(dpjax, "weighted_mean", per_device)
    step = dpjax.shard_step(sgd_step, mesh_of("8x1", 8), batch_argnums=(1, 2), static_argnums=3,
                            out_specs=(P(), "mean", P()))
    got = step(params, x, y, jnp.tanh, lr=0.1)
    assert float(np.max(np.abs(got[0]["w"] - want[0]["w"]))) > 1e-3
    assert abs(float(got[1]) - float(want[1])) > 1e-3  # the mean of the devices' means
    with pytest.raises(dpjax.UserError) as e:  # and check="reference" names it
        dpjax.shard_step(average_step, mesh_of("8x1", 8), batch_argnums=(1, 2), static_argnums=3,
                         check="reference")(params, x, y, True)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith('average_step: check="reference": output/w (4, 3) differs from the '
                                               'one-device run')
    assert "likely cause: the devices agree" in msg and "dpjax.weighted_mean" in msg


@pytest.mark.slow  # ~3 s of CPU: two NNX compiles
def test_reference_check_passes_an_nnx_step_and_leaves_one_update(mesh_of, regression):
    """NNX objects: the one-device run updates them first; they are put back before the sharded
    run, which alone updates them (one SGD step, as plain nnx.jit's)."""
    from flax import nnx

    params, x, y = regression

    def nnx_step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: dpjax.weighted_mean((m(x) - y[:, :3]) ** 2, y[:, 3:]))(model)
        optimizer.update(model, grads)

    def make(tx):
        model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    plain, opt = make(optax.sgd(0.1))
    nnx.jit(nnx_step)(plain, opt, x, y)
    model, optimizer = make(dpjax.DistributedOptimizer(optax.sgd(0.1)))
    dpjax.shard_step(nnx_step, mesh_of("8x1", 8), batch_argnums=(2, 3), check="reference")(model, optimizer, x, y)
    np.testing.assert_allclose(model.kernel[...], plain.kernel[...], rtol=1e-6, atol=1e-7)
    assert int(optimizer.step[...]) == 1


@pytest.fixture(scope="module")
def lm1b_mesh():
    """lm1b's axis names, 4 data x 2 tensor."""
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 1, 2), ("data", "fsdp", "tensor"))


def test_copies_differing_along_an_axis_the_optimizer_left_out_name_it(regression):
    """lm1b's default data/fsdp/tensor mesh under shard_step: `fsdp` splits the batch too, and
    DistributedOptimizer averages over 'data' alone; the error names fsdp and the axis_name."""
    params, x, y = regression
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4, 1), ("data", "fsdp", "tensor"))
    tx = dpjax.DistributedOptimizer(optax.sgd(0.1))

    def step(params, opt, x):
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    with pytest.raises(dpjax.UserError) as e:
        dpjax.shard_step(step, mesh, batch_argnums=2)(params, tx.init(params), x)
    assert "\n" not in str(e.value) and str(e.value).endswith(
        "its copies agree along 'data' and differ along 'fsdp', which splits the batch too (every axis but 'model', "
        "'stage' and 'context' does): it was averaged over 'data' alone (DistributedOptimizer's default axis_name); "
        "average it inside the step (jax.lax.pmean(x, 'fsdp')), or give the optimizer every data axis: "
        "dpjax.DistributedOptimizer(tx, axis_name=('data', 'fsdp'))")


def _constrained_step(constrain, mesh, dense=False):
    def step(w, x):
        h = nn.Dense(6).apply({"params": {"kernel": w, "bias": jnp.zeros(6)}}, x) if dense else x @ w
        h = constrain(h, NamedSharding(mesh, P("data", "tensor")))  # flax's guide's form, lm1b's names
        return w * 0.5, dpjax.global_sum(jnp.sum(h ** 2))
    return step


def test_a_named_sharding_constraint_bound_early_is_one_line_naming_it(lm1b_mesh, dense=False):
    """`tensor` splits the state (read as the model axis); a constraint called as
    jax.lax.with_sharding_constraint with a NamedSharding of the user's mesh is read inside the
    step; one imported before the trace is JAX's own, refused in one line naming where and the fix
    (not a parameter, not model_axes="explicit")."""
    from jax.lax import with_sharding_constraint

    w = np.arange(24, dtype=np.float32).reshape(4, 6) / 10
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    shardings = dict(in_shardings=(NamedSharding(lm1b_mesh, P(None, "tensor")), NamedSharding(lm1b_mesh, P("data"))),
                     out_shardings=(NamedSharding(lm1b_mesh, P(None, "tensor")), None))
    want = jax.jit(_constrained_step(lambda h, s: h, lm1b_mesh, dense))(w, x)
    with jax.set_mesh(lm1b_mesh):  # the user's mesh in context, as lm1b's loop may have it
        got = dpjax.jit(_constrained_step(lambda h, s: jax.lax.with_sharding_constraint(h, s), lm1b_mesh, dense),
                        **shardings)(w, x)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
        assert got[0].sharding.spec == P(None, "tensor") and got[0].sharding.mesh == lm1b_mesh  # the user's names
        with pytest.raises(dpjax.UserError) as e:
            dpjax.jit(_constrained_step(with_sharding_constraint, lm1b_mesh, dense), **shardings)(w, x)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("step: ") and "call it as jax.lax.with_sharding_constraint" in msg
    assert "bias" not in msg and "model_axes" not in msg  # no parameter blamed, no layout advised
    assert msg.endswith("or write None for the data axes (P(None, 'model') for P('data', 'model'))")


def test_a_helper_returning_batch_sums_is_made_global_where_it_is_defined(mesh_of):
    """`dpjax.global_sum` given a function (lm1b's port names its two sum helpers so): inside the
    step the helper returns the global batch's sums, outside it the helper's own; its name kept."""
    @dpjax.global_sum
    def sums(x, w):
        return jnp.sum(x * w), jnp.sum(w)

    x = np.arange(16, dtype=np.float32)
    w = (np.arange(16) % 3 == 0).astype(np.float32)  # the devices' counts differ (2, 1, 1, 1, 2, ...)
    mesh = mesh_of("8x1", 8)
    got = dpjax.jit(lambda x, w: sums(x, w), in_shardings=(NamedSharding(mesh, P("data")),) * 2)(x, w)
    assert [float(v) for v in got] == [float(np.sum(x * w)), float(np.sum(w))] and sums.__name__ == "sums"
    assert [float(v) for v in sums(x[:2], w[:2])] == [0.0, 1.0]  # outside a step: the plain sums
