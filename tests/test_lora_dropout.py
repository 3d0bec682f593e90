"""LoRA's dropout (`dpjax.models.lora`, `dpjax.compute.dropout`): the factored term against
numpy with the same mask, masks that do not depend on the device (a block's bits are the
whole's), the same losses on 8x1, 2x4 and FSDP as the dense loss with the documented draw,
the gradient changed and evaluation not, and dropout=0 on the merged path it always took."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax import step as S
from dpjax.compute import dropout
from dpjax.compute.tensor_parallel import DENSE
from dpjax.models.base import ADAPTED
from dpjax.models.lora import ADAPTERS, BY_NAME, TARGETS, Lora, Terms
from dpjax.sharding import make_layout
from test_lora_step import MOMENTUM, SPLIT, TOL, batch, lora_llama

RATE = 0.1


def with_dropout(model, rate=RATE):
    return Lora(model.base, dataclasses.replace(model.lora, dropout=rate))


@pytest.fixture(scope="module")
def tiny():
    """(the LoRA model with dropout 0.1, its parameters with B not zero)."""
    model = with_dropout(lora_llama(2))
    rng = np.random.default_rng(0)  # numpy's draws: test_lora_step's `start` costs seconds of compiling

    def leaf(path, x):
        if "scale" in str(path[-1]):
            return jnp.ones(x.shape, x.dtype)
        return jnp.asarray(rng.normal(0, 0.05 if "_B_" in str(path[-1]) else 0.1, x.shape), x.dtype)
    return model, jax.tree_util.tree_map_with_path(leaf, jax.eval_shape(model.init, jax.random.key(0)))


def draw(rows, step=0, rate=RATE):
    return dropout.Draw(rate, dropout.step_key(0, jnp.uint32(step)), jnp.asarray(rows, jnp.uint32))


@pytest.mark.extended  # 2.6 s of CPU; the quick numpy test and the extended mesh test read the same bits
def test_a_devices_block_draws_the_wholes_bits():
    """The bits of any block of (rows, positions, features) are the whole array's block: no
    device, split or shape enters; keep rate within 1% of 0.9; every id moves the mask."""
    d = draw(np.arange(6))
    whole = np.asarray(d.keep(jnp.arange(16), jnp.arange(64), 64))
    part = dropout.Draw(RATE, d.key, jnp.asarray([3, 4], jnp.uint32)).keep(jnp.arange(8, 12), jnp.arange(16, 48), 64)
    np.testing.assert_array_equal(np.asarray(part), whole[3:5, 8:12, 16:48])
    assert abs(whole.mean() - (1 - RATE)) < 0.01
    for other in (d.at(1), d.at(0, 1), draw(np.arange(6), step=1), draw(np.arange(1, 7))):
        assert (np.asarray(other.keep(jnp.arange(16), jnp.arange(64), 64)) != whole).mean() > 0.1


@pytest.mark.parametrize("name", ["q", "k", "v", "o", "gate", "up", "down"])
def test_factored_term_equals_numpy(tiny, name):
    """Each projection with its LoRA term (`Terms`) gives x W + (alpha / r) ((keep * x / (1 - p)) A) B,
    numpy's, with the mask of (layer 1, the target): the base path undropped."""
    model, params = tiny
    t, L = BY_NAME[name], 1
    blk = jax.tree.map(lambda v: v[L], params["blocks"])
    i, o = model.dims(t)
    x = np.random.default_rng(1).normal(size=(3, 8, *i)).astype(np.float32)
    adapters = {u.name: model.factors(u, blk[ADAPTERS]) for u in model.targets}
    d = draw([5, 6, 7])
    par = dataclasses.replace(DENSE, dropout=d.at(L))
    group = {**blk[t.group], ADAPTED: Terms(model, adapters, par)}
    f = model.base  # the Llama's own projections, each adding its term (`dpjax.models.base.adapted`)
    got = {"q": lambda: f.queries(group, x, par), "k": lambda: f.keys_values(group, x, par)[:, 0],
           "v": lambda: f.keys_values(group, x, par)[:, 1], "o": lambda: f.attn_out(group, x, par),
           "gate": lambda: f.mlp_in(group, t.leaf, x, par), "up": lambda: f.mlp_in(group, t.leaf, x, par),
           "down": lambda: f.mlp_out(group, x, par)}[name]()
    n = int(np.prod(i))
    keep = np.asarray(d.at(L, TARGETS.index(t)).keep(jnp.arange(8), jnp.arange(n), n)).reshape(x.shape)
    w = np.asarray(blk[t.group][t.leaf])
    w = w if t.part is None else w[:, t.part]
    a, b = np.asarray(blk[ADAPTERS][f"{name}_A_{t.a}"]), np.asarray(blk[ADAPTERS][f"{name}_B_{t.b}"])
    xd = np.where(keep, x / np.float32(1 - RATE), 0)
    want = np.tensordot(x, w, t.n_in) + model.lora.scale * np.tensordot(np.tensordot(xd, a, t.n_in), b, 1)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert 0 < (~keep).mean() < 0.2
    dropped_base = np.tensordot(xd, w, t.n_in) + model.lora.scale * np.tensordot(np.tensordot(xd, a, t.n_in), b, 1)
    assert np.abs(dropped_base - want).max() > 1e-3  # the test tells the base path's input from the adapters'


