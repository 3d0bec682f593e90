"""LoRA against PEFT's own code (`tests/fixtures/make_lora_fixture.py`: a random adapter, B
not zero, on tests/fixtures/llama_tiny, and PEFT's logits with it and merged), the PEFT
files dpjax writes, the merged export, bad input and the planner's LoRA memory.
The sharded steps and the command lines are tests/test_lora_step.py (slow)."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from dpjax.errors import UserError
from dpjax.hf import adapter as peft_files
from dpjax.hf.load import model_from_hf
from dpjax.hf.source import params_of
from dpjax.mesh import make_mesh
from dpjax.models import get_model
from dpjax.models.lora import Lora, LoraConfig, Split
from dpjax.sharding import make_layout

HERE = os.path.join(os.path.dirname(__file__), "fixtures")
BASE, ADAPTER = os.path.join(HERE, "llama_tiny"), os.path.join(HERE, "lora_tiny")
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def loaded():
    """(LoRA model, its parameters: llama_tiny + PEFT's adapter, expected.json)."""
    base, _ = model_from_hf(BASE, seq_len=8)
    model = Lora(base, peft_files.read_config(ADAPTER).lora)
    layout = make_layout(model, make_mesh("1x1", jax.devices()[:1]))
    params = params_of("hf:" + BASE, model, layout, adapter=ADAPTER)
    with open(os.path.join(ADAPTER, "expected.json")) as f:
        return model, params, json.load(f)


def test_logits_equal_peft(loaded):
    model, params, expected = loaded
    logits = jax.jit(model.apply)(params, np.asarray(expected["sequences"], np.int32))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected["logits"]), **TOL)
    base = jax.jit(model.base.apply)(Split(model.LAYERS).frozen(params), np.asarray(expected["sequences"], np.int32))
    assert np.abs(np.asarray(base) - np.asarray(expected["logits"])).max() > 1e-2  # the adapter matters


def test_exported_adapter_is_peft_s(loaded, tmp_path):
    from safetensors.numpy import load_file  # the independent reader

    model, params, _ = loaded
    files = peft_files.export(params, model, str(tmp_path), base="llama_tiny")
    assert sorted(files) == sorted(os.listdir(tmp_path))
    ours, theirs = load_file(str(tmp_path / peft_files.WEIGHTS)), load_file(os.path.join(ADAPTER, peft_files.WEIGHTS))
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and ours[name].shape == value.shape, name
        np.testing.assert_array_equal(ours[name], value)  # a transpose and a reshape each way: exact
    config = json.loads((tmp_path / peft_files.CONFIG).read_text())
    peft = json.loads(open(os.path.join(ADAPTER, peft_files.CONFIG)).read())
    for key in ("r", "lora_alpha", "peft_type", "task_type", "base_model_name_or_path", "bias", "use_dora"):
        assert config[key] == peft[key], key
    assert sorted(config["target_modules"]) == sorted(peft["target_modules"])


def test_merged_is_base_plus_scaled_BA(loaded, tmp_path):
    from safetensors.numpy import load_file

    from dpjax.hf.writer import export

    model, params, expected = loaded
    merged = jax.jit(model.merge)(params)
    logits = jax.jit(model.base.apply)(merged, np.asarray(expected["sequences"], np.int32))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected["merged_logits"]), **TOL)  # merge_and_unload
    export(merged, model.base, str(tmp_path))
    ours, base = load_file(str(tmp_path / "model.safetensors")), load_file(os.path.join(BASE, "model.safetensors"))
    lora = load_file(os.path.join(ADAPTER, peft_files.WEIGHTS))
    scale = model.lora.alpha / model.lora.r
    for name, w in base.items():  # numpy from the files: W + alpha/r B A on every adapted layer
        module = name.removesuffix(".weight")
        a = lora.get(f"base_model.model.{module}.lora_A.weight")
        want = w if a is None else w + scale * lora[f"base_model.model.{module}.lora_B.weight"] @ a
        np.testing.assert_allclose(ours[name], want, rtol=1e-6, atol=1e-6, err_msg=name)
    assert sum(f"base_model.model.{n.removesuffix('.weight')}.lora_A.weight" in lora for n in base) == 14


