"""A run's own hook (`dpjax.train.Hook`, passed to `dpjax.train.run`): it sees every
step's metrics row, once, in step order (the rows the --metrics file holds are the
reference), and its `loop.stop()` ends the run after the step under way, that step
saved and evaluated, the run "done" (not interrupted)."""

import json

import pytest

from dpjax.train import Hook, parse_args, run
from dpjax.train.hooks import Hooks
from dpjax.train.loop import MAX_IN_FLIGHT

from conftest import tiny_gpt

STOP_AT = 2  # the row that asks for the stop; the step under way then is STOP_AT + MAX_IN_FLIGHT


class Watcher(Hook):
    def __init__(self):
        self.rows, self.events = [], []

    def start(self, loop):
        self.events.append("start")

    def step(self, loop, row):
        self.rows.append(dict(row))
        if row["step"] == STOP_AT:
            loop.stop()

    def end(self, loop):
        self.events.append("end")

    def close(self, loop):
        self.events.append("close")


def test_a_hook_sees_every_row_in_order_and_stops_the_run(corpus, tmp_path):
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    watcher = Watcher()
    summary = run(parse_args(tiny_gpt(corpus, "--mesh", "1x1", "--steps", "6", "--metrics", str(metrics),
                                      "--ckpt-dir", str(ckpt), "--ckpt-every", "100")), hooks=[watcher])
    rows = [json.loads(line) for line in open(metrics)]
    written = [r for r in rows if "loss" in r]
    last = STOP_AT + MAX_IN_FLIGHT
    assert [r["step"] for r in written] == list(range(1, last + 1))
    assert watcher.rows == written  # every field of every step's row, in order, once
    assert watcher.events == ["start", "end", "close"]
    assert summary["steps"] == last and not summary["interrupted"] and summary["saved"] == last
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [last]
    assert [r["step"] for r in rows if "eval_loss" in r] == [last]  # the end's evaluation, of the last step
    assert summary["eval_loss"] == rows[-1]["eval_loss"]


def test_a_hook_is_a_hook():
    with pytest.raises(TypeError, match="dpjax.train.Hook"):
        Hooks([object()])


def test_the_built_in_hooks_use_only_what_hooks_py_documents():
    """The built-in hooks are components (each owns its part) that reach the loop only
    through the names `dpjax.train.hooks` lists, as a run's own hook must."""
    import re
    from pathlib import Path

    import dpjax.train.hooks as hooks_module

    train = Path(hooks_module.__file__).parent
    block = hooks_module.__doc__.split("What a hook may use of `loop`")[1]
    documented = set(re.findall(r"loop\.(\w+)", block))
    used = {name: set(re.findall(r"\bloop\.(\w+)", (train / name).read_text()))
            for name in ("builtin.py", "checkpoints.py", "observe.py", "elastic.py", "tuning.py")}
    assert {k: v - documented for k, v in used.items() if v - documented} == {}
    assert "isolate" in documented and "trainer" in documented
