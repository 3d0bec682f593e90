"""Gemma 2 and Gemma 3 (text) (`models/gemma.py`) against transformers' own
Gemma2ForCausalLM / Gemma3ForCausalLM, and sharded against themselves.

tests/fixtures/gemma{2,3}_tiny were made by tests/fixtures/make_mistral_gemma_fixtures.py:
tiny random models saved by transformers 5 (local windows of 4 positions, shorter than
every prompt; Gemma 2 soft-capped at 2 and 3; Gemma 3's global layers on another rotary
base, linearly scaled, and 2 local layers to a global one over 4 layers) with greedy
continuations of three prompts and last-position log-probs; config.4x.json is the same
model saved by transformers 4.57, whose outputs the script found equal.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_mistral import cached_matches_transformers, folder, matches_transformers, round_trip, train_losses

from dpjax.hf.config import config_from_hub, config_to_hub, known_keys
from dpjax.hf.family import of_hub
from dpjax.models import get_model

NAMES = ("gemma2", "gemma3")


@pytest.mark.parametrize("name", NAMES)
def test_greedy_and_log_probs_match_transformers(name):
    matches_transformers(name, window=4, sliding_window=64)


@pytest.mark.slow  # a prefill's compile for each of 3 prompt lengths and a step's, a family
@pytest.mark.parametrize("name", NAMES)
def test_greedy_through_the_kv_cache_matches_transformers(name):
    """Local layers' windows of 4 in the cache's mask, global layers' full, over prompts of 6 to 20."""
    cached_matches_transformers(name)


@pytest.mark.parametrize("name", NAMES)
def test_config_both_layouts_read_as_one_and_write_back(name):
    """transformers 5's config.json (Gemma 3: rope_parameters per layer kind) and 4.57's
    (rope_local_base_freq) give one config; each is written back as it was, and a changed
    rotary base in its own layout, reading back as the change."""
    import dataclasses

    new, old = (json.load(open(os.path.join(folder(name), f))) for f in ("config.json", "config.4x.json"))
    for hub in (new, old):
        assert sorted(set(hub) - known_keys(of_hub(hub, "x"))) == []
    fields = config_from_hub(new, "new")
    assert fields == config_from_hub(old, "old")
    config = get_model(name, seq_len=64, **fields).config
    assert config.local_layers().tolist() == [t == "sliding_attention" for t in new["layer_types"]]
    if name == "gemma3":
        assert (config.rope_theta, config.rope_local_theta, config.rope_scaling.type) == (1e6, 1e4, "linear")
        assert config.qk_norm and (config.attn_softcap, config.final_softcap) == (0, 0)
    else:
        assert not config.qk_norm and (config.attn_softcap, config.final_softcap) == (2.0, 3.0)
    for hub in (new, old):
        assert config_to_hub(config, "float32", hub) == hub
        changed = dataclasses.replace(config, rope_local_theta=20000.0, rope_theta=30000.0) if name == "gemma3" \
            else dataclasses.replace(config, rope_theta=30000.0, rope_local_theta=30000.0)
        out = config_to_hub(changed, "float32", hub)
        assert ("rope_local_base_freq" in out) == ("rope_local_base_freq" in hub)
        assert get_model(name, seq_len=64, **config_from_hub(out, "out")).config == changed
    scratch = config_to_hub(config, "float32")  # from scratch: 5.x's layout
    assert get_model(name, seq_len=64, **config_from_hub(scratch, "scratch")).config == config


