"""The model contract (`models/base.py`, `dpjax.models.registry.Model`): dpjax reads a
model's capabilities as declared attributes, never probing it; the Llama borrows nothing
from the GPT; and a new architecture is a config, a block and a weight init: a `Decoder`
subclass of a few lines trains through `dpjax.plan` and `dpjax.step` on a tensor-parallel
mesh, its step matching plain JAX's gradient of the unsharded model."""

from __future__ import annotations

import ast
import pathlib
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dpjax.compute import tensor_parallel as tp
from dpjax.compute.tensor_parallel import DENSE, Parallel
from dpjax.models import Decoder

ROOT = pathlib.Path(__file__).resolve().parents[1]
# getattr / hasattr whose object is a model (model, plan.model, self.model, a registry entry's
# class) or a probe of a config for a named field it may lack
PROBE = re.compile(r"\b(?:get|has)attr\(\s*(?:[\w.]*\.)?(?:model|build)\b"
                   r"|\b(?:get|has)attr\(\s*(?:[\w.]*\.)?(?:config|c)\s*,\s*[\"']")


def probes(root: pathlib.Path) -> list[str]:
    return [f"{path.relative_to(root)}:{i}: {line.strip()}" for path in sorted((root / "dpjax").rglob("*.py"))
            for i, line in enumerate(path.read_text().splitlines(), 1) if PROBE.search(line)]


def test_dpjax_reads_a_model_without_probing_it():
    assert PROBE.search('layers = getattr(model, "LAYERS", None)')  # what the pattern is for
    assert PROBE.search('if getattr(config, "n_heads", None):') and PROBE.search("hasattr(plan.model, 'x')")
    assert not PROBE.search('getattr(path[0], "key", None) == model.LAYERS')
    assert probes(ROOT) == []


def test_llama_imports_nothing_from_the_gpt():
    tree = ast.parse((ROOT / "models" / "llama.py").read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names]
    assert "dpjax.models.base" in imported
    assert not [m for m in imported if m and m.split(".")[-1] == "gpt"], imported


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 32
    seq_len: int = 8
    d_model: int = 8
    n_layers: int = 2
    n_heads: int = 1  # no attention: the block mixes time by a causal running mean
    d_ff: int = 16


class Tiny(Decoder):
    """A new architecture: a vocabulary-parallel embedding (tied head), and blocks that add
    the causal running mean of x (each position sees itself and the past) and a
    tensor-parallel ReLU MLP (F split over `model`)."""

    name = "tiny"
    SPECS = {"embed_VmxD": P("model", None), "w1_LsxDxFm": P("stage", None, "model"),
             "w2_LsxFmxD": P("stage", "model", None)}

    def init(self, key):
        c = self.config
        k = jax.random.split(key, 3)
        return {"embed_VmxD": 0.5 * jax.random.normal(k[0], (c.vocab_size, c.d_model)),
                "blocks": {"w1_LsxDxFm": 0.3 * jax.random.normal(k[1], (c.n_layers, c.d_model, c.d_ff)),
                           "w2_LsxFmxD": 0.3 * jax.random.normal(k[2], (c.n_layers, c.d_ff, c.d_model))}}

    def embed(self, params, tokens_BdxT, par: Parallel = DENSE):
        return tp.vocab_parallel_embed(tokens_BdxT, params["embed_VmxD"], par)

    def layer(self, blk, x_BdxTxD, par: Parallel = DENSE):
        T = x_BdxTxD.shape[1]
        x_BdxTxD = x_BdxTxD + jnp.cumsum(x_BdxTxD, axis=1) / jnp.arange(1, T + 1)[:, None]
        h_BdxTxFm = jax.nn.relu(tp.column_parallel(x_BdxTxD, blk["w1_LsxDxFm"], None, par))
        return x_BdxTxD + tp.row_parallel(h_BdxTxFm, blk["w2_LsxFmxD"], None, par)

    def head(self, params, x_BdxTxD, par: Parallel = DENSE):
        return tp.column_parallel(x_BdxTxD.astype(jnp.float32), params["embed_VmxD"].T, None, par)

    def flops_per_token(self) -> float:
        c = self.config
        return 6 * (2 * c.n_layers * c.d_model * c.d_ff + c.vocab_size * c.d_model)


def test_a_new_decoder_trains_through_the_plan_and_the_step(mesh_of, put):
    """On a 2x4 mesh (data 2, model 4: the vocabulary and F split 4 ways) one SGD step of
    the planned program: its loss and new parameters against plain JAX's value and
    gradient of the unsharded model's loss on the whole batch."""
    import optax

    from dpjax import step as S
    from dpjax.mesh import data_axes
    from dpjax.plan import resolve
    from dpjax.settings import Settings

    model, B, lr = Tiny(TinyConfig()), 8, 0.5
    assert (model.CONTEXT, model.LAYERS, model.has_stats, model.experts) == (True, "blocks", False, 0)
    s = Settings(mesh="2x4", data="synthetic", batch_size=B, seq_len=model.config.seq_len)
    plan = resolve(s, mesh=mesh_of("2x4", 8), model=model, optimizer=optax.sgd(lr))
    assert plan.memory["activations"] > 0  # the Decoder's estimate, from the shape alone
    step = S.for_plan(plan, donate=False)
    p0 = S.init_params(model, plan.layout, jax.random.key(0))
    w1 = p0["blocks"]["w1_LsxDxFm"]
    assert w1.addressable_shards[0].data.shape == (2, 8, 4)  # F split over the 4 model ranks
    tokens = np.random.default_rng(0).integers(0, 32, (1, B, model.config.seq_len + 1)).astype(np.int32)
    params, state = step.init(p0)
    p1, _, loss = step.train(params, state, put(plan.mesh, tokens, P(None, data_axes(plan.mesh))))

    whole = jax.tree.map(np.asarray, model.init(jax.random.key(0)))
    want_loss, want_grad = jax.jit(jax.value_and_grad(model.loss))(whole, tokens[0])
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    for path, got, w, g in zip(jax.tree_util.tree_leaves_with_path(p1), jax.tree.leaves(p1), jax.tree.leaves(whole),
                               jax.tree.leaves(want_grad)):
        np.testing.assert_allclose(np.asarray(got), w - lr * np.asarray(g), rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path[0]))
