"""A metrics row's step_time is its own step's time, and the rows add up to the run.

The train step is made to take known, different times on the device: a callback after the
loss sleeps 0.1, 0.7 or 0.4 s in turn and notes when it ends (the step's end, measured
apart from the loop). On one CPU device XLA runs the program inside its dispatch, and the
old loop (four steps in flight, each row timed when the loop got round to it) wrote rows
of 0.0 s and put later steps' time in earlier rows; on two the dispatch returns before the
step ends, as on a GPU."""

import dataclasses
import json
import time

import jax
import pytest

from dpjax import step as S
from dpjax.train import main

SLEEPS = (0.1, 0.7, 0.4)
STEPS = 9


# the timing code is the same on every mesh: one device in the slow set
@pytest.mark.parametrize("mesh", [pytest.param("1x1", marks=pytest.mark.slow), "2x1"])
def test_each_row_times_its_own_step_and_the_rows_add_up(mesh, monkeypatch, tmp_path):
    ends, build = [], S.for_plan

    def sleep_then_note(loss):
        time.sleep(SLEEPS[len(ends) % len(SLEEPS)])
        ends.append(time.perf_counter())
        return loss

    def slow_for_plan(plan, *args, **kwargs):
        step = build(plan, *args, **kwargs)

        def train(params, state, batch):
            params, state, loss = step.train(params, state, batch)
            return params, state, jax.pure_callback(sleep_then_note, jax.ShapeDtypeStruct(loss.shape, loss.dtype),
                                                    loss)

        return dataclasses.replace(step, train=jax.jit(train, donate_argnums=(0, 1)))

    monkeypatch.setattr(S, "for_plan", slow_for_plan)
    path = tmp_path / "m.jsonl"
    assert main(["--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "16",
                 "--batch-size", "8", "--data", "synthetic", "--eval-every", "0", "--eval-batches", "1",
                 "--progress", "none", "--mesh", mesh, "--steps", str(STEPS), "--metrics", str(path)]) == 0
    rows = [json.loads(line) for line in open(path)]
    times = [r["step_time"] for r in rows if "step_time" in r]
    assert [r["step"] for r in rows if "step_time" in r] == list(range(1, STEPS + 1))
    assert len(ends) == STEPS  # one callback a step
    own = [b - a for a, b in zip(ends, ends[1:])]  # step i's own time: from step i-1's end to its own
    # no row near 0 while every step sleeps at least 0.1 s (the first row also holds the compile)
    assert min(times) > 0.5 * min(SLEEPS), times
    # from the fourth step on (the first ones share the loop's one-time work: the compile, the
    # program's figures), each row is its own step's time, within half the 0.2 s that tells
    # neighbouring steps apart (the loop sees a step end a little after it does, more so on a
    # busy machine)
    for i in range(3, STEPS):
        assert abs(times[i] - own[i - 1]) < 0.1, (i, times, own)
    # and the rows add up to the steps' wall time: only the two ends' delays apart
    assert abs(sum(times[3:]) - (ends[-1] - ends[2])) < 0.1, (times, own)
