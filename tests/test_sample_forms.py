"""The sample a run prints at its end is the model's own greedy continuation of its own
tree, whatever form the run keeps the parameters in: an interleaved pipeline's layer
stack as V x L/V, a copy per worker under a rule whose workers diverge (delayed, sparse,
async). Both raised an AssertionError in models/gpt.py at the end of such a run with
--progress on; experiments/sweep.py found them."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np

from dpjax import pipeline as pp
from dpjax import step as S
from dpjax.data import make_streams
from dpjax.generate import Sampling, generate
from dpjax.models import get_model
from dpjax.plan import resolve
from dpjax.settings import Settings
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
                              layout=layout, val_stream=val, tokenizer=None, chat=None,
                              step=SimpleNamespace(rule=SimpleNamespace(per_worker=False)))
    prompt = val.batch(0, 1)[:, :8]
    want = generate(model, params, prompt, 4, Sampling())[0]
    assert sample_line(trainer) == f"sample: {prompt[0].tolist()} -> {want.tolist()}"


def test_a_per_worker_runs_sample_is_the_models_own(mesh_of):
    """sparse:2 on 2 workers: the parameters carry a worker axis; born equal, the consensus is
    the model's init."""
    plan = resolve(Settings(mesh="2x1", update="sparse:2", seq_len=16, data="synthetic",
                            model_options={"d_model": 32, "n_layers": 1, "n_heads": 4, "d_ff": 64}),
                   mesh_of("2x1", 2).devices.flatten())
    step = S.for_plan(plan)
    params = plan.model.init(jax.random.key(0))
    held, _ = step.init(S.init_params(plan.model, plan.layout, jax.random.key(0)))
    assert held["embed_VmxD"].shape[0] == 2  # a copy per worker
    _, val = make_streams("synthetic", 16, seed=0)
    trainer = SimpleNamespace(cfg=SimpleNamespace(sample_tokens=4, progress="log"), model=plan.model, params=held,
                              layout=plan.layout, val_stream=val, tokenizer=None, chat=None,
                              step=step)
    prompt = val.batch(0, 1)[:, :8]
    want = generate(plan.model, params, prompt, 4, Sampling())[0]
    assert sample_line(trainer) == f"sample: {prompt[0].tolist()} -> {want.tolist()}"