@pytest.mark.parametrize("flag,says", [
    ("r=4,targets=q,foo", "targets foo name no layer"),
    ("r=4,targets=", "name no layer"),
    ("r=40", "r=40 is larger than layer"),
    ("r=4,dropout=1", "dropout must be at least 0 and below 1, got 1.0"),
    ("r=4,dropout=-0.1", "dropout must be at least 0 and below 1, got -0.1"),
    ("r=4,rank=2", "'rank' is not a LoRA setting"),
])
def test_bad_lora_flags_one_line(flag, says):
    base = get_model("llama", vocab_size=64, seq_len=8, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64)
    with pytest.raises(UserError, match=says) as e:
        Lora(base, LoraConfig.parse(flag))
    assert "\n" not in str(e.value)


def test_parse_takes_peft_names():
    assert LoraConfig.parse("r=8,alpha=16,targets=q_proj,v_proj") == LoraConfig(8, 16.0, 0.0, ("q", "v"))
    assert LoraConfig.parse("targets=all-linear").targets == ("q", "k", "v", "o", "gate", "up", "down")


def test_adapter_for_another_base_is_refused(loaded):
    model, _, _ = loaded
    other = Lora(get_model("llama", **{**model.config.__dict__, "d_ff": 48}), model.lora)
    with pytest.raises(UserError, match="an adapter for another base model"):
        peft_files.adapters_of(ADAPTER, other)
    with pytest.raises(UserError, match="was made for llama_tiny, not hf:/x/other-model"):
        peft_files.adapters_of(ADAPTER, model, "hf:/x/other-model")
    with pytest.raises(UserError, match="--lora asks r=8"):
        peft_files.adapters_of(ADAPTER, Lora(model.base, LoraConfig(8, 8.0, 0.0, model.lora.targets)))


def test_dry_run_plans_adapters_state_only():
    """llama3-8b at r=16 on 8 devices with FSDP: the optimizer state is under 1% of the full
    fine-tune's (the planner's estimate; nothing compiled)."""
    from dpjax.plan import resolve
    from dpjax.settings import Settings

    kw = dict(preset="llama3-8b", mesh="data=8", fsdp=True, batch_size=8, seq_len=2048, dry_run=True,
              device_memory="80GiB")
    full = resolve(Settings(**kw), jax.devices()).memory
    lora = resolve(Settings(**kw, lora="r=16,alpha=32,targets=q,k,v,o,gate,up,down"), jax.devices()).memory
    assert lora["state"] < 0.01 * full["state"] and lora["grads"] < 0.01 * full["grads"]
    # the adapters: r (in + out) a matrix, 32 layers of q, k, v, o, gate, up, down
    per_layer = 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3)
    assert lora["state"] == 2 * 4 * 32 * per_layer // 8
    # the frozen base in the compute dtype, bfloat16 on the GPU planned for: half the float32 master weights
    assert lora["params"] == full["params"] // 2 + 4 * 32 * per_layer // 8


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    import shutil

    from dpjax.train import main

    out, other = tmp_path / "out", tmp_path / "other-model"
    out.mkdir()
    shutil.copytree(BASE, other)  # the same weights under another name: not the adapter's base by its config
    writes = ["--data", "synthetic", "--seq-len", "16", "--steps", "2", "--metrics", str(out / "m.jsonl"),
              "--ckpt-dir", str(out / "ckpt")]
    for args, says in [
        (["--init-from", f"hf:{BASE}", "--lora", "r=4,targets=q,lm_head"], "targets lm_head name no layer"),
        (["--init-from", f"hf:{BASE}", "--lora", "r=64"], "r=64 is larger than layer q (32 x 32)"),
        (["--init-from", f"hf:{other}", "--adapter", ADAPTER], "was made for llama_tiny, not hf:"),
        (["--model", "gpt", "--lora", "r=4"], "--model gpt has none of them"),
    ]:
        assert main([*args, *writes]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and len(err.splitlines()) == 1 and says in err, err
        assert os.listdir(out) == []
