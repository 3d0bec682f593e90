"""LoRA's training step on the meshes (data, tensor, FSDP) against the dense gradient of
the adapters, the base bit-identical after training, and the command lines: train,
resume, export (PEFT adapter, merged), generate and bad input (tests/test_lora.py: against
PEFT's own numbers)."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import assert_resumes_bit_for_bit, read_losses
from dpjax import step as S
from dpjax.models import get_model
from dpjax.models.lora import Lora, LoraConfig, Split
from dpjax.optim import OptimizerConfig
from dpjax.sharding import make_layout
from dpjax.train import main

HERE = os.path.join(os.path.dirname(__file__), "fixtures")
BASE, ADAPTER = os.path.join(HERE, "llama_tiny"), os.path.join(HERE, "lora_tiny")
TOL = dict(rtol=2e-5, atol=2e-6)  # float32: the sharded sums add partial products in another order
MOMENTUM = OptimizerConfig(name="momentum", lr=1.0, clip_norm=0.0)
SPLIT = Split("blocks")


def lora_llama(kv: int):
    base = get_model("llama", seq_len=8, d_model=32, n_layers=2, n_heads=4, n_kv_heads=kv, d_ff=48, vocab_size=64)
    return Lora(base, LoraConfig(r=4, alpha=8.0))


def start(model):
    """Fresh parameters with B not zero (PEFT's zero B would leave A without a gradient)."""
    params = jax.jit(model.init)(jax.random.key(0))
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.05 * jax.random.normal(jax.random.key(len(str(p))), x.shape) if "_B_" in str(p[-1]) else x,
        params)


def batch():
    return np.random.default_rng(0).integers(0, 64, (8, 9)).astype(np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("spec,kv,fsdp", [("2x4", 2, False), ("2x4", 4, True), ("8x1", 2, True)])
def test_sharded_step_equals_dense_and_keeps_the_base(mesh_of, put, spec, kv, fsdp):
    """One step of Nesterov momentum 0.9, lr 1 (its first update is 1.9 g): the adapters move
    by -1.9 times the dense gradient of the adapters (jax.grad of the unsharded loss); the
    base does not move at all, bit for bit; the optimizer state holds the adapters only."""
    model = lora_llama(kv)
    mesh = mesh_of(spec, 8)
    layout = make_layout(model, mesh, fsdp=fsdp)
    step = S.for_model(model, layout, global_batch=8, opt=MOMENTUM,
                       donate=False)
    before = start(model)
    params, state = step.init(jax.device_put(before, layout.shardings()))
    state_leaves = [x.shape for x in jax.tree.leaves(state) if x.ndim]
    assert sorted(state_leaves) == sorted(x.shape for x in jax.tree.leaves(SPLIT.trained(before)))
    params, state, loss = step.train(params, state, put(mesh, batch()[None], P(None, "data")))
    after = jax.tree.map(np.asarray, params)
    frozen = jax.tree.map(lambda a, b: np.array_equal(a, np.asarray(b)), SPLIT.frozen(after), SPLIT.frozen(before))
    assert all(jax.tree.leaves(frozen))

    def adapters_loss(trained):
        return model.loss(SPLIT.join(trained, SPLIT.frozen(before)), np.asarray(batch()))

    want, grads = jax.jit(jax.value_and_grad(adapters_loss))(SPLIT.trained(before))
    np.testing.assert_allclose(float(loss), float(want), **TOL)
    jax.tree.map(lambda a, b, g: np.testing.assert_allclose(a - np.asarray(b), -1.9 * np.asarray(g), **TOL),
                 SPLIT.trained(after), SPLIT.trained(before), grads)


def tiny(*extra) -> list[str]:
    return ["--init-from", f"hf:{BASE}", "--lora", "r=4,alpha=8,targets=q,k,v,o,gate,up,down", "--data", "synthetic",
            "--seq-len", "16", "--batch-size", "8", "--lr", "1e-2", "--sample-tokens", "0", *extra]


@pytest.mark.slow
def test_resume_of_a_lora_run_is_bit_for_bit(tmp_path):
    assert_resumes_bit_for_bit(tiny("--mesh", "2x4", "--fsdp"), tmp_path)


@pytest.mark.slow
def test_run_export_and_generate(tmp_path, capsys):
    """A LoRA run from the Hub folder: its base bit-identical to the file's, its adapter
    exported as PEFT's files (read back by --adapter: the same adapters), its merged export
    the base plus alpha/r B A, and generate with --adapter."""
    from safetensors.numpy import load_file

    from dpjax.generate.__main__ import main as generate
    from dpjax.hf.__main__ import main as hf
    from dpjax.hf.adapter import WEIGHTS

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    assert main(tiny("--mesh", "8x1", "--steps", "3", "--ckpt-dir", str(ckpt), "--metrics", str(metrics))) == 0
    assert len(read_losses(metrics)) == 3
    assert hf(["export", str(ckpt), "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    assert hf(["export", str(ckpt), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    base, merged = load_file(os.path.join(BASE, "model.safetensors")), load_file(str(tmp_path / "merged" /
                                                                                     "model.safetensors"))
    lora = load_file(str(tmp_path / "adapter" / WEIGHTS))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == os.path.abspath(BASE)
    assert len(lora) == 2 * 7 * 2
    for name, w in base.items():
        a = lora.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
        if a is None:
            np.testing.assert_array_equal(merged[name], w)  # not adapted: the file's, bit for bit
            continue
        b = lora[f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight"]
        assert np.abs(b).max() > 0  # trained away from PEFT's zero
        np.testing.assert_allclose(merged[name], w + 2.0 * b @ a, rtol=1e-6, atol=1e-6)
    # the checkpoint's base is the Hub file's, bit for bit: the adapters alone were trained
    from dpjax.hf.load import load_params
    from dpjax.hf.source import model_of, params_of
    from dpjax.mesh import make_mesh

    model, _, record = model_of(str(ckpt))
    layout = make_layout(model, make_mesh("1x1", jax.devices()[:1]))
    trained = params_of(str(ckpt), model, layout, record)
    hub = load_params(BASE, model.base, make_layout(model.base, layout.mesh))
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                                            SPLIT.frozen(trained), hub)))
    capsys.readouterr()
    assert generate(["--init-from", f"hf:{BASE}", "--adapter", str(tmp_path / "adapter"), "--prompt-ids", "0,17,42",
                     "--max-new-tokens", "4", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert generate(["--init-from", f"hf:{tmp_path / 'merged'}", "--prompt-ids", "0,17,42", "--max-new-tokens", "4",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_ids"] == ours["new_ids"]
