"""examples/: flax's own way of writing a training loop (NNX and Linen), plain and
distributed with dpjax, train alike and differ by at most five lines.

Dropout off, the distributed loops (8 devices: BatchNorm statistics over the global
batch, gradients averaged, metrics summed) must give the plain loops' losses, metrics and
parameters to float32 round-off. Dropout on, every device must draw its own mask,
reproducibly from the seed.
"""

import difflib
import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import dpjax

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
STEPS, EVAL_EVERY = 4, 2
TOL = dict(rtol=2e-5, atol=2e-6)  # float32: the global batch's sums are added in another order


def load(name):
    sys.path.insert(0, str(EXAMPLES))  # the examples import their data from shapes.py
    try:
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(EXAMPLES))


def changed_lines(plain: str, distributed: str) -> list:
    """The code lines of distributed.py that differ from plain.py (docstrings aside)."""
    a = (EXAMPLES / f"{plain}.py").read_text().split('"""', 2)[2].splitlines()
    b = (EXAMPLES / f"{distributed}.py").read_text().split('"""', 2)[2].splitlines()
    return [line for line in difflib.unified_diff(a, b, lineterm="", n=0)
            if line.startswith("+") and not line.startswith("+++") and line.strip("+ ")]


@pytest.fixture(scope="module")
def nnx_runs():
    return {name: load(name).train(steps=STEPS, eval_every=EVAL_EVERY, dropout=0.0)
            for name in ("nnx_plain", "nnx_distributed")}


@pytest.fixture(scope="module")
def linen_runs():
    return {name: load(name).train(steps=STEPS, eval_every=EVAL_EVERY, dropout=0.0)
            for name in ("linen_plain", "linen_distributed")}


def assert_same_run(plain, dist, params):
    (p_state, p_hist), (d_state, d_hist) = plain, dist
    assert p_hist.keys() == d_hist.keys() and all(p_hist.values())
    for key in p_hist:
        np.testing.assert_allclose(d_hist[key], p_hist[key], **TOL, err_msg=key)
    for x, y in zip(jax.tree.leaves(params(d_state)), jax.tree.leaves(params(p_state))):
        np.testing.assert_allclose(x, y, **TOL)


def test_nnx_distributed_equals_plain(nnx_runs):
    """Train and test loss and accuracy (nnx.MultiMetric), parameters and BatchNorm statistics."""
    assert_same_run(nnx_runs["nnx_plain"], nnx_runs["nnx_distributed"],
                    lambda m: nnx.state(m, nnx.Param, nnx.BatchStat))
    assert nnx_runs["nnx_plain"][1]["train_loss"][-1] < nnx_runs["nnx_plain"][1]["train_loss"][0]


def test_linen_distributed_equals_plain(linen_runs):
    """Per-step loss and accuracy, test metrics, parameters and batch statistics (TrainState)."""
    assert_same_run(linen_runs["linen_plain"], linen_runs["linen_distributed"],
                    lambda s: (s.params, s.batch_stats, s.opt_state))


@pytest.mark.parametrize("pair", [("nnx_plain", "nnx_distributed"), ("linen_plain", "linen_distributed")])
def test_at_most_five_lines_change(pair):
    lines = changed_lines(*pair)
    assert len(lines) <= 5, lines
    assert all("dpjax" in line for line in lines), lines  # each says what it is for


def distinct_rows(masks) -> bool:
    rows = [r.tobytes() for r in np.asarray(masks) != 0]
    return len(set(rows)) == len(rows)


def test_nnx_dropout_differs_across_devices():
    """The example's Dropout inside shard_step: 8 devices, identical input rows, 8 masks;
    the same seed gives the same masks, the next call new ones."""
    ex = load("nnx_distributed")
    probe = dpjax.shard_step(lambda model, x: model.dropout(x), batch_argnums=1, out_specs=P("data"))
    x = np.ones((8, 256), np.float32)  # one row per device
    first = np.asarray(probe(ex.CNN(rngs=nnx.Rngs(0), dropout=0.5), x))
    assert distinct_rows(first) and 0.4 < (first == 0).mean() < 0.6
    model = ex.CNN(rngs=nnx.Rngs(0), dropout=0.5)
    np.testing.assert_array_equal(probe(model, x), first)  # reproducible from the seed
    assert not np.array_equal(probe(model, x), first)  # the stream moves on


def test_linen_dropout_differs_across_devices():
    """dpjax.device_key as the Linen example uses it: one mask per device, from one key."""
    def masks(key, x):
        return nn.Dropout(0.5, deterministic=False).apply({}, x, rngs={"dropout": dpjax.device_key(key)})

    probe = dpjax.shard_step(masks, batch_argnums=1, out_specs=P("data"))
    x = np.ones((8, 256), np.float32)
    got = probe(jax.random.key(0), x)
    assert distinct_rows(got)
    np.testing.assert_array_equal(probe(jax.random.key(0), x), got)
    key = jax.random.key(3)
    assert dpjax.device_key(key) is key  # outside a mesh: one device, one stream