@pytest.mark.parametrize("change, named", [
    ({"layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]},
     "does not compute layer_types"),
    ({"tie_word_embeddings": False}, "untied embeddings"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope scaling on the local"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_what_is_not_computed_is_refused_in_one_line(change, named):
    hub = json.load(open(os.path.join(folder("gemma3"), "config.json")))
    from dpjax.hf.files import HFError

    with pytest.raises(HFError, match=named) as e:
        config_from_hub({**hub, **change}, "DIR")
    assert "\n" not in str(e.value) and str(e.value).startswith("DIR: ")


@pytest.mark.slow  # three compiles; the fast set's Gemma 3 fixture (local, local, global, local) needs the index too
def test_layer_index_reaches_each_layer_in_a_scan():
    """The stack runner hands each layer its global index (the static table of local and
    global layers is read at it): a model whose layers are all made global differs from
    the mix, and the scanned forward equals the unrolled one (scan off)."""
    import dataclasses

    from dpjax.compute.policy import Policy
    from dpjax.compute.tensor_parallel import Parallel

    model = get_model("gemma3", seq_len=16, d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=16,
                      d_ff=32, vocab_size=64, sliding_window=3, sliding_window_pattern=3)
    params = model.init(jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)
    scanned = jax.jit(model.apply)(params, tokens)
    unrolled = jax.jit(lambda p, t: model.apply(p, t, Parallel(policy=Policy(scan=False))))(params, tokens)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-5)
    every_global = type(model)(dataclasses.replace(model.config, sliding_window_pattern=1))
    assert np.abs(np.asarray(jax.jit(every_global.apply)(params, tokens) - scanned)).max() > 1e-3


@pytest.mark.slow  # a 2x4 layout's placement and an export, each family (~10 s)
@pytest.mark.parametrize("name", NAMES)
def test_import_export_gives_every_tensor_back(name, tmp_path):
    round_trip(name, tmp_path)


@pytest.mark.slow  # two train-step compiles a family
@pytest.mark.parametrize("name", NAMES)
def test_five_steps_on_2x4_equal_8x1(name):
    a, b = train_losses(name, "2x4"), train_losses(name, "8x1")
    assert all(np.isfinite(a)) and a[-1] < a[0]
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("preset", ["gemma2-2b", *(pytest.param(p, marks=pytest.mark.slow) for p in (
    "gemma3-1b", "gemma3-4b", "mistral-7b"))])  # a dry run each (~3 s of CPU): Gemma 2 in the fast set
def test_presets_plan_with_dry_run(preset, capsys):
    """The published shapes plan with --dry-run on any machine (gemma3-1b has 4 query heads:
    a model axis of 4)."""
    from dpjax.train.cli import main

    assert main(["--preset", preset, "--mesh", "data=2,model=4", "--fsdp", "--device-memory", "80GiB",
                 "--batch-size", "8", "--seq-len", "2048", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "the plan fits" in out
    if preset == "gemma2-2b":  # soft-capped scores: XLA's kernel (its naive form), never cuDNN's, and why
        assert "attention xla" in out and "cannot soft-cap the attention scores (this model caps them at 50)" in out


def test_cudnn_is_refused_for_soft_capped_scores():
    from dpjax.compute.policy import resolve

    with pytest.raises(ValueError, match="--attention cudnn: cuDNN flash attention cannot soft-cap"):
        resolve("bfloat16", attention="cudnn", platform="gpu", head_dim=256, softcap=50.0)
    assert resolve("bfloat16", platform="gpu", head_dim=256)[0].attention == "cudnn"


def test_presets_have_the_model_cards_parameter_counts():
    """Gemma 2 2B 2.61e9, Gemma 3 1B 1.00e9, Gemma 3 4B's text model 3.88e9 (its 4.3e9 less
    the vision tower), Mistral 7B v0.3 7.25e9: the shapes are the published ones."""
    from dpjax.models import presets

    for preset, billions in (("gemma2-2b", 2.61), ("gemma3-1b", 1.00), ("gemma3-4b", 3.88), ("mistral-7b", 7.25)):
        name, fields = presets()[preset]
        model = get_model(name, **fields)
        count = model.num_params(jax.eval_shape(model.init, jax.random.key(0)))
        assert abs(count / 1e9 - billions) < 0.005, (preset, count)


def small(name: str, **kw):
    """A small Gemma: 4 layers, windows of 3 positions in 16; Gemma 3's 2 local layers to
    a global one (layers 0 1 local, 2 global, 3 local: a stage of 2 layers whose index
    restarted at 0 would run layer 2 as local), Gemma 2's soft caps of 2 and 3."""
    extra = dict(sliding_window_pattern=3, rope_scaling=dict(type="linear", factor=2.0)) if name == "gemma3" else \
        dict(attn_softcap=2.0, final_softcap=3.0)
    return get_model(name, **{**dict(seq_len=16, d_model=16, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
                                     d_ff=32, vocab_size=64, sliding_window=3, **extra), **kw})


def one_sgd_step_is_the_dense_gradient(mesh_of, put, model, mesh: str, **settings):
    """One SGD step (rate 1) of `model` on `mesh`: the loss is the dense model's and the
    update minus its gradient (random, not zero, norm weights: each norm's (1 + w) matters)."""
    import optax
    from jax.sharding import PartitionSpec as P

    from dpjax import step as S
    from dpjax.mesh import data_axes
    from dpjax.plan import resolve
    from dpjax.settings import Settings

    tokens = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)
    plan = resolve(Settings(mesh=mesh, data="synthetic", batch_size=8, seq_len=16, **settings),
                   mesh=mesh_of(mesh, 8), model=model, optimizer=optax.sgd(1.0))
    step = S.for_plan(plan, donate=False)
    dense = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape), model.init(
        jax.random.key(0)))
    loss0, grad = jax.jit(jax.value_and_grad(model.loss))(dense, jnp.asarray(tokens))
    params, state = step.init(jax.device_put(plan.layout.store(dense) if plan.layout.pipeline else dense,
                                             plan.layout.shardings()))
    p1, _, loss = step.train(params, state, put(plan.mesh, tokens[None], P(None, data_axes(plan.mesh))))
    np.testing.assert_allclose(float(loss), float(loss0), rtol=2e-6)
    moved = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), jax.device_get(params), jax.device_get(p1))
    if plan.layout.pipeline:
        moved = plan.layout.unstore(moved)
    for d, g in zip(jax.tree.leaves(moved), jax.tree.leaves(grad)):
        np.testing.assert_allclose(d, np.asarray(g), rtol=2e-5, atol=2e-6)


@pytest.mark.slow  # a pipeline's compile (~15 s here)
@pytest.mark.parametrize("mesh,settings", [("stage=2,data=2,model=2", {}),
                                           ("stage=2,data=4", dict(schedule="interleaved", virtual_stages=2))])
def test_pipelined_gemma3_equals_dense(mesh_of, put, mesh, settings):
    """Its stages run layers 0-1 and 2-3 (1F1B), or chunks {0}, {2} and {1}, {3}
    (interleaved): each layer gets its own kind from its index in the whole model."""
    one_sgd_step_is_the_dense_gradient(mesh_of, put, small("gemma3"), mesh, **settings)


@pytest.mark.slow  # a context step's compile each
@pytest.mark.parametrize("mesh,attention", [("data=2,context=4", "ring"), ("data=2,context=2,model=2", "allgather")])
def test_gemma2_with_a_context_axis_equals_dense(mesh_of, put, mesh, attention):
    """Windows and soft caps in the ring's and the all-gather's blocks (and TP, FSDP beside)."""
    one_sgd_step_is_the_dense_gradient(mesh_of, put, small("gemma2"), mesh, context_attention=attention,
                                       fsdp=mesh.endswith("model=2"))
