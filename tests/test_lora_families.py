"""LoRA on the families beyond the Llama against PEFT's own code
(`tests/fixtures/make_lora_families_fixture.py`: a random adapter, B not zero, on the tiny
Qwen2, Gemma2, Mistral and Mixtral fixtures, and PEFT's logits with it and merged): loading,
the PEFT files dpjax writes, the merged export; dropout's factored path on each family's
own layer code; the refusals (a mixture's experts, another base's adapter)."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from dpjax.compute import dropout
from dpjax.compute.tensor_parallel import DENSE
from dpjax.errors import UserError
from dpjax.hf import adapter as peft_files
from dpjax.hf.load import model_from_hf
from dpjax.hf.source import params_of
from dpjax.mesh import make_mesh
from dpjax.models import get_model
from dpjax.models.lora import Lora, LoraConfig, Split
from dpjax.sharding import make_layout

HERE = os.path.join(os.path.dirname(__file__), "fixtures")
ADAPTERS = os.path.join(HERE, "lora_families")
BASES = {"qwen2": "qwen_tiny/qwen2", "gemma2": "gemma2_tiny", "mistral": "mistral_tiny", "mixtral": "mixtral_tiny"}
LLAMA_ADAPTER = os.path.join(HERE, "lora_tiny")
TOL = dict(rtol=1e-4, atol=1e-4)
QUICK = ("gemma2",)  # the quick tier's: a layer code of its own (2.5 s of CPU); the others extended
FAMILIES = [f if f in QUICK else pytest.param(f, marks=pytest.mark.extended) for f in BASES]


def base_dir(family: str) -> str:
    return os.path.join(HERE, BASES[family])


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request):
    """(family, LoRA model, its parameters: the tiny base + PEFT's adapter, expected.json)."""
    family = request.param
    folder, source = os.path.join(ADAPTERS, family), "hf:" + base_dir(family)
    base, _ = model_from_hf(base_dir(family), seq_len=8)
    model = Lora(base, peft_files.read_config(folder, source).lora)
    params = params_of(source, model, make_layout(model, make_mesh("1x1", jax.devices()[:1])), adapter=folder)
    with open(os.path.join(folder, "expected.json")) as f:
        return family, model, params, json.load(f)


def test_logits_equal_peft(loaded):
    _, model, params, expected = loaded
    tokens = np.asarray(expected["sequences"], np.int32)
    logits = jax.jit(model.apply)(params, tokens)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected["logits"]), **TOL)
    base = jax.jit(model.base.apply)(Split(model.LAYERS).frozen(params), tokens)
    assert np.abs(np.asarray(base) - np.asarray(expected["logits"])).max() > 1e-2  # the adapter matters


def test_exported_adapter_is_peft_s(loaded, tmp_path):
    from safetensors.numpy import load_file  # the independent reader

    family, model, params, _ = loaded
    peft_files.export(params, model, str(tmp_path), base=os.path.basename(BASES[family]))
    ours = load_file(str(tmp_path / peft_files.WEIGHTS))
    theirs = load_file(os.path.join(ADAPTERS, family, peft_files.WEIGHTS))
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and ours[name].shape == value.shape, name
        np.testing.assert_array_equal(ours[name], value)  # a transpose and a reshape each way: exact
    config = json.loads((tmp_path / peft_files.CONFIG).read_text())
    peft = json.loads(open(os.path.join(ADAPTERS, family, peft_files.CONFIG)).read())
    for key in ("r", "lora_alpha", "base_model_name_or_path", "bias"):
        assert config[key] == peft[key], key
    assert sorted(config["target_modules"]) == sorted(peft["target_modules"])


@pytest.mark.extended  # the merged model compiled again and exported
def test_merged_is_base_plus_scaled_BA(loaded, tmp_path):
    from safetensors.numpy import load_file

    from dpjax.hf.writer import export

    family, model, params, expected = loaded
    merged = jax.jit(model.merge)(params)
    logits = jax.jit(model.base.apply)(merged, np.asarray(expected["sequences"], np.int32))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected["merged_logits"]), **TOL)  # merge_and_unload
    export(merged, model.base, str(tmp_path))
    ours = load_file(str(tmp_path / "model.safetensors"))
    base = load_file(os.path.join(base_dir(family), "model.safetensors"))
    lora = load_file(os.path.join(ADAPTERS, family, peft_files.WEIGHTS))
    scale, adapted = model.lora.alpha / model.lora.r, 0
    for name, w in base.items():  # numpy from the files: W + alpha/r B A on every adapted layer, the rest (biases) W
        module = name.removesuffix(".weight")
        a = lora.get(f"base_model.model.{module}.lora_A.weight")
        adapted += a is not None
        want = w if a is None else w + scale * lora[f"base_model.model.{module}.lora_B.weight"] @ a
        np.testing.assert_allclose(ours[name], want, rtol=1e-6, atol=1e-6, err_msg=name)
    assert adapted == len(lora) // 2


def random_lora(family: str, **shape):
    """A tiny `family` LoRA model with dropout and parameters drawn by numpy, B not zero."""
    model = Lora(get_model(family, vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           d_ff=48, **shape), LoraConfig(4, 8.0, 0.1))
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    return model, jax.tree.map(lambda x: rng.normal(0, 0.2, x.shape).astype(x.dtype), shapes)


