"""Every script in examples/ that runs a dpjax step passes `DPJAX_CHECK=reference`: its first
call of each step, run also on one device from the same batch and state, gives the same outputs
and new state (`dpjax.wrap.reference`). Each runs at its own small size for a step or two (an
evaluation step included where the script has one). Dropout is off where `shard_step` draws it
(one mask per device, by design, is not one device's); under `dpjax.jit` (lm1b) it stays on,
its masks being one device's rows. The optimizers are the scripts' own, Adam included.

A script added to examples/ that calls `dpjax.shard_step` or `dpjax.jit` fails here until
RUNS says how to run it small.
"""

import pathlib

import pytest
from test_flax_examples import load

from dpjax.wrap import reference

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

# name -> (module attributes to set, train()'s arguments)
RUNS = {
    "distributed": ({}, dict(steps=1)),
    "gspmd_distributed": ({}, dict(steps=1, depth=16)),
    "linen_distributed": ({}, dict(steps=2, eval_every=1, dropout=0.0)),
    "nnx_distributed": ({}, dict(steps=2, eval_every=1, dropout=0.0)),
    "nnx_tutorial_distributed": ({"DROPOUT": 0.0}, dict(train_steps=2, eval_every=1)),
    "nnx_tp_distributed": ({"DROPOUT": 0.0}, dict(train_steps=2, eval_every=1)),
    "minigpt_distributed": ({}, dict(steps=1)),
    "minigpt_tp_distributed": ({}, dict(steps=1)),
    "lm1b_distributed": ({}, dict(steps=1)),
}
SLOW = {"lm1b_distributed"}  # flax's Transformer: minutes of compiling here


def test_every_example_with_a_dpjax_step_is_run():
    stepping = {p.stem for p in EXAMPLES.glob("*.py")
                if "dpjax.shard_step(" in p.read_text() or "dpjax.jit(" in p.read_text()}
    assert stepping == set(RUNS), f"add to RUNS how to run {sorted(stepping - set(RUNS))} small"


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n in SLOW else pytest.mark.extended)
                                  for n in RUNS])
def test_example_passes_the_reference_check(name, monkeypatch):
    monkeypatch.setenv("DPJAX_CHECK", "reference")
    runs = []
    real = reference.run
    monkeypatch.setattr(reference, "run", lambda *a: runs.append(1) or real(*a))  # the check did run
    attrs, kwargs = RUNS[name]
    mod = load(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    if name == "lm1b_distributed":  # one layer: the same code, less to compile
        mod.config.num_layers = 1
    mod.train(**kwargs)
    text = (EXAMPLES / f"{name}.py").read_text()
    assert len(runs) == text.count("dpjax.shard_step(") + text.count("dpjax.jit("), runs  # each step's first call