@pytest.mark.extended  # two gradients compiled: 15 s of CPU
def test_dropout_moves_the_gradient_not_evaluation(tiny):
    """The first step's gradient of the adapters with dropout 0.1 is not dropout 0's; the
    forward without a draw (evaluation, generation) is dropout 0's, bit for bit."""
    model, params = tiny
    plain, tokens = Lora(model.base, dataclasses.replace(model.lora, dropout=0.0)), batch()
    par = dataclasses.replace(DENSE, dropout=draw(np.arange(8)))

    def grad(m, par):
        return jax.jit(jax.grad(lambda t: m.loss(SPLIT.join(t, SPLIT.frozen(params)), tokens, par)))(
            SPLIT.trained(params))

    ours, theirs = grad(model, par), grad(plain, DENSE)
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(ours),
                                                                            jax.tree.leaves(theirs))]
    assert min(moved) > 1e-6, moved
    np.testing.assert_array_equal(np.asarray(jax.jit(model.loss)(params, tokens)),
                                  np.asarray(jax.jit(plain.loss)(params, tokens)))


def test_dropout_zero_is_the_merged_program(tiny):
    """dropout=0 keeps the merged path: no draw in the step's state, no Threefry in its program."""
    from dpjax.mesh import make_mesh

    plain = Lora(tiny[0].base, dataclasses.replace(tiny[0].lora, dropout=0.0))
    assert plain.dropout_rate == 0 and not plain.INDEXED_LAYERS
    layout = make_layout(plain, make_mesh("8x1", jax.devices()[:8]))
    step = S.for_model(plain, layout, global_batch=8, opt=MOMENTUM, donate=False)
    params, state = jax.eval_shape(step.init, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                           tiny[1]))
    assert not (isinstance(state, dict) and "draws" in state)
    text = step.train.lower(params, state, jax.ShapeDtypeStruct((1, 8, 9), jnp.int32)).as_text()
    assert "threefry" not in text.lower()


@pytest.mark.extended
def test_losses_equal_on_every_mesh_and_the_dense_draw(tiny, mesh_of):
    """Three steps of dropout 0.1 give the same losses on 8x1, 2x4 and 2x4 FSDP; the first is
    the dense loss with the step-0 key and rows 0..7; the step counter is in the state."""
    model, before = tiny
    got = {}
    for spec, fsdp in [("8x1", False), ("2x4", False), ("2x4", True)]:
        mesh = mesh_of(spec, 8)
        layout = make_layout(model, mesh, fsdp=fsdp)
        step = S.for_model(model, layout, global_batch=8, opt=MOMENTUM, donate=False)
        params, state = step.init(jax.device_put(before, layout.shardings()))
        rng, losses = np.random.default_rng(0), []
        for _ in range(3):
            b = jax.device_put(rng.integers(0, 64, (1, 8, 9)).astype(np.int32), NamedSharding(mesh, P(None, "data")))
            params, state, loss = step.train(params, state, b)
            losses.append(float(loss))
        assert int(state["draws"]) == 3
        got[(spec, fsdp)] = losses
    first = np.random.default_rng(0).integers(0, 64, (1, 8, 9)).astype(np.int32)[0]
    dense = model.loss(before, first, dataclasses.replace(DENSE, dropout=draw(np.arange(8))))
    np.testing.assert_allclose(got[("8x1", False)][0], float(dense), **TOL)
    assert abs(float(dense) - float(model.loss(before, first))) > 1e-5  # the draw mattered
    for losses in got.values():
        np.testing.assert_allclose(losses, got[("8x1", False)], **TOL)


def test_peft_export_and_load_keep_the_rate(tiny, tmp_path):
    """The exported adapter's lora_dropout is the run's, and reading it back keeps it (as the
    flag --adapter trains with)."""
    import json

    from dpjax.hf import adapter as peft_files

    model, params = tiny
    peft_files.export(params, model, str(tmp_path), base="llama_tiny")
    assert json.loads((tmp_path / peft_files.CONFIG).read_text())["lora_dropout"] == RATE
    config = peft_files.read_config(str(tmp_path))
    assert config.lora.dropout == RATE and "dropout=0.1" in config.as_flag()


def test_a_stage_axis_with_dropout_is_refused_in_one_line(tmp_path, capsys):
    from dpjax.train import main
    from test_lora_step import tiny as flags

    args = flags("--mesh", "stage=2,data=4", "--steps", "1", "--metrics", str(tmp_path / "m.jsonl"))
    args[args.index("--lora") + 1] = "r=4,dropout=0.1"
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "dropout=0.1 with a stage axis is not built" in err
    assert not (tmp_path / "m.jsonl").exists()
