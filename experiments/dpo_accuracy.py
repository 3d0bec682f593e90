"""DPO learns a preference: held-out pair accuracy over the steps of `--task dpo`.

A synthetic preference set with a clear rule: asked for a country's capital, the chosen answer
is the sentence "The capital of X is Y." and the rejected one another form ("Y.", "Y is the
capital of X.", "The capital is Y.", "It is Y."). The held-out pairs ask about countries the training
pairs never name, so that the rule, not the pairs, must be learnt. A tiny Llama (from scratch, the
ChatML tokenizer of tests/fixtures/chat_tiny) trains with `python -m dpjax.train --task dpo` on a
2x4 mesh, the reference its starting weights (precomputed); every --eval-every steps the run
writes the held-out pairs' accuracy (the share whose margin is > 0), margin and loss.

    python experiments/dpo_accuracy.py --plot experiments/plots/dpo_accuracy.png \\
        --json experiments/plots/dpo_accuracy.json
    python experiments/dpo_accuracy.py --smoke      # 2 steps (tens of seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import _bench
import numpy as np

ROOT = _bench.ROOT
CHATML = os.path.join(ROOT, "tests", "fixtures", "chat_tiny", "chatml")
CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"), ("Peru", "Lima"),
            ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Chile", "Santiago"), ("Cuba", "Havana"),
            ("Norway", "Oslo"), ("Greece", "Athens"), ("Poland", "Warsaw"), ("Iran", "Tehran"),
            ("Mali", "Bamako"), ("Nepal", "Kathmandu"), ("Qatar", "Doha"), ("Fiji", "Suva"), ("Laos", "Vientiane"),
            ("Oman", "Muscat"), ("Chad", "N'Djamena")]
HELD_OUT = 4  # the last countries: only in the held-out pairs
# near misses too: the same words in another order, a shorter sentence
REJECTED = ("{city}.", "{city} is the capital of {country}.", "The capital is {city}.", "It is {city}.")


def pairs(n: int, seed: int, held_out: bool) -> list[dict]:
    """n preference rows (TRL's prompt/chosen/rejected as message lists) of the training or held-out countries."""
    rng = np.random.default_rng(seed)
    countries = CAPITALS[-HELD_OUT:] if held_out else CAPITALS[:-HELD_OUT]
    out = []
    for _ in range(n):
        country, city = countries[rng.integers(len(countries))]
        out.append({"prompt": [{"role": "user", "content": f"What is the capital of {country}?"}],
                    "chosen": [{"role": "assistant", "content": f"The capital of {country} is {city}."}],
                    "rejected": [{"role": "assistant", "content": REJECTED[rng.integers(len(REJECTED))].format(
                        city=city, country=country)}]})
    return out


def write(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def train_args(folder: str, steps: int, eval_every: int, mesh: str = "2x4", n_train: int = 256,
               n_eval: int = 32) -> list[str]:
    """`python -m dpjax.train` arguments of the run (its data written into `folder`)."""
    train = write(os.path.join(folder, "train.jsonl"), pairs(n_train, 0, held_out=False))
    held = write(os.path.join(folder, "held_out.jsonl"), pairs(n_eval, 1, held_out=True))
    return ["--model", "llama", "--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
            "--d-ff", "128", "--tokenizer", CHATML, "--data", f"pref:{train}", "--eval-data", f"pref:{held}",
            "--seq-len", "40", "--batch-size", "16", "--mesh", mesh, "--steps", str(steps), "--lr", "1e-4",
            "--dpo-beta", "0.1", "--eval-every", str(eval_every), "--eval-batches", str(n_eval // 16),
            "--sample-tokens", "0", "--progress", "none"]


def curves(metrics: str) -> dict:
    out = {"steps": [], "loss": [], "accuracy": [], "eval_steps": [], "eval_accuracy": [], "eval_margin": [],
           "eval_loss": []}
    with open(metrics) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                out["steps"].append(r["step"])
                out["loss"].append(r["loss"])
                out["accuracy"].append(r["accuracy"])
            elif "eval_accuracy" in r:
                out["eval_steps"].append(r["step"])
                for k in ("eval_accuracy", "eval_margin", "eval_loss"):
                    out[k].append(r[k])
    return out


def run(args, folder: str) -> dict:
    metrics = os.path.join(folder, "metrics.jsonl")
    _bench.train(train_args(folder, args.steps, args.eval_every), metrics)
    return curves(metrics)


def plot(c: dict, path: str, title: str) -> None:
    plt = _bench.pyplot(path)
    if plt is None:
        return
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(7.5, 6.0), sharex=True)
    ax.plot(c["steps"], c["accuracy"], lw=0.8, alpha=0.6, label="training batch")
    ax.plot(c["eval_steps"], c["eval_accuracy"], "o-", ms=4, label="held-out pairs (unseen countries)")
    ax.axhline(0.9, color="k", lw=0.5, ls="--")
    ax.set(ylabel="pair accuracy (margin > 0)", title=title, ylim=(-0.02, 1.02))
    bx.plot(c["steps"], c["loss"], lw=0.8, label="train loss")
    bx.plot(c["eval_steps"], c["eval_loss"], "o-", ms=4, label="held-out loss")
    bx.axhline(np.log(2), color="k", lw=0.5, ls=":", label="ln 2 (policy = reference)")
    bx.set(xlabel="step", ylabel="DPO loss (sigmoid)")
    _bench.finish_plot(fig, (ax, bx), path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--plot", default=None, help="PNG: held-out accuracy and loss over the steps")
    p.add_argument("--json", default=None, help="the curves as JSON")
    _bench.add_smoke(p, "2 steps, an evaluation after each")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.eval_every = 2, 1
        args.plot, args.json = args.plot or "dpo_accuracy.png", args.json or "dpo_accuracy.json"
        _bench.smoke_outputs(args, "plot", "json")
    load0, t0 = _bench.load_avg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dpjax-dpo-") as folder:
        c = run(args, folder)
    c.update(machine=_bench.machine(), load=load0, seconds=time.perf_counter() - t0)
    print("| step | held-out accuracy | held-out margin | held-out loss |")
    print("|---:|---:|---:|---:|")
    for s, a, m, lo in zip(c["eval_steps"], c["eval_accuracy"], c["eval_margin"], c["eval_loss"]):
        print(f"| {s} | {a:.3f} | {m:.3f} | {lo:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(c, f, indent=1)
    if args.plot:
        plot(c, args.plot, f"DPO on a 2x4 mesh: a tiny Llama learns a format ({args.steps} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
