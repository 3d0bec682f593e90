"""dpjax's Qwen2 and Qwen3 against HuggingFace transformers' own, and the Hub format both ways.

tests/fixtures/qwen_tiny/<family> was made by tests/fixtures/make_qwen_fixtures.py: a tiny
random Qwen2ForCausalLM (q/k/v biases drawn at random, untied head) and Qwen3ForCausalLM
(per-head q/k norms drawn at random, head_dim 12 beside hidden_size / heads = 8, tied
head) saved by transformers 5, with transformers' greedy continuations of three prompts
and their last-position log-probs; config.4x.json is the same model saved by transformers
4.57, whose outputs the script found equal. The suite needs no transformers.
"""

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

from dpjax.errors import UserError
from dpjax.hf import verify
from dpjax.hf.config import config_from_hub, known_keys
from dpjax.hf.family import FAMILIES
from dpjax.hf.files import HFError
from dpjax.hf.load import load_params, model_from_hf
from dpjax.sharding import make_layout

ROOT = os.path.join(os.path.dirname(__file__), "fixtures", "qwen_tiny")
FAMILIES_HERE = ("qwen2", "qwen3")


def folder(family):
    return os.path.join(ROOT, family)


def hub_config(family, name="config.json"):
    return json.load(open(os.path.join(folder(family), name)))


@pytest.mark.parametrize("family", FAMILIES_HERE)
def test_both_layouts_read_as_one_config_with_every_key_accounted_for(family):
    new, old = hub_config(family), hub_config(family, "config.4x.json")
    assert "rope_parameters" in new and "rope_theta" in old and "rope_parameters" not in old
    for hub in (new, old):
        assert sorted(set(hub) - known_keys(FAMILIES[family])) == []
    fields = config_from_hub(new, family)
    assert fields == config_from_hub(old, family) and fields["rope_theta"] == 1e6
    model, _ = model_from_hf(folder(family))
    assert model.name == family and (model.config.head_width, model.head_dim) == ((12, 12) if family == "qwen3"
                                                                                   else (8, 8))


@pytest.mark.parametrize("family", FAMILIES_HERE)
def test_greedy_and_log_probs_match_transformers(family):
    """The three prompts' greedy continuations equal transformers' generate(do_sample=False)
    and their last-position log-probs are within 1e-4."""
    want = json.load(open(os.path.join(folder(family), "expected.json")))
    got = verify.dpjax_outputs(folder(family), want["prompts"], want["new_tokens"])
    assert got["greedy"] == want["greedy"]
    for ours, theirs in zip(got["logprobs"], want["logprobs"]):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES_HERE)
def test_import_then_export_gives_every_tensor_back_bit_for_bit(family):
    trip = verify.round_trip(folder(family))
    assert trip == {"tensors": trip["tensors"], "equal": trip["tensors"], "extra": [], "config_equal": True}
    assert trip["tensors"] == {"qwen2": 27, "qwen3": 24}[family]  # biases (6 a layer) / q, k norms (2), tied head


def test_sharded_load_places_each_heads_bias_and_norm_with_its_heads(mesh_of):
    """On 2x4 the query heads (and their biases) split over model; Qwen2's two K/V heads
    (and their biases) are replicated beside them; every block equals the dense load's."""
    model, _ = model_from_hf(folder("qwen2"))
    dense = jax.tree.map(np.asarray, load_params(folder("qwen2"), model, make_layout(model, mesh_of("1x1", 1))))
    params = load_params(folder("qwen2"), model, make_layout(model, mesh_of("2x4", 8)))
    attn = params["blocks"]["attn"]
    assert attn["bq_LsxHmxK"].addressable_shards[0].data.shape == (2, 1, 8)
    assert attn["bkv_Lsx2xYmxK"].addressable_shards[0].data.shape == (2, 2, 2, 8)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(dense)):
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


