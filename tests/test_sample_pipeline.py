"""The sample a run prints at its end from an interleaved pipeline's parameters: the
layout keeps the layer stack as V x L/V, the model's `apply` takes L x ...; the sample
is the model's own greedy continuation of its own tree (it raised an AssertionError in
models/gpt.py at the end of every interleaved run with --progress on, found by
experiments/sweep.py)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np

from dpjax import pipeline as pp
from dpjax.data import make_streams
from dpjax.generate import Sampling, generate
from dpjax.models import get_model
from dpjax.sharding import make_layout
from dpjax.train.sample import sample_line


def test_an_interleaved_runs_sample_is_the_models_own(mesh_of):
    model = get_model("gpt", d_model=32, n_layers=4, n_heads=4, d_ff=64, seq_len=16)
    layout = make_layout(model, mesh_of("stage=2,data=4", 8), pipeline=pp.Pipeline("interleaved", 2, 2))
    params = model.init(jax.random.key(0))
    stored = layout.store(params)
    assert stored["blocks"]["mlp"]["w1_LsxDxFm"].shape[:2] == (2, 2)  # V x L/V, not the model's L
    for a, b in zip(jax.tree.leaves(layout.unstore(stored)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    _, val = make_streams("synthetic", 16, seed=0)
    trainer = SimpleNamespace(cfg=SimpleNamespace(sample_tokens=4, progress="log"), model=model, params=stored,
                              layout=layout, val_stream=val, tokenizer=None)
    prompt = val.batch(0, 1)[:, :8]
    want = generate(model, params, prompt, 4, Sampling())[0]
    assert sample_line(trainer) == f"sample: {prompt[0].tolist()} -> {want.tolist()}"
