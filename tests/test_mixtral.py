"""dpjax's mixtures of experts from the Hub against HuggingFace's own implementation.

tests/fixtures/{mixtral,qwen3_moe}_tiny were made by tests/fixtures/make_moe_fixtures.py
with transformers 5.24's MixtralForCausalLM and Qwen3MoeForCausalLM (2 layers, 8 SwiGLU
experts, top 2, random norms; Qwen3-MoE's gates not renormalised, its head_dim 16 = 2 x
hidden / heads) and hold transformers' greedy generate(do_sample=False) continuations of
3 prompts and their last-position log-probs: the suite needs neither transformers nor
torch. config.4x.json is the same model saved by transformers 4.57, whose outputs the
script found equal. dpjax's mixture is dropless here (`--moe dropless`, the families' default), as
transformers' is.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.hf.load import load_params, model_from_hf
from dpjax.sharding import make_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = {family: os.path.join(ROOT, "tests", "fixtures", f"{family}_tiny") for family in ("mixtral", "qwen3_moe")}
SEQ = 32  # the longest prompt (20) and 10 new tokens fit


def expected(family):
    return json.load(open(os.path.join(FIXTURES[family], "expected.json")))


@pytest.fixture(scope="module", params=list(FIXTURES))
def imported(request):
    """(family, model, its parameters on one device, apply jitted): imported once a module."""
    from dpjax import make_mesh

    model, _ = model_from_hf(FIXTURES[request.param], seq_len=SEQ)
    params = load_params(FIXTURES[request.param], model, make_layout(model, make_mesh("1x1", jax.devices()[:1])))
    return request.param, model, params, jax.jit(model.apply)


def _padded(prompts):
    tokens = np.zeros((len(prompts), SEQ), np.int32)  # causal: what follows a position never changes it
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    return tokens


def test_last_position_log_probs_match_transformers(imported):
    family, _, params, apply = imported
    want = expected(family)
    logits = np.asarray(apply(params, jnp.asarray(_padded(want["prompts"]))))
    for i, p in enumerate(want["prompts"]):
        got = np.asarray(jax.nn.log_softmax(logits[i, len(p) - 1]))
        np.testing.assert_allclose(got, want["logprobs"][i], rtol=0, atol=1e-4, err_msg=f"prompt {i}")


def test_greedy_continuations_match_transformers(imported):
    """The 3 prompts decoded together by the full forward at each step (the program of the
    log-prob test), each stopping at EOS as transformers does."""
    family, model, params, apply = imported
    want = expected(family)
    eos = json.load(open(os.path.join(FIXTURES[family], "config.json")))["eos_token_id"]
    tokens, got = _padded(want["prompts"]), [[] for _ in want["prompts"]]
    for _ in range(want["new_tokens"]):
        logits = np.asarray(apply(params, jnp.asarray(tokens)))
        for i, p in enumerate(want["prompts"]):
            if got[i] and got[i][-1] == eos:
                continue
            at = len(p) + len(got[i])
            got[i].append(int(np.argmax(logits[i, at - 1])))
            tokens[i, at] = got[i][-1]
    assert got == want["greedy"]


def test_import_then_export_gives_every_tensor_back_bit_for_bit(imported, tmp_path):
    from safetensors.numpy import load_file

    from dpjax.hf import export

    family, model, params, _ = imported
    hub = json.load(open(os.path.join(FIXTURES[family], "config.json")))
    export(params, model, str(tmp_path), base_config=hub)
    want = load_file(os.path.join(FIXTURES[family], "model.safetensors"))
    got = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
    written = json.load(open(tmp_path / "config.json"))
    # every key as imported, a null head_dim (Mixtral) too
    assert {k: written[k] for k in hub if k != "dtype"} == {k: v for k, v in hub.items() if k != "dtype"}


@pytest.mark.parametrize("family", list(FIXTURES))
def test_config_both_layouts_read_as_one_and_write_back(family):
    """transformers 5's config.json and 4.57's (config.4x.json: top-level rope_theta, and
    Qwen3-MoE's experts as num_experts, not num_local_experts) give one dpjax config, every
    key known; each is written back as it was (the 4.x names kept), and a changed expert
    count in its own layout; both names at once, disagreeing, is one line."""
    import dataclasses

    from dpjax.hf.config import config_from_hub, known_keys
    from dpjax.hf.family import of_hub
    from dpjax.hf.files import HFError
    from dpjax.hf.identity import hub_config
    from dpjax.models import get_model

    new, old = (json.load(open(os.path.join(FIXTURES[family], f))) for f in ("config.json", "config.4x.json"))
    for hub in (new, old):
        assert sorted(set(hub) - known_keys(of_hub(hub, "x"))) == []
    fields = config_from_hub(new, "new")
    assert fields == config_from_hub(old, "old") and fields["experts"] == 8
    model = get_model(family, seq_len=64, **fields)
    changed = type(model)(dataclasses.replace(model.config, experts=4))
    for hub in (new, old):  # what an export writes
        assert hub_config(model, "float32", hub) == hub
        out = hub_config(changed, "float32", hub)
        assert set(out) == set(hub) and config_from_hub(out, "out")["experts"] == 4
    if family == "qwen3_moe":
        with pytest.raises(HFError, match="num_local_experts 8 beside num_experts 4") as e:
            config_from_hub({**new, "num_experts": 4}, "DIR")
        assert "\n" not in str(e.value)


def tokens(path) -> str:
    """A token file the tiny models can learn: ids 2 .. 63 in a repeating order (uint16)."""
    np.tile(np.arange(2, 64, dtype=np.uint16), 64).tofile(path)
    return str(path)


def _train(mesh: str, metrics: str, family: str, data: str, *extra) -> list[float]:
    cmd = [sys.executable, "-m", "dpjax.train", "--init-from", f"hf:{FIXTURES[family]}", "--mesh", mesh,
           "--data", data, "--vocab-size", "64",
           "--steps", "5", "--batch-size", "8", "--seq-len", "16", "--eval-every", "0",
           "--progress", "none", "--optimizer", "momentum", "--lr", "0.1", "--metrics", metrics, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT,
                       timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(metrics)]
    return [row["loss"] for row in rows if "loss" in row and "step" in row]


@pytest.mark.slow  # two training runs in processes (~2 min under load)
@pytest.mark.parametrize("family", list(FIXTURES))
def test_five_steps_on_data2_expert4_equal_8x1(family, tmp_path):
    """5 steps of Nesterov momentum (as the cards train: AdamW's lr g / (|g| + eps) turns
    round-off in a gradient near eps into ~1e-5) from the imported checkpoint on
    data=2,expert=4 (2 experts a device, tokens dispatched by the dropless all-to-alls) and
    on 8x1 (every expert everywhere): finite, falling losses, equal within 1e-5."""
    data = tokens(tmp_path / "tokens.bin")
    split = _train("data=2,expert=4", str(tmp_path / "ep.jsonl"), family, data)
    whole = _train("8x1", str(tmp_path / "dp.jsonl"), family, data)
    assert len(split) == len(whole) == 5 and all(np.isfinite(split))
    assert split[-1] < split[0]
    np.testing.assert_allclose(split, whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("preset,flags,params", [
    ("mixtral-8x7b", ["--mesh", "expert=8", "--fsdp", "--device-memory", "192GiB"], "21.75 GiB"),
    ("qwen3-30b-a3b", ["--mesh", "expert=8", "--fsdp", "--device-memory", "141GiB"], "14.22 GiB")])
def test_presets_plan_with_dry_run(capsys, preset, flags, params):
    """The published shapes plan on 8 devices with the experts split over `expert` (E/8 a
    device) and the rest FSDP: the parameters a device holds are its experts and an
    eighth of the rest (Mixtral-8x7B: 45.1e9 expert + 1.6e9 other float32 values / 8)."""
    from dpjax.train.cli import main

    assert main(["--preset", preset, *flags, "--batch-size", "8", "--seq-len", "4096", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "the plan fits" in out and f"parameters {params}" in out and "dropless" in out
