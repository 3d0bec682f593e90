"""The metrics rows of a compressed run: `compression_ratio` each step (1.0 before a
start step, the method's after) and `comm_bytes` charged only the branch the step runs
of the compression's start cond (the compiled program holds both)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from dpjax.compression import accounting
from dpjax.train import main

from conftest import tiny_gpt

TINY = {"d_model": 32, "n_layers": 1, "n_heads": 8}
LOSS_BYTES = 2 * 7 * 1  # the reported loss's pmean: XLA's all-reduce of one float32 over 8, ring-charged


def _tiny(corpus, *extra):
    return tiny_gpt(corpus, "--steps", "4", *extra)


def _rows(path):
    return [r for r in map(json.loads, open(path)) if "loss" in r]


def _plan(**kw):
    from dpjax.plan import resolve
    from dpjax.settings import Settings

    return resolve(Settings(seq_len=16, batch_size=16, model_options=TINY, **kw))


def _shapes(plan):
    return [tuple(x.shape) for x in jax.tree.leaves(jax.eval_shape(plan.model.init, jax.random.key(0)))]


@pytest.mark.parametrize("update,spec", [("sync", "randk:0.1,start=2"), ("sparse:2", "int8,start=1")])
def test_each_row_has_its_steps_ratio_and_bytes(corpus, tmp_path, update, spec):
    """Steps 0-1 exchange exactly (sparse:2 averages once every 2 steps, so start=1 is
    its step 2), steps 2-3 compressed: each row's comm_bytes is that exchange's formula
    (`accounting.compressed_bytes`) plus the loss's mean, and its compression_ratio the
    formulas' ratio; the TensorBoard scalars carry the same ratio. sparse:2 averages at
    the end of steps 2 and 4 only: steps 1 and 3 send the loss's mean alone."""
    path, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    assert main(_tiny(corpus, "--mesh", "8x1", "--update", update, "--compression", spec, "--metrics", str(path),
                      "--tensorboard", str(tb))) == 0
    plan = _plan(mesh="8x1", update=update, compression=spec)
    plain, packed = (accounting.compressed_bytes(c, _shapes(plan), 8, algorithm="ring", fusion_mb=64)
                     for c in (None, spec))
    rows = _rows(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    sent = [plain, plain, packed, packed] if update == "sync" else [0, plain, 0, packed]
    assert [r["comm_bytes"] for r in rows] == [b + LOSS_BYTES for b in sent]
    assert [r["compression_ratio"] for r in rows] == [1.0, 1.0, plain / packed, plain / packed]
    assert plain / packed > 3
    from test_run_record import read_events

    got = {ev.step: v.simple_value for ev in read_events(tb) for v in ev.summary.value
           if v.tag == "comm/compression_ratio"}
    assert got == {r["step"]: np.float32(r["compression_ratio"]) for r in rows}


@pytest.mark.slow  # 25-30 s (FSDP with random-k's both branches compiled). Fast: the rows charging the branch each
# step runs (test_each_row_has_its_steps_ratio_and_bytes) and FSDP's compressed and exact reduce-scatters
# against their formulas in the compiled program (test_compression_fsdp.py::test_compiled_bytes_are_the_formula)
def test_fsdp_rows_charge_the_reduce_scatter_they_run(corpus, tmp_path):
    """FSDP through random-k with start=2: the rows before the start step send FSDP's
    exact reduce-scatters, after it the compressed ones: the difference is the formulas'
    (`sharded.wire_bytes`; the all-gathers are the same in both)."""
    from dpjax.compression.accounting import exchange_bytes

    path = tmp_path / "m.jsonl"
    spec = "randk:0.1,start=2"
    assert main(_tiny(corpus, "--mesh", "8x1", "--fsdp", "--compression", spec, "--metrics", str(path))) == 0
    plan = _plan(mesh="8x1", fsdp=True, compression=spec)
    plain, packed = exchange_bytes(plan, None)[1], exchange_bytes(plan)[1]
    sent = [r["comm_bytes"] for r in _rows(path)]
    assert sent[0] == sent[1] and sent[2] == sent[3] and sent[0] - sent[2] == plain - packed > 0, (sent, plain, packed)
    assert [r["compression_ratio"] for r in _rows(path)] == [1.0, 1.0, plain / packed, plain / packed]


def test_no_compression_no_ratio(corpus, tmp_path):
    path = tmp_path / "m.jsonl"
    assert main(_tiny(corpus, "--mesh", "2x1", "--steps", "2", "--metrics", str(path))) == 0
    assert all("compression_ratio" not in r and r["comm_bytes"] > 0 for r in _rows(path))
