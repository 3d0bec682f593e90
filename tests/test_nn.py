"""dpjax.nn: tensor-parallel flax layers against their dense twins.

A transformer block built from dpjax's NNX layers (vocabulary-parallel embedding,
head-parallel attention, column/row-parallel MLP, vocabulary-parallel output and loss)
runs on a 2x4 mesh through `dpjax.shard_step`; its twin is written with flax's own
`nnx.Embed`, `nnx.Linear` and `jax.nn.dot_product_attention` on one device, with the same
weights. Loss and every gradient must agree to float32 round-off. The parallel block's
parameters are created sharded: the compiled initialiser's memory analysis shows each
device's output as its blocks only. The Linen layers are checked the same way on 1x4.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import dpjax
from dpjax.nn import linen as pln
from dpjax.nn import nnx as pnn

B, T, D, H, K, F, V = 4, 8, 16, 4, 4, 32, 32
TOL = dict(rtol=2e-5, atol=2e-6)  # float32: the sharded sums add partial products in another order


class ParallelBlock(nnx.Module):
    """Embedding, one pre-LayerNorm transformer block and the output layer, from dpjax.nn."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = pnn.VocabParallelEmbed(V, D, rngs=rngs)
        self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.attn = pnn.ParallelSelfAttention(D, H, rngs=rngs)
        self.up = pnn.ColumnParallelLinear(D, F, rngs=rngs)
        self.down = pnn.RowParallelLinear(F, D, rngs=rngs)
        self.head = pnn.ColumnParallelLinear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(self.ln1(x))
        x = x + self.down(nnx.relu(self.up(self.ln2(x))))
        return self.head(x)  # logits split over the vocabulary


class DenseBlock(nnx.Module):
    """The same block with flax's dense layers (`twin` gives it a ParallelBlock's weights)."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.q, self.k, self.v = (nnx.Linear(D, H * K, use_bias=False, rngs=rngs) for _ in range(3))
        self.o = nnx.Linear(H * K, D, use_bias=False, rngs=rngs)
        self.up, self.down = nnx.Linear(D, F, rngs=rngs), nnx.Linear(F, D, rngs=rngs)
        self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        h = self.ln1(x)
        q, k, v = (f(h).reshape(*h.shape[:2], H, K) for f in (self.q, self.k, self.v))
        x = x + self.o(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(*h.shape[:2], H * K))
        x = x + self.down(nnx.relu(self.up(self.ln2(x))))
        return self.head(x)


def to_dense(p: dict) -> dict:
    """A ParallelBlock's parameters (or gradients) as DenseBlock's."""
    qkv = np.asarray(p["attn"]["qkv"])
    d = {name: p[name] for name in ("embed", "ln1", "ln2", "up", "down", "head")}
    d.update({name: {"kernel": qkv[:, i].reshape(D, H * K)} for i, name in enumerate("qkv")})
    d["o"] = {"kernel": np.asarray(p["attn"]["out"]).reshape(H * K, D)}
    return jax.tree.map(np.asarray, d)


def twin(p: ParallelBlock):
    """(graph, state) of a DenseBlock holding p's weights."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: DenseBlock(nnx.Rngs(0))))
    nnx.replace_by_pure_dict(abstract, to_dense(nnx.to_pure_dict(nnx.state(p))))
    return graphdef, abstract


def dense_loss(model, tokens, targets):
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets).mean()


def parallel_step(model, tokens, targets):
    def loss_fn(model):
        return pnn.cross_entropy(model(tokens), targets)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    return jax.lax.pmean(loss, "data"), dpjax.allreduce_gradients(grads)


@pytest.fixture(scope="module")
def block(mesh_of):
    mesh = mesh_of("2x4", 8)
    compiled = create_compiled(mesh)  # born sharded: each device creates only its blocks
    graphdef, state = compiled()
    return mesh, nnx.merge(graphdef, state), compiled


def test_parallel_block_equals_its_dense_twin(block):
    mesh, model, _ = block
    rng = np.random.default_rng(0)
    tokens, targets = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    specs = nnx.get_partition_spec(nnx.state(model))
    step = dpjax.shard_step(parallel_step, mesh, batch_argnums=(1, 2), out_specs=(P(), specs))
    loss, grads = step(model, tokens, targets)
    assert grads["head"]["kernel"].get_value().sharding.spec == P(None, "model")

    graphdef, weights = twin(model)
    want_loss, want = jax.jit(jax.value_and_grad(lambda w: dense_loss(nnx.merge(graphdef, w), tokens, targets)))(
        weights)
    np.testing.assert_allclose(loss, want_loss, **TOL)
    got, want = to_dense(nnx.to_pure_dict(grads)), jax.tree.map(np.asarray, nnx.to_pure_dict(want))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, **TOL, err_msg=jax.tree_util.keystr(path))


def create_compiled(mesh):
    with jax.set_mesh(mesh):  # flax shards each annotated Variable as it is created
        return jax.jit(lambda: nnx.split(ParallelBlock(nnx.Rngs(0)))).lower().compile()