@pytest.mark.parametrize("family, change, named", [
    ("qwen2", {"use_sliding_window": True}, "does not compute use_sliding_window True"),
    ("qwen2", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types sliding_attention"),
    ("qwen2", {"attention_bias": False}, r"key\(s\) attention_bias not known to dpjax's Qwen2ForCausalLM"),
    ("qwen3", {"attention_bias": True}, "attention_bias True"),
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("qwen3", {"head_dim": None}, "config.json has no head_dim"),
])
def test_what_changes_the_numbers_and_is_not_computed_is_refused(family, change, named):
    with pytest.raises(HFError, match=named) as e:
        config_from_hub({**hub_config(family), **change}, "DIR")
    assert "\n" not in str(e.value) and str(e.value).startswith("DIR: ")


@pytest.mark.parametrize("family, change, named", [
    ("qwen2", {"num_key_value_heads": 4}, "layers.0.self_attn.k_proj.bias has shape (16,), config.json says (32,)"),
    ("qwen3", {"head_dim": 16}, "layers.0.self_attn.k_norm.weight has shape (12,), config.json says (16,)"),
])
def test_a_checkpoint_whose_shapes_disagree_with_its_config_is_one_line(tmp_path, family, change, named, mesh_of):
    shutil.copytree(folder(family), tmp_path / family)
    with open(tmp_path / family / "config.json", "w") as f:
        json.dump({**hub_config(family), **change}, f)
    model, _ = model_from_hf(str(tmp_path / family))
    with pytest.raises(HFError, match=named.replace("(", r"\(").replace(")", r"\)")) as e:
        load_params(str(tmp_path / family), model, make_layout(model, mesh_of("1x1", 1)))
    assert "\n" not in str(e.value)


def test_verify_without_transformers_says_so_in_one_line(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # import transformers: ImportError
    with pytest.raises(UserError, match="transformers, which is not installed here") as e:
        verify.verify(folder("qwen3"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, needle", [
    (None, "No such file"), ("{not json", "is not JSON"),
    ('{"prompts": [[1, 2]], "new_tokens": 4}', "holds no greedy, logprobs: it is not a file of saved reference"),
])
def test_an_expected_file_that_is_not_one_is_one_line(tmp_path, text, needle):
    """`verify --expected` with another fixture's expected.json (llama_tiny's has no prompts), a
    broken file or none: one line, before anything is computed."""
    path = tmp_path / "expected.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UserError, match=needle) as e:
        verify.verify(folder("qwen3"), expected=str(path))
    assert "\n" not in str(e.value)


@pytest.mark.slow  # two training runs' compiles (about 100 s each on a loaded 2-core machine)
@pytest.mark.parametrize("family", FAMILIES_HERE)
def test_five_steps_on_2x4_fall_and_equal_8x1(family):
    """The card's 5 steps (Nesterov momentum) from the checkpoint on data=2,model=4 (heads, their
    biases and norms split or replicated over model) and on data=8: finite, falling losses,
    equal within 1e-5."""
    tp, dp = (verify.train_losses(folder(family), mesh) for mesh in ("2x4", "8x1"))
    assert len(tp) == 5 and np.isfinite(tp).all() and all(b < a for a, b in zip(tp, tp[1:])), tp
    np.testing.assert_allclose(tp, dp, rtol=0, atol=1e-5)


@pytest.mark.slow  # processes: orbax save and restore, a compile
def test_processes_import_export_and_verify(tmp_path):
    """python -m dpjax.hf import, export and verify (--expected, the fixture's saved
    outputs) of Qwen3 as processes: tensors back bit for bit, and a card that says Verified."""
    import subprocess
    import sys

    from safetensors.numpy import load_file

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    run = lambda *a: subprocess.run([sys.executable, "-m", "dpjax.hf", *a], env=env, capture_output=True,  # noqa: E731
                                    text=True, timeout=600)
    path, ckpt, out = folder("qwen3"), str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert run("import", path, "--out", ckpt).returncode == 0
    assert run("export", ckpt, "--out", out).returncode == 0
    want, got = (load_file(os.path.join(d, "model.safetensors")) for d in (path, out))
    assert set(got) == set(want) and all(got[k].tobytes() == want[k].tobytes() for k in want)
    card = run("verify", path, "--expected", os.path.join(path, "expected.json"))
    assert card.returncode == 0 and "# Qwen3ForCausalLM" in card.stdout and "**Verified**" in card.stdout


# The published sizes (the Hub's model cards: Qwen3-0.6B's 0.6B with its embedding once, 0.44B without)
PRESET_PARAMS = {"llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "llama3.1-8b": 8_030_261_248,
                 "qwen2.5-7b": 7_615_616_512, "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360}


@pytest.mark.slow  # abstract inits of six shapes: about 10 s here
def test_presets_have_the_published_sizes():
    """Each preset's parameter count is the model card's: counted abstractly (nothing
    allocated) at 1 and 2 layers and extended to its depth (a count linear in the layers).
    The 3.2 names are the llama3-1b / 3b shapes, Llama 3.1 8B is Llama 3 8B's with llama3
    rope scaling."""
    import math

    from dpjax.models import get_model, presets

    def count(name, fields):
        model = get_model(name, seq_len=128, **fields)
        return sum(math.prod(x.shape) for x in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))))

    known = presets()
    for preset, published in PRESET_PARAMS.items():
        name, fields = known[preset]
        one, two = (count(name, {**fields, "n_layers": n}) for n in (1, 2))
        assert one + (two - one) * (fields["n_layers"] - 1) == published, preset
    assert known["llama3.2-1b"] == known["llama3-1b"] and known["llama3.2-3b"] == known["llama3-3b"]
    assert known["llama3.1-8b"][1]["rope_scaling"]["factor"] == 8.0
    assert known["qwen3-8b"][1]["head_dim"] == 128 and not known["qwen3-8b"][1].get("tie_embeddings")


@pytest.mark.parametrize("preset", [p if p == "qwen3-0.6b" else pytest.param(p, marks=pytest.mark.slow)
                                    for p in PRESET_PARAMS])
def test_presets_plan_with_dry_run(preset, capsys):
    """Each preset plans with --dry-run on this machine for one 141 GiB H200 a device (one
    fast, the others slow: a few seconds each), and the plan's parameter bytes are its size's."""
    from dpjax.train.cli import main

    model = 4 if preset == "qwen2.5-7b" else 8  # 28 query heads: a model axis of 4
    assert main(["--preset", preset, "--mesh", f"data=1,model={model}", "--fsdp", "--device-memory", "141GiB",
                 "--batch-size", "8", "--seq-len", "2048", "--dry-run"]) == 0
    out = capsys.readouterr().out
    planned = float(re.search(r"parameters ([0-9.]+) GiB", out).group(1))  # float32, split over model
    assert "the plan fits" in out and abs(planned / (PRESET_PARAMS[preset] * 4 / model / 2**30) - 1) < 0.01
