"""`--wandb PROJECT`: the metrics rows logged to a Weights & Biases run. wandb is an optional extra, so the
writer is checked against a stand-in module that records the calls (what the run receives: the settings as its
config, each row's numbers at its step under the TensorBoard group names); a slow test runs real wandb offline
(WANDB_MODE=offline, no network) when it is installed, and skips saying so when it is not."""

import glob
import json
import os
import subprocess
import sys
import types

import pytest

from dpjax.train import metrics


class StandIn:
    """wandb's calls as the writer makes them, recorded."""

    def __init__(self):
        self.calls = []
        test = self

        class Config:
            def update(self, values, allow_val_change=False):
                test.calls.append(("config", values))

        class Run:
            config = Config()

            def log(self, numbers, step=None):
                test.calls.append(("log", step, numbers))

            def finish(self):
                test.calls.append(("finish",))

        self.module = types.SimpleNamespace(init=lambda project: test.calls.append(("init", project)) or Run())


def test_the_writer_gives_wandb_the_settings_and_each_rows_numbers(monkeypatch, tmp_path):
    stand_in = StandIn()
    monkeypatch.setitem(sys.modules, "wandb", stand_in.module)
    writers = metrics.open_writers(str(tmp_path / "m.jsonl"), None, wandb="my-project")
    writers.write({"record": {"settings": {"lr": 0.1}, "plan": {"mesh": "2x4"}, "devices": []}})
    writers.write({"step": 1, "loss": 2.5, "tokens_per_s": 100, "mfu": 0.25, "nonfinite": False, "note": "x"})
    writers.write({"step": 2, "eval_loss": 2.0})
    writers.close()
    assert stand_in.calls == [
        ("init", "my-project"), ("config", {"settings": {"lr": 0.1}, "plan": {"mesh": "2x4"}}),
        ("log", 1, {"train/loss": 2.5, "train/tokens_per_s": 100, "efficiency/mfu": 0.25}),
        ("log", 2, {"eval/eval_loss": 2.0}), ("finish",)]
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3  # the JSON lines beside it, unchanged


def test_without_wandb_installed_the_flag_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(metrics.MissingPackage, match=r"^--wandb needs wandb: pip install wandb"):
        metrics.open_writers(None, None, wandb="p")


@pytest.mark.slow
def test_a_run_logs_to_wandb_offline(tmp_path):
    pytest.importorskip("wandb", reason="wandb is an optional extra (pip install 'dpjax[wandb]'); not installed here")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, "-m", "dpjax.train", "--steps", "3", "--d-model", "32", "--n-layers", "1",
                           "--seq-len", "16", "--batch-size", "8", "--eval-every", "0", "--sample-tokens", "0",
                           "--metrics", str(tmp_path / "m.jsonl"), "--wandb", "dpjax-test"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    with open(run, "rb") as f:  # wandb's own log of protobuf records: keys and values are JSON text in it
        raw = f.read()
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "m.jsonl") if '"loss"' in line]
    assert len(losses) == 3 and b"train/loss" in raw and b"dpjax-test" in raw
    for loss in losses:
        assert json.dumps(loss).encode() in raw, loss