def test_parallel_block_is_born_sharded(block, mesh_of):
    """Each device's output from the initialiser is its blocks of the split weights plus
    the small replicated ones, its temporaries a fraction of what creating the whole
    block takes on one device, and the values those of the one-device block."""
    mesh, model, compiled = block
    state = nnx.state(model)
    specs = jax.tree.leaves(nnx.get_partition_spec(state), is_leaf=lambda x: isinstance(x, P))
    arrays = jax.tree.leaves(state)
    parts = [math.prod(mesh.shape[a] for e in spec if e for a in (e if isinstance(e, tuple) else (e,)))
             for spec in specs]
    assert sorted(set(parts)) == [1, 4]  # LayerNorms and the row-parallel bias whole; the rest a quarter
    for x, n in zip(arrays, parts):
        local = x.sharding.shard_shape(x.shape)
        assert math.prod(local) * n == x.size and all(s.data.shape == local for s in x.addressable_shards)
    mem = compiled.memory_analysis()
    blocks = sum(x.nbytes // n for x, n in zip(arrays, parts))
    # (plus, on CPU, the output tuple's table: one pointer per array)
    assert blocks <= mem.output_size_in_bytes <= blocks + 8 * len(arrays) < sum(x.nbytes for x in arrays)
    one = create_compiled(mesh_of("1x1", 1))
    assert mem.temp_size_in_bytes < one.memory_analysis().temp_size_in_bytes / 2
    for x, y in zip(arrays, jax.tree.leaves(one()[1])):
        np.testing.assert_array_equal(x, y)


class LinenMLP(nn.Module):
    """Embedding, column- and row-parallel dense layers, tied vocabulary-parallel logits."""

    @nn.compact
    def __call__(self, tokens):
        embed = pln.VocabParallelEmbed(V, D)
        x = embed(tokens)
        x = x + pln.RowParallelDense(D)(nn.relu(pln.ColumnParallelDense(F)(x)))
        x = x + pln.ParallelSelfAttention(H)(x)
        return embed.attend(x)


def test_linen_layers_equal_the_dense_computation(mesh_of):
    """On 1x4 the Linen layers take each device's blocks (the shapes Linen checks are the
    local ones) and give the loss and gradients of the same model on one device."""
    mesh = mesh_of("1x4", 4)
    rng = np.random.default_rng(1)
    tokens, targets = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    model = LinenMLP()
    variables = jax.jit(model.init)(jax.random.key(0), tokens)
    specs = nn.get_partition_spec(variables)
    params = nn.unbox(variables)

    def loss(params, tokens, targets):
        return pln.cross_entropy(model.apply(params, tokens), targets)

    def step(params, tokens, targets):
        return jax.value_and_grad(loss)(params, tokens, targets)

    got = dpjax.shard_step(step, mesh, batch_argnums=(1, 2), in_specs=(specs,), out_specs=(P(), specs))(
        params, tokens, targets)
    want = jax.jit(lambda p: jax.value_and_grad(
        lambda p: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, tokens), targets).mean())(p))(params)
    assert got[1]["params"]["ColumnParallelDense_0"]["kernel"].sharding.spec == P(None, "model")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, **TOL)


class Swappable(nnx.Module):
    """flax's layers, or dpjax.nn's in their place (`parallel`); `after` is created last,
    from the same rngs, so it starts where it did only if the swapped layers drew the keys
    flax's did. A bias initialiser that draws (normal) shows the bias's key too."""

    def __init__(self, rngs: nnx.Rngs, parallel: bool, use_bias: bool = True):
        bias = dict(use_bias=use_bias, bias_init=nnx.initializers.normal(1.0))
        self.embed = (pnn.VocabParallelEmbed if parallel else nnx.Embed)(V, D, rngs=rngs)
        self.up = (pnn.ColumnParallelLinear if parallel else nnx.Linear)(D, F, **bias, rngs=rngs)
        self.down = (pnn.RowParallelLinear if parallel else nnx.Linear)(F, D, **bias, rngs=rngs)
        self.after = nnx.Linear(D, V, rngs=rngs)


@pytest.mark.parametrize("use_bias", [True, False])
def test_swapped_layers_start_where_flax_layers_start(mesh_of, use_bias):
    """dpjax.nn's layers draw their keys as nnx.Linear / nnx.Embed do (the kernel's, then the
    bias's): swapped in for them, born sharded on 2x4, every parameter, gathered, is the
    plain model's, and so is the layer created after them."""
    plain = nnx.state(Swappable(nnx.Rngs(0), parallel=False, use_bias=use_bias), nnx.Param)
    with jax.set_mesh(mesh_of("2x4", 8)):
        swapped = nnx.state(jax.jit(lambda: Swappable(nnx.Rngs(0), parallel=True, use_bias=use_bias))(), nnx.Param)
    assert swapped["up"]["kernel"][...].sharding.spec == P(None, "model")
    got, want = nnx.to_pure_dict(swapped), nnx.to_pure_dict(plain)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert ("bias" in got["down"]) == use_bias
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))


class LinenSwappable(nn.Module):
    parallel: bool

    @nn.compact
    def __call__(self, x):
        bias = dict(bias_init=nn.initializers.normal(1.0))
        if self.parallel:  # named as the layers they replace: Linen derives a parameter's key from its path
            h = pln.ColumnParallelDense(F, name="Dense_0", **bias)(x)
            h = pln.RowParallelDense(D, name="Dense_1", **bias)(h)
        else:
            h = nn.Dense(F, **bias)(x)
            h = nn.Dense(D, **bias)(h)
        return nn.Dense(V, name="Dense_2")(h)


def test_linen_layers_named_as_flaxs_start_where_they_start():
    x = jnp.ones((B, D))
    want = LinenSwappable(False).init(jax.random.key(0), x)
    got = nn.unbox(LinenSwappable(True).init(jax.random.key(0), x))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))
