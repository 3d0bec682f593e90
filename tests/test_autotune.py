"""Autotune (`dpjax.train.autotune`): the search on known step times, then `--fusion-mb auto` in a
real run: the choice is used from then on, written to the metrics and the checkpoint,
and a resumed run keeps it. Plus `comm_bytes` and `--timeline` in the same run."""

from __future__ import annotations

import json
import math
import random

import jax
import pytest

from dpjax.train.autotune import CAPS, Halving, Setting, Tuner, fusion_caps, halving_steps
from dpjax.collectives.cost import schedule
from dpjax.fusion import plan_buckets
from dpjax.train import main


def _drive(search, seconds):
    """Runs a search to its end; returns the (candidate, timed) sequence it asked for."""
    asked = []
    while (q := search.ask()) is not None:
        asked.append(q)
        search.tell(q[0], seconds(q[0]), q[1])
    return asked


@pytest.mark.parametrize("k", [2, 3, 6, 7])
def test_halving_finds_the_fastest_in_its_step_budget(k):
    rng = random.Random(k)
    true = {f"c{i}": 1.0 + 0.15 * rng.random() + 0.12 * i for i in range(k)}  # >= 12% apart
    fastest = min(true, key=true.get)
    h = Halving(list(true), per_round=3)
    asked = _drive(h, lambda c: true[c] * rng.uniform(0.95, 1.05))  # +-5% noise
    assert h.winner == fastest
    assert len(asked) == halving_steps(k, 3) == k + 3 * sum(math.ceil(k / 2**r) for r in range(math.ceil(math.log2(k))))
    assert asked[:k] == [(c, False) for c in true]  # each compiles once, untimed
    first_round = [c for c, _ in asked[k:2 * k]]
    assert sorted(first_round) == sorted(true)  # interleaved: every candidate once per pass
    with pytest.raises(ValueError):
        Halving(["a", "b"]).tell("b", 1.0, True)


def test_tuner_searches_the_algorithm_then_the_cap():
    base = {"ring": 1.0, "psum": 0.8, "butterfly": 0.9, "tree": 1.3}
    cap = {64: 1.0, 1: 0.95, 0.25: 0.85, 0: 1.2}
    t = lambda s: base[s.algorithm] * cap[s.fusion_mb]  # noqa: E731
    tuner = Tuner(Setting("ring", 64), list(base), lambda alg: list(cap), per_round=2)
    asked = _drive(tuner, t)
    assert tuner.done and tuner.choice == Setting("psum", 0.25)
    assert [st["knob"] for st in tuner.stages] == ["allreduce", "fusion_mb"]
    # the second stage's start, psum@64, ran in the first: no second compile; each winner
    # is confirmed against its stage's start in 2 x 2 fresh passes of the two
    assert len(asked) == tuner.steps == tuner.budget == halving_steps(4, 2) + halving_steps(4, 2, warmup=3) + 2 * 8
    assert sum(1 for s, timed in asked if s == Setting("psum", 64) and not timed) == 1
    assert tuner.gain() == pytest.approx(t(Setting("ring", 64)) / t(Setting("psum", 0.25)))
    rec = tuner.record()
    assert (rec["allreduce"], rec["fusion_mb"], rec["tuned"]) == ("psum", 0.25, ["allreduce", "fusion_mb"])
    assert rec["stages"][0]["medians_ms"]["tree@64"] == pytest.approx(1300.0)


def test_tuner_keeps_the_start_unless_the_winner_confirms():
    """The winner of the halving must be faster than the starting setting (by min_gain)
    in fresh passes of the two: one that was lucky in the search is not kept."""
    t = {Setting("ring", 64): 1.0, Setting("psum", 64): 0.95, Setting("tree", 64): 1.2}
    for min_gain, lucky, kept in ((1.0, False, False), (1.0, True, True), (1.1, False, True)):
        tuner = Tuner(Setting("ring", 64), ["ring", "psum", "tree"], per_round=3, min_gain=min_gain)

        def seconds(s):  # lucky: psum is fast while searched, slow once confirmed
            late = lucky and tuner.stages[-1]["confirm"] is not None
            return t[s] * (1.2 if late and s.algorithm == "psum" else 1.0)

        asked = _drive(tuner, seconds)
        assert len(asked) == tuner.budget
        assert tuner.choice == (Setting("ring", 64) if kept else Setting("psum", 64))
        assert tuner.gain() == pytest.approx(1.0 if kept else 1 / 0.95)
        (stage,) = tuner.record()["stages"]
        assert stage["winner"] == "psum@64" and stage["choice"] == str(tuner.choice)


