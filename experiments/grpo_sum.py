"""GRPO learns a verifiable task from reward alone: the sum of two one-digit numbers.

The prompts are "a+b=" for a, b in 0..4 (25 rows); a completion is rewarded 1 when it is exactly
the sum followed by the end-of-turn token, 0.1 when it starts with the sum but does not stop,
else 0 (tests/fixtures/grpo_sum/reward.py). A tiny Llama, from scratch (the character tokenizer
of tests/fixtures/grpo_sum: 14 ids), trains with `python -m dpjax.train --task grpo` on a 2x4
mesh: each step samples G = 8 completions of 32 prompts (the 25 in a seeded order, epoch after
epoch) with the KV-cache generator on the trainer's own parameters, scores them, and takes the
clipped policy-gradient step (AdamW, lr 1e-2 decaying by a cosine to 0 at the last step) with the KL
term (--kl-coef 0.01) to the starting weights. The mean reward of each step's completions, sampled at
temperature 1, rises from about 0.04 to above 0.8 (at a constant lr it peaks and sags: 0.62-0.89 over the
last 50 steps by the seed or the round-off, RESULTS.md); each row's time split (generate / score /
train) is summed at the end.

    python experiments/grpo_sum.py --plot experiments/plots/grpo_sum.png --json experiments/plots/grpo_sum.json
    python experiments/grpo_sum.py --smoke      # 2 steps (tens of seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import _bench

ROOT = _bench.ROOT
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "grpo_sum")
REWARD = os.path.join(FIXTURE, "reward.py") + ":reward"


def write_prompts(path: str, digits: int = 5) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": f"{a}+{b}="}) + "\n" for a in range(digits) for b in range(digits))
    return path


def train_args(folder: str, steps: int, mesh: str = "2x4", seed: int = 0, digits: int = 5) -> list[str]:
    """`python -m dpjax.train` arguments of the run (its prompts written into `folder`)."""
    prompts = write_prompts(os.path.join(folder, "sums.jsonl"), digits)
    return ["--task", "grpo", "--prompts", prompts, "--reward", REWARD, "--group-size", "8", "--batch-size", "256",
            "--max-completion", "2", "--tokenizer", FIXTURE, "--vocab-size", "16", "--model", "llama",
            "--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2", "--d-ff", "64",
            "--seq-len", "8", "--mesh", mesh, "--steps", str(steps), "--lr", "1e-2", "--lr-schedule", "cosine",
            "--kl-coef", "0.01",
            "--seed", str(seed), "--sample-tokens", "0", "--progress", "none"]


def curves(metrics: str) -> dict:
    out = {k: [] for k in ("steps", "reward", "loss", "kl", "generate_time", "score_time", "train_time")}
    with open(metrics) as f:
        for line in f:
            r = json.loads(line)
            if "reward" in r:
                out["steps"].append(r["step"])
                for k in ("reward", "loss", "kl", "generate_time", "score_time", "train_time"):
                    out[k].append(r[k])
    return out


def run(args, folder: str) -> dict:
    metrics = os.path.join(folder, "metrics.jsonl")
    _bench.train(train_args(folder, args.steps), metrics)
    return curves(metrics)


def plot(c: dict, path: str, title: str) -> None:
    plt = _bench.pyplot(path)
    if plt is None:
        return
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(7.5, 6.0), sharex=True)
    ax.plot(c["steps"], c["reward"], lw=0.8, label="mean reward of the step's completions")
    ax.axhline(0.8, color="k", lw=0.5, ls="--")
    ax.set(ylabel="reward", title=title, ylim=(-0.02, 1.02))
    bx.plot(c["steps"], c["kl"], lw=0.8, label="KL to the reference (k3, per token)")
    bx.set(xlabel="step", ylabel="KL")
    _bench.finish_plot(fig, (ax, bx), path)


def summary(c: dict, window: int = 10) -> list[str]:
    """The table: the mean reward over windows of steps, and the time split (the first step,
    which compiles, apart)."""
    n = len(c["steps"])
    lines = ["| steps | mean reward |", "|---:|---:|"]
    for s in range(0, n, max(window, n // 10)):
        e = min(n, s + window)
        lines.append(f"| {c['steps'][s]}-{c['steps'][e - 1]} | {sum(c['reward'][s:e]) / (e - s):.3f} |")
    rest = {k: sum(c[k][1:]) for k in ("generate_time", "score_time", "train_time")}
    total = sum(rest.values()) or 1.0
    lines.append("")
    lines.append(f"time after the first step: generate {rest['generate_time']:.1f} s "
                 f"({100 * rest['generate_time'] / total:.0f}%), score {rest['score_time']:.1f} s "
                 f"({100 * rest['score_time'] / total:.0f}%), train {rest['train_time']:.1f} s "
                 f"({100 * rest['train_time'] / total:.0f}%); the first step: generate {c['generate_time'][0]:.1f} s, "
                 f"score {c['score_time'][0]:.1f} s, train {c['train_time'][0]:.1f} s (compiles)")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--plot", default=None, help="PNG: the reward and the KL over the steps")
    p.add_argument("--json", default=None, help="the curves as JSON")
    _bench.add_smoke(p, "2 steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps = 2
        args.plot, args.json = args.plot or "grpo_sum.png", args.json or "grpo_sum.json"
        _bench.smoke_outputs(args, "plot", "json")
    load0, t0 = _bench.load_avg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dpjax-grpo-") as folder:
        c = run(args, folder)
    c.update(machine=_bench.machine(), load=load0, seconds=time.perf_counter() - t0)
    print("\n".join(summary(c)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(c, f, indent=1)
    if args.plot:
        plot(c, args.plot, f"GRPO on a 2x4 mesh: a tiny Llama learns a+b= from reward alone ({args.steps} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
