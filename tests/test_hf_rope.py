"""Llamas with scaled rotary positions (linear, dynamic, yarn, llama3) against transformers,
and config.json as both transformers lines write it.

tests/fixtures/llama_rope/<type> was made by tests/fixtures/make_llama_rope_fixtures.py:
a tiny random LlamaForCausalLM per rope type saved by transformers 5 (config.json in 5.x's
`rope_parameters` layout) with transformers' greedy continuations of three prompts and
their last-position log-probs; config.4x.json is the same model saved by transformers
4.57 (top-level `rope_theta` / `rope_scaling`), whose outputs the script found equal.
"""

import json
import os

import jax
import numpy as np
import pytest

from dpjax.hf.config import NEUTRAL, config_from_hub, config_to_hub, known_keys
from dpjax.hf.files import HFError
from dpjax.hf.load import load_params, model_from_hf
from dpjax.sharding import make_layout

ROOT = os.path.join(os.path.dirname(__file__), "fixtures")
KINDS = ("default", "linear", "dynamic", "llama3", "yarn")


def folder(kind):
    return os.path.join(ROOT, "llama_rope", kind)


def configs():
    """(name, config.json) of every Llama fixture: both layouts of each rope type, and
    llama_tiny's (saved by transformers 4.57 with a null rope_scaling)."""
    out = [("llama_tiny", os.path.join(ROOT, "llama_tiny", "config.json"))]
    out += [(f"{k}/{f}", os.path.join(folder(k), f)) for k in KINDS for f in ("config.json", "config.4x.json")]
    return [(name, json.load(open(path))) for name, path in out]


def test_every_config_key_is_read_or_listed_as_not_changing_the_numbers():
    """Each key of each fixture's config.json is one the reader reads or checks, or one on
    NEUTRAL (documented in docs/hf.md); a key not known is refused."""
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "hf.md")).read()
    assert [k for k in NEUTRAL if f"`{k}`" not in docs] == []
    for name, hub in configs():
        assert sorted(set(hub) - known_keys()) == [], name
        config_from_hub(hub, name)
    hub = configs()[1][1]
    with pytest.raises(HFError, match=r"key\(s\) quantization_config not known"):
        config_from_hub({**hub, "quantization_config": {"bits": 4}}, "x")


def test_both_layouts_read_as_one_config():
    """transformers 5's rope_parameters and 4.57's rope_theta + rope_scaling give the same
    dpjax config for each rope type."""
    for kind in KINDS:
        new, old = (json.load(open(os.path.join(folder(kind), f))) for f in ("config.json", "config.4x.json"))
        assert "rope_parameters" in new and "rope_scaling" in old and "rope_theta" in old
        fields = config_from_hub(new, kind)
        assert fields == config_from_hub(old, kind)
        assert (fields["rope_scaling"] and fields["rope_scaling"].type) == (None if kind == "default" else kind)
        assert fields["rope_theta"] == (500000.0 if kind == "llama3" else 10000.0)


def test_export_writes_the_layout_it_read_and_nothing_else():
    """An unchanged config.json comes back as it was (either layout); a changed one is
    written in its source's layout alone (no rope_scaling beside rope_parameters), and
    without a source in 5.x's; each reads back as the config written."""
    import dataclasses

    from dpjax.models import get_model

    older = json.load(open(os.path.join(folder("linear"), "config.4x.json")))
    older["rope_scaling"] = {"type": "linear", "factor": 2.0}  # as transformers before 4.45 wrote it
    cases = [(kind, f, json.load(open(os.path.join(folder(kind), f)))) for kind in KINDS
             for f in ("config.json", "config.4x.json")] + [("linear", "config.4x.json", older)]
    for kind, f, hub in cases:
        config = get_model("llama", seq_len=64, **config_from_hub(hub, kind)).config
        assert config_to_hub(config, "float32", hub) == hub, (kind, f)
        record = json.loads(json.dumps(get_model("llama", seq_len=64, **config_from_hub(hub, kind)).describe()))
        assert get_model(record.pop("model"), **record).config == config  # as export rebuilds it
        changed = dataclasses.replace(config, rope_theta=20000.0)
        for base, layout in ((hub, "old" if f == "config.4x.json" else "new"), (None, "new")):
            out = config_to_hub(changed, "float32", base)
            if layout == "new":
                assert "rope_scaling" not in out and "rope_theta" not in out and "rope_parameters" in out
            else:
                assert "rope_parameters" not in out and out["rope_theta"] == 20000.0
            got = config_from_hub(out, kind)
            assert (got["rope_theta"], got["rope_scaling"]) == (20000.0, config.rope_scaling), (kind, f, base)


FAST = ("llama3", "yarn")  # Llama 3.1's and the one that scales sin/cos; the others in the slow set (a compile each)