def test_fusion_caps_keep_one_cap_per_bucket_plan():
    tree = {"a": jax.ShapeDtypeStruct((1000,), "float32"), "b": jax.ShapeDtypeStruct((64, 1024), "float32"),
            "c": jax.ShapeDtypeStruct((10,), "float32"), "d": jax.ShapeDtypeStruct((300_000,), "float32")}
    caps = fusion_caps(tree, (3.0, *CAPS))
    plan = lambda c: tuple(b.leaves for b in plan_buckets(tree, c * 2**20).buckets)  # noqa: E731
    assert caps[0] == 3.0 and len({plan(c) for c in caps}) == len(caps)
    assert {plan(c) for c in CAPS} == {plan(c) for c in caps}
    assert plan(caps[-1]) == tuple((i,) for i in range(4))  # 0: one bucket per tensor


MLP = ["--model", "mlp", "--d-embed", "8", "--d-hidden", "32", "--context", "2", "--seq-len", "8",
       "--batch-size", "8", "--data", "synthetic", "--eval-every", "0", "--eval-batches", "1", "--mesh", "2x1"]


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_fusion_auto_is_used_recorded_and_kept_on_resume(tmp_path, capsys):
    from dpjax.recovery.checkpoint import Checkpointer
    from dpjax.models import get_model

    model = get_model("mlp", seq_len=8, d_embed=8, d_hidden=32, context=2)
    grads = jax.eval_shape(model.init, jax.random.key(0))  # replicated on 2x1: each device's shapes
    plans = {tuple(b.leaves for b in plan_buckets(grads, c * 2**20).buckets) for c in (64.0, *CAPS)}
    k = len(plans)
    budget = halving_steps(k, 2) + 4 * 2  # with the confirmation of a winner that is not 64 MiB
    steps, metrics, ckpt, trace = budget + 6, tmp_path / "m.jsonl", tmp_path / "ckpt", tmp_path / "t.json"
    argv = [*MLP, "--fusion-mb", "auto", "--autotune-samples", "2", "--metrics", str(metrics),
            "--ckpt-dir", str(ckpt), "--timeline", str(trace), "--timeline-steps", "2"]
    assert main([*argv, "--steps", str(steps)]) == 0
    out = capsys.readouterr().out
    assert "autotune: --allreduce ring --fusion-mb" in out and "timeline: steps" in out
    rows = _rows(metrics)
    (auto,) = [r["autotune"] for r in rows if "autotune" in r]
    tuning = auto["steps"]
    assert tuning in (budget - 8, budget)  # confirmed or not
    trials = [r for r in rows if "trial" in r]
    assert len(trials) == tuning and len({r["trial"] for r in trials}) == k
    assert [r["step"] for r in trials] == list(range(1, tuning + 1))
    chosen = plan_buckets(grads, auto["fusion_mb"] * 2**20)
    # after the search every step runs the choice, and sends what its ring schedule says
    # (plus the loss's psum, charged as a ring would send 4 bytes)
    sent = sum(schedule("ring", 2, sum(b.sizes)).bytes for b in chosen.buckets) + schedule("psum", 2, 1).bytes
    after = [r for r in rows if "loss" in r and r["step"] > tuning]
    assert len(after) == steps - tuning and all("trial" not in r and r["comm_bytes"] == sent for r in after)
    assert [r["step"] for r in rows if "comm_fraction" in r] == [tuning + 2, tuning + 3]
    assert all(0 < r["comm_fraction"] < 1 for r in rows if "comm_fraction" in r)
    ck = Checkpointer(str(ckpt))
    assert ck.read_record()["autotune"] == auto
    ck.close()

    assert main([*argv[:-4], "--steps", str(steps + 3), "--resume"]) == 0
    assert "keeping the checkpoint's choice" in capsys.readouterr().out
    resumed = [r for r in _rows(metrics)[len(rows):] if "loss" in r]
    assert [r["step"] for r in resumed] == list(range(steps + 1, steps + 4))
    assert all("trial" not in r and r["comm_bytes"] == sent for r in resumed)


def test_autotune_too_short_a_run_is_one_line(capsys):
    assert main([*MLP, "--allreduce", "auto", "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "autotune needs up to" in err and err.count("\n") == 1
