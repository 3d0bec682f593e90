"""Packing in training (--pack): how full the rows are on chat-like lengths, and answer
tokens/s packed against unpacked, measured side by side in one process.

1. Efficiency. Conversation lengths drawn log-normal like a chat set's (median 400 tokens,
   sigma 0.9, numpy seed 0; the tail cut to a row of --seq-len + 1 = 2,049). For each
   --batch-size (conversations a step), `dpjax.data.sft.PackedStream` packs every step
   window of a --steps run (first_fit and best_fit decreasing) into its fixed R rows a step
   (the most any window needs, rounded up to the 8 data devices): real tokens / slots
   computed, against one conversation a row and against packing the whole set at once.
2. Speed. A small Llama trained with `--task sft` on 8 simulated devices (8x1) on the same
   kind of lengths scaled to --train-seq-len: the unpacked step (--batch-size rows) and
   the packed step (R rows) are both built, then timed in alternation (A B A B ...) on the
   same windows, so that the shared machine's load falls on both alike. The answer tokens
   a step trains on are the same for both (the same conversations); answer tokens/s is
   their count over the median step time. Their losses are printed side by side too.

    python experiments/pack_throughput.py            # the RESULTS.md figures
    python experiments/pack_throughput.py --smoke    # tiny, seconds
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--conversations", type=int, default=4000)
    p.add_argument("--median", type=float, default=400.0, help="median conversation length, tokens")
    p.add_argument("--seq-len", type=int, default=2048, help="part 1's rows: --seq-len + 1 tokens")
    p.add_argument("--batch-sizes", default="16,64,256", help="part 1: conversations a step")
    p.add_argument("--steps", type=int, default=100, help="part 1: the run's steps (windows packed)")
    p.add_argument("--train-seq-len", type=int, default=256, help="part 2's rows (lengths scaled to them)")
    p.add_argument("--train-batch", type=int, default=32, help="part 2: conversations a step")
    p.add_argument("--timed", type=int, default=6, help="part 2: timed steps of each, after one warm-up each")
    p.add_argument("--mesh", default="8x1")
    _bench.add_smoke(p, "200 conversations, rows of 257, one batch size; part 2: rows of 64, 2 timed steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.conversations, args.seq_len, args.batch_sizes, args.steps = 200, 256, "16", 5
        args.train_seq_len, args.train_batch, args.timed = 64, 16, 2
    return args


def lengths(n: int, median: float, row: int, seed: int = 0) -> np.ndarray:
    """Log-normal lengths like a chat set's (sigma 0.9), at least 3 tokens, the tail cut to a row."""
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(median), 0.9, n)).astype(int) + 2, 3, row)


def examples(ls: np.ndarray, vocab: int, seed: int = 1):
    """Random ids of those lengths, the answer the second half (what the loss counts)."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, vocab, n), np.arange(n) >= n // 2) for n in ls]


def efficiency(args) -> list[dict]:
    row = args.seq_len + 1
    ls = lengths(args.conversations, args.median, row)
    exs = examples(ls, 256)
    whole = len(packing.first_fit(ls.tolist(), row))
    out = [{"batch_size": "whole set", "method": "first_fit", "rows": whole, "efficiency": ls.sum() / (whole * row),
            "unpacked": ls.sum() / (len(ls) * row)}]
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for method in ("first_fit", "best_fit"):
            st = PackedStream(exs, args.seq_len, 0, window=b, batch_size=b, method=method, steps=args.steps,
                              multiple=8)
            out.append({"batch_size": b, "method": method, "rows": st.rows, "efficiency": st.efficiency,
                        "unpacked": st.unpacked_efficiency})
    return out


def build(args, packed: bool, exs):
    s = train_args(["--model", "llama", "--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
                    "--d-ff", "128", "--vocab-size", "256", "--seq-len", str(args.train_seq_len), "--data",
                    "synthetic", "--task", "sft", "--batch-size", str(args.train_batch), "--mesh", args.mesh,
                    "--optimizer", "adamw", "--lr", "1e-3"])
    plan = resolve(s, jax.devices()[:mesh_size(args.mesh)])
    step = S.for_plan(plan)
    B, steps = args.train_batch, args.timed + 1
    stream = (PackedStream(exs, args.train_seq_len, 0, window=B, batch_size=B, steps=steps,
                           multiple=dp_size(plan.mesh)) if packed
              else ExampleStream(exs, args.train_seq_len, 0, window=B))
    params, opt = step.init(S.init_params(plan.model, plan.layout, jax.random.key(0), plan.policy))
    return {"plan": plan, "step": step, "stream": stream, "params": params, "opt": opt, "times": [], "losses": [],
            "rows": stream.rows if packed else B, "packed": packed}


def speed(args) -> dict:
    ls = lengths(1000, args.median * args.train_seq_len / 2048, args.train_seq_len + 1)
    exs = examples(ls, 256)
    runs = [build(args, False, exs), build(args, True, exs)]
    B, answers = args.train_batch, []
    for i in range(args.timed + 1):  # step 0 compiles; A B A B ... on the same windows
        for r in runs:
            rows = r["rows"] if r["packed"] else None
            batch = S.put_batch(r["stream"], i * B, B, r["plan"].mesh, passes=1, rows=rows)
            t = time.perf_counter()
            r["params"], r["opt"], loss = r["step"].train(r["params"], r["opt"], batch)
            loss = float(loss)
            if i:
                r["times"].append(time.perf_counter() - t)
            r["losses"].append(loss)
        ids = runs[0]["stream"]._example_ids(np.arange(i * B, (i + 1) * B))
        answers.append(int(runs[0]["stream"].counts_NxT1[ids].sum()))
    per_step = statistics.mean(answers[1:])
    out = {"answer_tokens_per_step": per_step, "packed_efficiency": runs[1]["stream"].efficiency}
    for r in runs:
        name = "packed" if r["packed"] else "unpacked"
        med = statistics.median(r["times"])
        out[name] = {"rows": r["rows"], "median_step_s": med, "answer_tokens_per_s": per_step / med,
                     "losses": r["losses"]}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"machine: {_bench.machine()}; load average at start {_bench.load_avg():.1f}")
    print("| batch (conversations) | rule | rows a step | real tokens / slots | one a row |")
    print("|---|---|---:|---:|---:|")
    for r in efficiency(args):
        print(f"| {r['batch_size']} | {r['method']} | {r['rows']:,} | {r['efficiency']:.2%} | {r['unpacked']:.2%} |")
    got = speed(args)
    print(f"\nanswer tokens a step: {got['answer_tokens_per_step']:,.0f} (mean); packed efficiency "
          f"{got['packed_efficiency']:.2%}")
    print("| run | rows a step | median step s | answer tokens/s |")
    print("|---|---:|---:|---:|")
    for name in ("unpacked", "packed"):
        g = got[name]
        print(f"| {name} | {g['rows']} | {g['median_step_s']:.3f} | {g['answer_tokens_per_s']:,.0f} |")
    print("losses unpacked:", [round(x, 5) for x in got["unpacked"]["losses"]])
    print("losses packed:  ", [round(x, 5) for x in got["packed"]["losses"]])
    print(f"speed-up: {got['packed']['answer_tokens_per_s'] / got['unpacked']['answer_tokens_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
