"""Packing in training (--pack): how full a step's rows are on chat-like lengths, and answer
tokens/s packed against unpacked, measured side by side in one process.

1. Efficiency, per step. Conversation lengths drawn like a chat set's (no data set can be
   downloaded here, so drawn: numpy seed 0): `lognormal` (median 300 tokens, sigma 1.0: mean
   about 490, a long tail cut to a row of --seq-len + 1 = 2,049) and `mix` (60% single-turn
   instructions, median 150, sigma 0.7; 40% multi-turn conversations, median 900, sigma 0.8).
   For each --batch-size (conversations a step) and count of data devices (which the rows
   are rounded up to: they split them), `dpjax.data.sft.PackedStream` packs every step of a
   --steps run into its fixed R rows a step (the most any step needs): the steps read in the
   seeded order (--pack-window 1) or with an epoch's steps' conversations dealt among them
   (the default, `dpjax.data.balance`), first_fit and best_fit decreasing. Beside it: the
   bound no fixed-row packer can pass (a step's tokens, in rows, over the least multiple of
   the data devices that holds them), one conversation a row, and the whole set packed at once.
2. Speed. A small Llama trained with `--task sft` on 8 simulated devices (8x1) on lengths
   like `lognormal`'s scaled to --train-seq-len: the unpacked step (--batch-size rows), the
   packed step on the seeded order and the packed step dealt are built, then timed in
   alternation (A B C A B C ...), so that the shared machine's load falls on all alike.
   Answer tokens/s is a run's answer tokens a step (mean) over its median step time. The
   unpacked run reads the dealt order, so its losses equal the dealt packed run's.

    python experiments/pack_throughput.py              # the RESULTS.md figures
    python experiments/pack_throughput.py --smoke      # tiny, seconds
    python experiments/pack_throughput.py --no-speed   # part 1 only (numpy: no compile)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import _bench

_bench.simulate(8)  # before jax starts

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dpjax import step as S  # noqa: E402
from dpjax.data import packing  # noqa: E402
from dpjax.data.sft import ExampleStream, PackedStream  # noqa: E402
from dpjax.mesh import dp_size, mesh_size  # noqa: E402
from dpjax.plan import resolve  # noqa: E402
from dpjax.train import parse_args as train_args  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--conversations", type=int, default=20000)
    p.add_argument("--seq-len", type=int, default=2048, help="part 1's rows: --seq-len + 1 tokens")
    p.add_argument("--batch-sizes", default="64,256", help="part 1: conversations a step")
    p.add_argument("--data-devices", default="1,8", help="part 1: what the rows a step are rounded up to")
    p.add_argument("--steps", type=int, default=300, help="part 1: the run's steps (windows packed)")
    p.add_argument("--train-seq-len", type=int, default=256, help="part 2's rows (lengths scaled to them)")
    p.add_argument("--train-batch", type=int, default=32, help="part 2: conversations a step")
    p.add_argument("--timed", type=int, default=8, help="part 2: timed steps of each, after one warm-up each")
    p.add_argument("--mesh", default="8x1")
    p.add_argument("--no-speed", action="store_true", help="part 1 only")
    _bench.add_smoke(p, "1,000 conversations, rows of 257, batch 16, 20 steps; part 2: rows of 64, 2 timed steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.conversations, args.seq_len, args.batch_sizes, args.steps = 1000, 256, "16", 20
        args.train_seq_len, args.train_batch, args.timed = 64, 16, 2
    return args


def lengths(kind: str, n: int, row: int, scale: float = 1.0, seed: int = 0) -> np.ndarray:
    """Chat-like lengths (the module's docstring), scaled by `scale`, at least 3 tokens, the tail cut to a row."""
    rng = np.random.default_rng(seed)
    if kind == "lognormal":
        drawn = rng.lognormal(np.log(300), 1.0, n)
    else:  # mix
        single = rng.random(n) < 0.6
        drawn = np.where(single, rng.lognormal(np.log(150), 0.7, n), rng.lognormal(np.log(900), 0.8, n))
    return np.clip(np.rint(drawn * scale).astype(int), 3, row)


def examples(ls: np.ndarray, vocab: int, seed: int = 1):
    """Random ids of those lengths, the answer the second half (what the loss counts)."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, vocab, n), np.arange(n) >= n // 2) for n in ls]


def efficiency(args) -> list[dict]:
    row, out = args.seq_len + 1, []
    scale = args.seq_len / 2048  # the smoke's shorter rows keep the lengths' shape
    for kind in ("lognormal", "mix"):
        ls = lengths(kind, args.conversations, row, scale)
        exs = [(np.ones(n, np.int32), np.arange(n) >= n // 2) for n in ls]  # part 1 reads lengths only
        whole = len(packing.first_fit(ls.tolist(), row))
        out.append({"lengths": kind, "batch_size": "whole set", "devices": "", "order": "", "method": "first_fit",
                    "rows": whole, "tokens_rows": ls.sum() / row, "bound": ls.sum() / (whole * row),
                    "efficiency": ls.sum() / (whole * row), "unpacked": ls.sum() / (len(ls) * row),
                    "median": float(np.median(ls)), "mean": float(ls.mean())})
        for b in (int(x) for x in args.batch_sizes.split(",")):
            for m in (int(x) for x in args.data_devices.split(",")):
                for deal in (1, None):
                    for method in ("first_fit", "best_fit"):
                        st = PackedStream(exs, args.seq_len, 0, window=b, deal_steps=deal, batch_size=b,
                                          method=method, steps=args.steps, multiple=m)
                        fits = math.ceil(st.rows_of_tokens / m) * m
                        out.append({"lengths": kind, "batch_size": b, "devices": m,
                                    "order": f"dealt ({st.deal_steps})" if deal is None else "seeded",
                                    "method": method, "rows": st.rows, "tokens_rows": st.rows_of_tokens,
                                    "bound": st.rows_of_tokens / fits, "efficiency": st.efficiency,
                                    "unpacked": st.unpacked_efficiency})
    return out


def build(args, name: str, exs):
    """One of the three runs: unpacked (the dealt order, one conversation a row), packed on the seeded order,
    packed dealt."""
    s = train_args(["--model", "llama", "--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
                    "--d-ff", "128", "--vocab-size", "256", "--seq-len", str(args.train_seq_len), "--data",
                    "synthetic", "--task", "sft", "--batch-size", str(args.train_batch), "--mesh", args.mesh,
                    "--optimizer", "adamw", "--lr", "1e-3"])
    plan = resolve(s, jax.devices()[:mesh_size(args.mesh)])
    step = S.for_plan(plan)
    B, steps, packed = args.train_batch, args.timed + 1, name != "unpacked"
    deal = 1 if name == "packed, seeded order" else None
    stream = (PackedStream(exs, args.train_seq_len, 0, window=B, deal_steps=deal, batch_size=B, steps=steps,
                           multiple=dp_size(plan.mesh)) if packed
              else ExampleStream(exs, args.train_seq_len, 0, window=B, deal_steps=deal))
    params, opt = step.init(S.init_params(plan.model, plan.layout, jax.random.key(0), plan.policy))
    return {"name": name, "plan": plan, "step": step, "stream": stream, "params": params, "opt": opt, "times": [],
            "losses": [], "answers": [], "rows": stream.rows if packed else B, "packed": packed,
            "efficiency": stream.efficiency if packed else None}


RUNS = ("unpacked", "packed, seeded order", "packed, dealt")


def speed(args) -> list[dict]:
    ls = lengths("lognormal", 1000, args.train_seq_len + 1, args.train_seq_len / 2048)
    exs = examples(ls, 256)
    runs = [build(args, name, exs) for name in RUNS]
    B = args.train_batch
    for i in range(args.timed + 1):  # step 0 compiles; A B C A B C ... on the same steps
        for r in runs:
            rows = r["rows"] if r["packed"] else None
            batch = S.put_batch(r["stream"], i * B, B, r["plan"].mesh, passes=1, rows=rows)
            t = time.perf_counter()
            r["params"], r["opt"], loss = r["step"].train(r["params"], r["opt"], batch)
            loss = float(loss)
            if i:
                r["times"].append(time.perf_counter() - t)
                ids = r["stream"]._example_ids(np.arange(i * B, (i + 1) * B))
                r["answers"].append(int(r["stream"].counts_NxT1[ids].sum()))
            r["losses"].append(loss)
    for r in runs:
        r["median_step_s"] = statistics.median(r["times"])
        r["answer_tokens_per_s"] = statistics.mean(r["answers"]) / r["median_step_s"]
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"machine: {_bench.machine()}; load average at start {_bench.load_avg():.1f}")
    print("| lengths | batch (conversations) | data devices | order | rule | rows a step | a step's tokens, rows "
          "| bound | real tokens / slots | one a row |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---:|")
    for r in efficiency(args):
        if r["batch_size"] == "whole set":
            print(f"| {r['lengths']} (median {r['median']:.0f}, mean {r['mean']:.0f}) | whole set | | | first_fit | "
                  f"{r['rows']:,} | {r['tokens_rows']:,.1f} | | {r['efficiency']:.2%} | {r['unpacked']:.2%} |")
            continue
        print(f"| {r['lengths']} | {r['batch_size']} | {r['devices']} | {r['order']} | {r['method']} | {r['rows']:,} | "
              f"{r['tokens_rows']:.2f} | {r['bound']:.2%} | {r['efficiency']:.2%} | {r['unpacked']:.2%} |")
    if args.no_speed:
        return 0
    runs = speed(args)
    print("\n| run | rows a step | real tokens / slots | median step s | answer tokens a step | answer tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in runs:
        eff = "" if r["efficiency"] is None else f"{r['efficiency']:.2%}"
        print(f"| {r['name']} | {r['rows']} | {eff} | {r['median_step_s']:.3f} | {statistics.mean(r['answers']):,.0f} "
              f"| {r['answer_tokens_per_s']:,.0f} |")
    for r in runs:
        print(f"losses {r['name']}:", [round(x, 5) for x in r["losses"]])
    base = runs[0]["answer_tokens_per_s"]
    print("speed-up over unpacked: " + ", ".join(f"{r['name']} {r['answer_tokens_per_s'] / base:.2f}x"
                                                 for r in runs[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