@pytest.mark.parametrize("kind", [k if k in FAST else pytest.param(k, marks=pytest.mark.slow) for k in KINDS])
def test_greedy_and_log_probs_match_transformers(kind):
    """The three prompts' greedy continuations equal transformers' generate(do_sample=False)
    and their last-position log-probs are within 1e-4. Greedy decoding is the full forward
    of the padded batch at each step (causal: the padding never reaches a real position).
    llama3: every continuation runs past the original context (8 positions). dynamic: the third prompt (40 tokens, past
    max_position_embeddings 24) is one forward at its own length, with log-probs only."""
    want, path = json.load(open(os.path.join(folder(kind), "expected.json"))), folder(kind)
    prompts, n_new = want["prompts"], want["new_tokens"]
    eos = json.load(open(os.path.join(path, "config.json")))["eos_token_id"]
    rows = [i for i, g in enumerate(want["greedy"]) if g is not None]
    T = max(len(prompts[i]) for i in rows) + n_new
    model, _ = model_from_hf(path, seq_len=T)
    params = load_params(path, model, make_layout(model, _one_device()))
    logprobs = jax.jit(lambda p, x: jax.nn.log_softmax(model.apply(p, x), -1))
    tokens = np.zeros((len(rows), T), np.int32)
    for r, i in enumerate(rows):
        tokens[r, :len(prompts[i])] = prompts[i]
    first = np.asarray(logprobs(params, tokens))
    for r, i in enumerate(rows):
        np.testing.assert_allclose(first[r, len(prompts[i]) - 1], want["logprobs"][i], rtol=0, atol=1e-4)
    got = {i: [] for i in rows}
    for step in range(n_new):
        out = first if step == 0 else np.asarray(logprobs(params, tokens))
        for r, i in enumerate(rows):
            t = len(prompts[i]) + step
            if got[i] and got[i][-1] == eos:
                continue
            tokens[r, t] = int(np.argmax(out[r, t - 1]))
            got[i].append(int(tokens[r, t]))
    assert [got[i] for i in rows] == [want["greedy"][i] for i in rows]
    if kind == "llama3":
        assert all(len(p) + n_new > model.config.rope_scaling.original_max_position_embeddings for p in prompts)
    if kind == "dynamic":  # one forward of exactly the long prompt's length: its seq_len sets the scale
        long = prompts[2]
        assert len(long) > json.load(open(os.path.join(path, "config.json")))["max_position_embeddings"]
        model, _ = model_from_hf(path, seq_len=len(long))
        params = load_params(path, model, make_layout(model, _one_device()))
        got = jax.nn.log_softmax(model.apply(params, np.asarray([long], np.int32))[0, -1])
        np.testing.assert_allclose(got, want["logprobs"][2], rtol=0, atol=1e-4)


def _one_device():
    from dpjax import make_mesh

    return make_mesh("1x1", jax.devices()[:1])


@pytest.mark.slow  # an orbax save and restore; the fast set has the config's way through a record below
def test_import_export_round_trip_keeps_tensors_and_config(tmp_path):
    """python -m dpjax.hf import, then export, of the Llama 3.1-style fixture (transformers
    5's layout): every tensor comes back with the same bytes and config.json equals the
    one saved (the rope scaling through the checkpoint's record), with no rope_scaling or
    rope_theta beside rope_parameters."""
    from safetensors.numpy import load_file

    from dpjax.hf.__main__ import main

    path, ckpt, out = folder("llama3"), str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert main(["import", path, "--out", ckpt]) == 0
    assert main(["export", ckpt, "--out", out]) == 0
    want, got = (load_file(os.path.join(d, "model.safetensors")) for d in (path, out))
    assert set(got) == set(want) and all(got[k].tobytes() == want[k].tobytes() for k in want)
    hub, back = (json.load(open(os.path.join(d, "config.json"))) for d in (path, out))
    assert {k: v for k, v in back.items() if k != "transformers_version"} == \
        {k: v for k, v in hub.items() if k != "transformers_version"}


@pytest.mark.parametrize("change, named", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'longrope'"),
    ({"attention_bias": True}, "attention_bias True"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "needs low_freq_factor"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "beta_fast": 8}},
     "has no beta_fast"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "disagree"),
    ({"rope_theta": 20000.0}, "rope_theta 20000.0 and rope_parameters' 10000.0 disagree"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor 0.25"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope linear without 'factor'"),
])
def test_what_changes_the_numbers_and_is_not_computed_is_refused(change, named):
    hub = json.load(open(os.path.join(folder("linear"), "config.json")))
    with pytest.raises(HFError, match=named) as e:
        config_from_hub({**hub, **change}, "DIR")
    assert "\n" not in str(e.value) and str(e.value).startswith("DIR: ")


def test_flags_beside_init_from_are_accepted_when_they_agree():
    """--model llama, the checkpoint's own options and vocabulary beside --init-from hf:
    plan; one that disagrees is one line naming it and the checkpoint's value."""
    from dpjax.plan import UsageError
    from dpjax.plan.checks import check, model_choice
    from dpjax.settings import Settings

    source = "hf:" + folder("llama3")
    for given in ({"model": "llama"}, {"model": "llama", "model_options": {"n_kv_heads": 1, "d_model": 32}},
                  {"vocab_size": 64, "model_options": {"rope_theta": 500000.0}}):
        s = Settings(init_from=source, data="synthetic", seq_len=16, **given)
        check(s)
        name, fields = model_choice(s)
        assert name == "llama" and fields["rope_scaling"]["type"] == "llama3" and fields["d_model"] == 32
    for given, named in (({"model": "mlp"}, "--model mlp (it holds llama)"),
                         ({"model_options": {"d_model": 64}}, "--d-model 64 (it holds 32)"),
                         ({"vocab_size": 128}, "--vocab-size 128 (it holds 64)"),
                         ({"preset": "llama3-1b"}, "--preset llama3-1b (its ")):
        s = Settings(init_from=source, data="synthetic", seq_len=16, **given)
        with pytest.raises(UsageError, match=r"disagrees with .*" + named.replace("(", r"\(").replace(")", r"\)")):
            check(s)
            model_choice(s)