@pytest.mark.parametrize("family,shape", [
    pytest.param("qwen3", dict(head_dim=8), marks=pytest.mark.extended),  # the term goes before the q/k norms
    pytest.param("gemma3", dict(head_dim=8, sliding_window=4), marks=pytest.mark.extended),
    pytest.param("qwen2", {}, marks=pytest.mark.extended),
])
def test_factored_path_keeping_everything_is_the_merged_layer(family, shape):
    """With dropout > 0 each family's own layer adds the LoRA term to each projection's product
    (`dpjax.models.base.adapted`); a draw that keeps every value then gives the merged
    model's logits, so the term enters where W does (before Qwen2's biases, the q/k norms)."""
    model, params = random_lora(family, **shape)
    tokens = np.random.default_rng(1).integers(0, 64, (2, 8)).astype(np.int32)
    keep_all = dropout.Draw(0.0, dropout.step_key(0, np.uint32(0)), np.arange(2, dtype=np.uint32))
    factored = jax.jit(lambda p: model.apply(p, tokens, dataclasses.replace(DENSE, dropout=keep_all)))(params)
    merged = jax.jit(lambda p: model.base.apply(model.merge(p), tokens))(params)
    np.testing.assert_allclose(np.asarray(factored), np.asarray(merged), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(merged) - np.asarray(model.base.apply(Split(model.LAYERS).frozen(params), tokens))
                  ).max() > 1e-2  # the adapters matter


def tiny_mixtral():
    return get_model("mixtral", vocab_size=64, seq_len=8, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                     d_ff=24, experts=4, top_k=2)


@pytest.mark.parametrize("flag,says", [
    ("r=4", "--lora targets gate, up, down: --model mixtral's blocks hold no such linear layer (a mixture's "
            "experts get no adapters here); LoRA adapts its q, k, v, o: give targets=q,k,v,o"),
    ("r=4,targets=q,down_proj", "--lora targets down: --model mixtral's"),
    ("r=4,dropout=0.1,targets=q,v", "--lora dropout=0.1 on --model mixtral is not built"),
])
def test_mixtral_refusals_say_what_works(flag, says):
    with pytest.raises(UserError, match=says.replace("(", r"\(").replace(")", r"\)")) as e:
        Lora(tiny_mixtral(), LoraConfig.parse(flag))
    assert "\n" not in str(e.value)
    assert Lora(tiny_mixtral(), LoraConfig.parse("r=4,targets=q,k,v,o")).targets  # what it says works


def test_another_bases_adapter_names_both():
    """A Llama's adapter on Qwen2: refused naming both bases, by name (before any layer is
    adapted); Qwen2's on a Gemma2 named by no source: by the shapes, naming both."""
    source = "hf:" + base_dir("qwen2")
    with pytest.raises(UserError, match=f"--adapter {LLAMA_ADAPTER} was made for llama_tiny, not {source}"):
        peft_files.read_config(LLAMA_ADAPTER, source)
    qwen2 = os.path.join(ADAPTERS, "qwen2")
    gemma = Lora(get_model("gemma2", vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=16, d_ff=48), peft_files.read_config(qwen2).lora)
    with pytest.raises(UserError, match=r"\(made for qwen2\): base_model.model.model.layers.0.self_attn.q_proj.lora_B."
                                        r"weight has shape \[32, 4\], --model gemma2 needs \[64, 4\]: an adapter for "
                                        "another base model"):
        peft_files.adapters_of(qwen2, gemma)  # no source: the names are not compared, the shapes are


@pytest.mark.parametrize("tool", ["train", "generate"])
def test_llama_adapter_on_qwen2_is_one_line(tool, tmp_path, capsys):
    from dpjax.generate.__main__ import main as generate
    from dpjax.train import main as train

    args = ["--init-from", "hf:" + base_dir("qwen2"), "--adapter", LLAMA_ADAPTER]
    if tool == "train":
        code = train([*args, "--data", "synthetic", "--seq-len", "8", "--steps", "1", "--ckpt-dir",
                      str(tmp_path / "ckpt")])
    else:
        code = generate([*args, "--prompt-ids", "1,2,3", "--max-new-tokens", "2"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "was made for llama_tiny, not hf:" in err and "qwen2" in err, err


def test_lora_reads_as_its_base():
    """What the plan, the kernels and the KV cache read of a model is its base's: Gemma's head
    width and soft cap, Mistral's window (the cache's ring), Mixtral's experts."""
    kw = dict(vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
    for base in (get_model("gemma2", **kw, head_dim=16, attn_softcap=50.0),
                 get_model("mistral", **kw, sliding_window=4), tiny_mixtral()):
        model = Lora(base, LoraConfig(4, 8.0, 0.0, ("q", "v")))
        def read(m):
            return m.head_dim, m.cache_window, m.experts, m.attention_softcap, m.has_stats
        assert read(model) == read(base), base.name
    assert (base.experts, Lora(get_model("gemma2", **kw, head_dim=16), LoraConfig(4, 8.0)).head_dim) == (4, 16)


@pytest.mark.extended  # two forwards of a mixture compiled
def test_mixtral_loss_keeps_the_routers_balance_loss():
    """LoRA on Mixtral's attention: the loss and the router's statistics are the base's on the
    merged weights, the balance loss included."""
    base = tiny_mixtral()
    model = Lora(base, LoraConfig(4, 8.0, 0.0, ("q", "k", "v", "o")))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(0, 0.2, x.shape).astype(x.dtype),
                          jax.eval_shape(model.init, jax.random.key(0)))
    batch = rng.integers(0, 64, (2, 9)).astype(np.int32)
    loss, stats = jax.jit(model.loss_and_stats)(params, batch)
    want, want_stats = jax.jit(base.loss_and_stats)(model.merge(params), batch)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    assert stats.keys() == want_stats.keys() and stats
    for name in stats:
        np.testing.assert_allclose(float(stats[name]), float(want_stats[name]), rtol=1e-6)
    from dpjax.models.base import cross_entropy

    ce = cross_entropy(jax.jit(base.apply)(model.merge(params), batch[:, :-1]), batch[:, 1:])
    assert abs(float(loss) - float(ce)) > 1e-6  # the balance loss is in it
