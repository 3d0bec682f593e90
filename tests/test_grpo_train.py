"""`python -m dpjax.train --task grpo` as a user runs it (slow: each run compiles generation and a
training step). A tiny Llama learns experiments/grpo_sum.py's sums from reward alone on 2x4 (minutes);
a reward that raises or returns NaN stops the run in one line naming the prompt's row, with nothing
written (a process each); a run resumed from a checkpoint at a generation batch's start equals the
uninterrupted run bit for bit; with --lora the reference is the base with the adapters off."""

import os
import subprocess
import sys

import pytest
from _experiment_runs import experiment, rows

from dpjax.train import main

pytestmark = pytest.mark.slow

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(HERE)
SUMS = os.path.join(HERE, "fixtures", "grpo_sum")


def test_learns_the_sums_from_reward_alone(tmp_path):
    """experiments/grpo_sum.py's run on 2x4, in the suite's process: the mean reward of each step's 256
    completions (sampled at temperature 1) from near 0 over the first 10 steps to >= 0.8 over the last 50."""
    exp = experiment("grpo_sum")
    metrics = tmp_path / "m.jsonl"
    assert main([*exp.train_args(str(tmp_path), steps=200), "--metrics", str(metrics)]) == 0
    got = rows(metrics, "reward")
    reward = [r["reward"] for r in got]
    assert len(reward) == 200 and sum(reward[:10]) / 10 < 0.1, reward[:10]
    assert sum(reward[-50:]) / 50 >= 0.8, reward[-50:]
    assert got[1]["generate_time"] > 0 and got[1]["score_time"] > 0 and got[1]["train_time"] == got[1]["step_time"]


def test_resume_is_bit_for_bit(tmp_path):
    """4 steps, 2 updates a generation batch (the old log-probs path): 2 steps and a checkpoint, then --resume."""
    exp = experiment("grpo_sum")
    # --decay-steps: the cosine's length, else --steps (the interrupted run's 2 would be another schedule)
    args = [*exp.train_args(str(tmp_path), steps=4, mesh="4x2"), "--grpo-updates", "2", "--decay-steps", "4"]
    whole, part, ck = tmp_path / "whole.jsonl", tmp_path / "part.jsonl", str(tmp_path / "ck")
    assert main([*args, "--metrics", str(whole)]) == 0
    assert main([*args, "--steps", "2", "--ckpt-dir", ck, "--metrics", str(part)]) == 0
    assert main([*args, "--ckpt-dir", ck, "--resume", "--metrics", str(part)]) == 0
    keys = ("step", "loss", "reward", "kl", "clip_fraction")
    got = {r["step"]: [r[k] for k in keys] for r in rows(part, "reward")}
    want = {r["step"]: [r[k] for k in keys] for r in rows(whole, "reward")}
    assert got == want and len(want) == 4
    assert want[2][2] == want[1][2] and want[3][2] != want[2][2]  # a batch a pair of steps


@pytest.mark.parametrize("reward, says", [("raises", "raised ValueError: no answer key for this prompt on the "
                                                      "prompt of {prompts}:3"),
                                          ("nan", "returned nan on the prompt of {prompts}:2")])
def test_a_broken_reward_stops_in_one_line(tmp_path, reward, says):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+2="}\n{"prompt": "2+2=", "bad": true}\n{"prompt": "2+3="}\n'
                       '{"prompt": "1+1="}\n')
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "dpjax.train", "--task", "grpo", "--prompts", str(prompts), "--reward",
           f"{SUMS}/reward.py:{reward}", "--tokenizer", SUMS, "--vocab-size", "16", "--model", "llama",
           "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "2", "--seq-len", "8",
           "--max-completion", "2", "--group-size", "2", "--batch-size", "8", "--mesh", "4x2", "--steps", "2",
           "--progress", "none", "--metrics", str(metrics)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and says.format(prompts=prompts) in err[0], err
    assert not metrics.exists()


def test_lora_reference_is_the_base_with_adapters_off(tmp_path, monkeypatch):
    """--lora: the reference's log-probs come from the policy's own base, adapters off (no copy of the
    weights); the same run with the reference a frozen copy of the starting weights (adapters at B = 0,
    so the same function) writes the same rows bit for bit, KL > 0 once the adapters have moved."""
    import dpjax.tasks.dpo
    from dpjax.train import rollout

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{a}+{b}="}}\n' for a in range(3) for b in range(3)))
    args = ["--task", "grpo", "--prompts", str(prompts), "--reward", f"{SUMS}/reward.py:reward", "--tokenizer", SUMS,
            "--vocab-size", "16", "--model", "llama", "--d-model", "16", "--n-layers", "1", "--n-heads", "2",
            "--n-kv-heads", "2", "--d-ff", "32", "--seq-len", "8", "--max-completion", "2", "--group-size", "4",
            "--batch-size", "16", "--mesh", "4x2", "--steps", "3", "--lr", "0.05", "--kl-coef", "0.1", "--lora",
            "r=4,alpha=8,targets=q,v,gate", "--progress", "none", "--sample-tokens", "0"]
    copies = []
    real = rollout.reference
    monkeypatch.setattr(rollout, "reference", lambda trainer: (real(trainer), copies.append(trainer.ref_params)))
    assert main([*args, "--metrics", str(tmp_path / "base.jsonl")]) == 0
    assert copies == [None]  # no second copy of the weights
    monkeypatch.setattr(dpjax.tasks.dpo, "reference_of", lambda model: None)  # the frozen copy instead
    assert main([*args, "--metrics", str(tmp_path / "copy.jsonl")]) == 0
    assert copies[1] is not None
    keys = ("loss", "reward", "kl", "clip_fraction")
    base = [[r[k] for k in keys] for r in rows(tmp_path / "base.jsonl", "reward")]
    copy = [[r[k] for k in keys] for r in rows(tmp_path / "copy.jsonl", "reward")]
    assert base == copy and len(base) == 3
    assert base[0][2] == 0 and base[2][2] > 0, base  # the policy starts as the reference, then leaves it
