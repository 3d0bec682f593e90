"""flax's lm1b example (examples/lm1b_*.py: its Linen model with lm1b's logical annotations,
its train.py cut to synthetic data) distributed with `dpjax.jit`: its ('data', 'fsdp', 'tensor')
mesh and logical rules, `jax.jit`'s arguments unchanged, dropout on. Data-parallel on 8x1,
data + tensor on 4x2 (the `tensor` axis read from the shardings as the model axis) and on
lm1b's default mesh (`fsdp` = every device) each train as one device does, dropout masks
included (`dpjax.wrap.draws`: each device its rows of the global batch's mask).
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_flax_examples import changed_lines, load

import dpjax
from dpjax.wrap import draws

STEPS = 20
RTOL = 1e-5


def run(name, sizes=None, steps=STEPS, **config):
    mod = load(name)
    if sizes is not None:  # lm1b's config lines for the mesh's sizes (data, fsdp, tensor)
        mod.config.ici_data_parallelism, mod.config.ici_fsdp_parallelism, mod.config.ici_tensor_parallelism = sizes
    for k, v in config.items():
        setattr(mod.config, k, v)
    return mod.train(steps)


def params(state):
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x)
            for path, x in jax.tree_util.tree_flatten_with_path(state.params)[0]}


def assert_same(got, want):
    (state, history), (ref_state, ref_history) = got, want
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose([h[key] for h in history], [h[key] for h in ref_history], rtol=RTOL,
                                   err_msg=key)
    mine, ref = params(state), params(ref_state)
    assert mine.keys() == ref.keys()
    for name in ref:  # relative to the parameter's largest value: AdamW's steps are lr-sized everywhere
        np.testing.assert_allclose(mine[name], ref[name], rtol=0, atol=RTOL * np.abs(ref[name]).max(), err_msg=name)


def test_the_port_changes_four_lines():
    """The import, lm1b's two sum helpers (cross-entropy and accuracy) made the global batch's in
    one line, the optimizer wrapped, jax.jit -> dpjax.jit with the same arguments; beside them the
    config line of the mesh's size."""
    lines = changed_lines("lm1b_plain", "lm1b_distributed")
    sizes = [line for line in lines if line.startswith("+config.ici_")]
    assert len(sizes) == 1, lines
    rest = [line for line in lines if line not in sizes]
    assert len(rest) == 4 and all("dpjax" in line for line in rest), rest
    assert any("dpjax.jit(train_step, in_shardings=(state_mesh_annotations, data_sharding, None), "
               "out_shardings=(state_mesh_annotations, None), static_argnums=(2, 3, 4), donate_argnums=0)" in line
               for line in rest)


@pytest.mark.parametrize("spec, p, typed", [("8x1", 0.9, False),
                                            pytest.param("4x2", 0.3, True, marks=pytest.mark.slow)])
def test_dropout_masks_are_the_global_batchs_rows(mesh_of, spec, p, typed):
    """Inside dpjax.jit, jax.random.bernoulli of the local rows is the one-device draw's rows,
    bit for bit, for raw and typed keys; outside it, JAX's own."""
    def step(x, key):
        return jax.random.bernoulli(jax.random.fold_in(key, 1), p, x.shape), jax.random.bernoulli(key, p, (3,))

    x = np.zeros((16, 5, 3), np.float32)
    mesh = mesh_of(spec, 8)
    for key in [jax.random.key(4) if typed else jax.random.PRNGKey(3)]:
        want = jax.jit(step)(x, key)
        got = dpjax.jit(step, in_shardings=(jax.sharding.NamedSharding(mesh, P("data")), None),
                        out_shardings=(jax.sharding.NamedSharding(mesh, P("data")), None), check=False)(x, key)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        assert jax.random.bernoulli is draws._PATCH.original  # JAX's own again after the trace


@pytest.fixture(scope="module")
def one_device():
    return run("lm1b_plain")


@pytest.mark.slow
def test_data_parallel_on_8x1_equals_one_device_with_dropout(one_device):
    assert_same(run("lm1b_distributed"), one_device)


@pytest.mark.slow
def test_data_and_tensor_on_4x2_split_as_annotated_equals_one_device(one_device):
    got = run("lm1b_distributed", (4, 1, 2))
    assert_same(got, one_device)
    block = got[0].params["decoder"]["encoderdecoderblock_0"]
    kernel = block["MlpBlock_0"]["Dense_0"]["kernel"]  # ('embed', 'mlp'): mlp -> tensor, read as the model axis
    assert kernel.sharding.spec == P(None, "tensor") and kernel.addressable_shards[0].data.shape == (32, 32)
    embedding = got[0].params["decoder"]["Embed_0"]["embedding"]  # ('vocab', 'embed'): vocab -> tensor
    assert embedding.sharding.spec == P("tensor") and embedding.addressable_shards[0].data.shape == (32, 32)
    assert block["SelfAttention_0"]["query"]["kernel"].sharding.spec == P()  # ('embed', 'kv'): no rule for kv


@pytest.mark.slow
def test_lm1b_default_mesh_fsdp_over_every_device_equals_one_device(one_device):
    """lm1b's default: data 1, fsdp -1 (every device), tensor 1. `fsdp` splits the state and no
    batch, so it is laid out as jax.jit lays it out (GSPMD), each parameter split as annotated."""
    got = run("lm1b_distributed", (1, -1, 1))
    assert_same(got, one_device)
    kernel = got[0].params["decoder"]["encoderdecoderblock_0"]["MlpBlock_0"]["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P("fsdp") and kernel.addressable_shards[0].data.shape == (4, 64)  # embed -> fsdp
