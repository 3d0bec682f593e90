"""The dropless mixture against the capacity form: its grouped matmul's two forms on this
backend, and a MoE GPT's training tokens/s in both forms, side by side in one run.

1. `moe_dropless.grouped_matmul` on M sorted rows over E groups (random sizes), forward
   and forward + gradient: `jax.lax.ragged_dot` against the segment form (tiles of one
   expert each, empty ones skipped). The median of interleaved calls. This picks the
   default form per backend (`moe_dropless.default_form`).
2. `python -m dpjax.train` on the stdlib corpus, a GPT whose MLPs are E experts (top k)
   on --mesh data=2,expert=4: `--moe capacity --capacity-factor 1.25` and `--moe dropless`,
   run alternately (capacity, dropless, capacity, ...), each run's tokens/s and the
   median per form; beside them each form's all-to-all bytes a device and layer from the
   cost model (dispatch and combine, forward and backward; dropless adds its counts).
3. `--hf FAMILY` (mixtral or qwen3_moe): instead of 1 and 2, the tiny model of
   tests/fixtures/FAMILY_tiny (transformers' own random weights, 8 experts, top 2)
   trained in this process in four variants, dropless and capacity factor 1.25 on 8x1
   (every expert on every device) and on data=2,expert=4, one step of each in turn
   (`_bench.interleave`) from the same weights on the same batches: each variant's
   median step time, tokens/s, the capacity form's share of choices dropped, and the
   ratio of each to the capacity form on its layout (the same-round paired ratio too).

    python experiments/moe_dropless.py             # the RESULTS.md figures
    python experiments/moe_dropless.py --hf mixtral --rounds 15
    python experiments/moe_dropless.py --smoke     # tiny, one run of each form
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

import _bench

_bench.simulate(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dpjax.collectives.cost import schedule  # noqa: E402
from dpjax.models import moe, moe_dropless  # noqa: E402

ROOT = _bench.ROOT


LAYOUTS = ("8x1", "data=2,expert=4")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rows", type=int, default=4096, help="part 1: sorted rows")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-ff", type=int, default=128, help="an expert's width")
    p.add_argument("--reps", type=int, default=7, help="part 1: timed calls of each form")
    p.add_argument("--steps", type=int, default=60, help="part 2: training steps a run")
    p.add_argument("--runs", type=int, default=2, help="part 2: runs of each form, alternating")
    p.add_argument("--only", choices=("matmul", "train"), default=None)
    p.add_argument("--hf", choices=("mixtral", "qwen3_moe"), default=None,
                   help="part 3 alone: the fixture's model, both forms on 8x1 and data=2,expert=4")
    p.add_argument("--rounds", type=int, default=15, help="part 3: timed rounds (a step of each variant each)")
    p.add_argument("--batch-size", type=int, default=64, help="part 3: global batch (rows)")
    p.add_argument("--seq-len", type=int, default=32, help="part 3: tokens a row")
    _bench.add_smoke(p, "256 rows, 2 repetitions, one 3-step run of each form; --hf: 2 rounds of batch 16 on "
                        "data=2,expert=4 alone (8x1's step is the same code without the all-to-alls)")
    args = p.parse_args(argv)
    args.layouts = LAYOUTS
    if args.smoke:
        args.rows, args.reps, args.steps, args.runs = 256, 2, 3, 1
        args.rounds, args.batch_size, args.layouts = 2, 16, LAYOUTS[1:]
    return args


def matmul_rows(args) -> list[dict]:
    M, D, F, E = args.rows, args.d_model, args.d_ff, args.experts
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((E, D, F)) / 8, jnp.float32)
    sizes = jnp.asarray(np.bincount(rng.integers(0, E, M), minlength=E), jnp.int32)
    fns = {}
    for form in moe_dropless.FORMS:
        def f(x, w, form=form):
            return moe_dropless.grouped_matmul(x, w, sizes, form)
        fns[(form, "forward")] = jax.jit(f)
        fns[(form, "with gradient")] = jax.jit(jax.grad(lambda x, w, f=f: f(x, w).sum(), argnums=(0, 1)))
    for fn in fns.values():
        jax.block_until_ready(fn(x, w))
    times = {key: [] for key in fns}
    for _ in range(args.reps):  # interleaved: each round times every variant once
        for key, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x, w))
            times[key].append(time.perf_counter() - t0)
    print(f"{M} rows, D {D}, F {F}, {E} groups on {jax.default_backend()} (load {_bench.load_avg():.1f})")
    print("| grouped matmul | forward ms | forward + gradient ms |")
    print("|---|---:|---:|")
    rows = []
    for form in moe_dropless.FORMS:
        r = {"form": form, **{kind: 1e3 * statistics.median(times[(form, kind)]) for kind in ("forward",
                                                                                            "with gradient")}}
        rows.append(r)
        print(f"| {form} | {r['forward']:.1f} | {r['with gradient']:.1f} |")
    return rows


def bytes_per_layer(form: str, N: int, E: int, k: int, D: int, n: int = 4) -> int:
    """A device's all-to-all bytes a layer (4 all-to-alls of float32 rows; dropless's counts too)."""
    if form == "capacity":
        buf = E * moe.capacity(N, E, k, 1.25) * D
        return 4 * schedule("pairwise", n, buf, 4, primitive="all_to_all").bytes
    rows = moe_dropless.row_bytes(N, k, E // n, n, D, 4) // 4
    return 4 * schedule("pairwise", n, rows, 4, primitive="all_to_all").bytes + schedule(
        "pairwise", n, E, 4, primitive="all_to_all").bytes


def train(args, form: str) -> float:
    cmd = [sys.executable, "-m", "dpjax.train", "--mesh", "data=2,expert=4", "--steps", str(args.steps),
           "--batch-size", "16", "--seq-len", "64", "--d-model", str(args.d_model), "--n-heads", "4",
           "--d-ff", str(args.d_ff), "--experts", str(args.experts), "--top-k", str(args.top_k), "--moe", form,
           "--capacity-factor", "1.25", "--eval-every", "0", "--progress", "none", "--lr", "3e-3"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_bench.checkout_env(), cwd=ROOT, timeout=3600)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
    last = r.stdout.strip().splitlines()[-1]
    print(f"  {form}: {last}", flush=True)
    return float(re.search(r"([\d.,]+) tokens/s", last).group(1).replace(",", ""))


def hf_steps(args) -> dict:
    """{(layout, form): (step(round) -> seconds, dropped shares)}: the fixture's model in
    each form on each layout, from the same weights, on round r's batch (drawn before the
    timing starts)."""
    import dataclasses
    import os

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dpjax import make_mesh
    from dpjax import step as S
    from dpjax.hf.load import load_params, model_from_hf
    from dpjax.mesh import data_axes
    from dpjax.optim import OptimizerConfig
    from dpjax.sharding import make_layout

    folder = os.path.join(ROOT, "tests", "fixtures", f"{args.hf}_tiny")
    base, _ = model_from_hf(folder, seq_len=args.seq_len)
    rng = np.random.default_rng(0)
    batches = rng.integers(0, base.config.vocab_size, (args.rounds + 1, 1, args.batch_size, args.seq_len + 1))
    steps = {}
    for spec in args.layouts:
        mesh = make_mesh(spec, jax.devices()[:8])
        for form in ("capacity", "dropless"):
            model = type(base)(dataclasses.replace(base.config, moe=form, capacity_factor=1.25))
            layout = make_layout(model, mesh)
            step = S.for_model(model, layout, global_batch=args.batch_size,
                               opt=OptimizerConfig(name="momentum", lr=0.1), donate=False)
            put = NamedSharding(mesh, P(None, data_axes(mesh)))
            held = {"state": step.init(load_params(folder, model, layout)), "dropped": []}
            placed = [jax.device_put(b.astype(np.int32), put) for b in batches]

            def one(r, step=step, held=held, placed=placed):
                params, state = held["state"]
                out = jax.block_until_ready(step.train(params, state, placed[r]))
                held["state"] = out[:2]
                if len(out) > 3:  # the model's figures: router losses, share of choices dropped
                    held["dropped"].append(float(out[3]["dropped"]))
                return None

            steps[(spec, form)] = (one, held["dropped"])
    return steps


def hf_rows(args) -> list[dict]:
    """Part 3: the interleaved step times of the four variants, and their table."""
    steps = hf_steps(args)
    N = args.batch_size * args.seq_len
    before = _bench.load_avg()
    t0 = time.perf_counter()
    for fn, _ in steps.values():  # the compiles, and round 0's step, untimed
        fn(args.rounds)
    print(f"compiled {len(steps)} steps in {time.perf_counter() - t0:.0f} s", flush=True)
    times = _bench.interleave({key: fn for key, (fn, _) in steps.items()}, args.rounds)
    after = _bench.load_avg()
    print(f"{args.hf} (tests/fixtures/{args.hf}_tiny), global batch {args.batch_size} x {args.seq_len} tokens, "
          f"{args.rounds} interleaved rounds on {_bench.machine()}; load {before:.1f} before, {after:.1f} after")
    print("| layout | form | median step ms (p25-p75) | tokens/s | x capacity (medians) | x capacity (paired) | "
          "choices dropped |")
    print("|---|---|---:|---:|---:|---:|---:|")
    rows = []
    for (spec, form), (_, dropped) in steps.items():
        base = times[(spec, "capacity")]
        ms = _bench.summary_ms(times[(spec, form)], base)
        r = {"layout": spec, "form": form, **ms, "tokens_per_s": N / (ms["median_ms"] / 1e3),
             "dropped": statistics.median(dropped) if dropped else 0.0}
        rows.append(r)
        print(f"| {spec} | {form} | {ms['median_ms']:.0f} ({ms['p25_ms']:.0f}-{ms['p75_ms']:.0f}) | "
              f"{r['tokens_per_s']:,.0f} | {ms['ratio']:.2f} | {ms['paired_ratio']:.2f} | {r['dropped']:.1%} |")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.hf:
        hf_rows(args)
        return 0
    if args.only in (None, "matmul"):
        matmul_rows(args)
    if args.only in (None, "train"):
        print(f"load {_bench.load_avg():.1f}", flush=True)
        got = {"capacity": [], "dropless": []}
        for _ in range(args.runs):
            for form in got:
                got[form].append(train(args, form))
        print(f"load {_bench.load_avg():.1f}")
        N = 16 * 64 // 8  # a device's tokens: batch 16 x 64 over 8 devices
        print(f"| GPT, {args.experts} experts top {args.top_k}, data=2,expert=4, {args.steps} steps | tokens/s "
              f"(each run) | median | all-to-all bytes a device and layer |")
        print("|---|---:|---:|---:|")
        for form, runs in got.items():
            name = "capacity factor 1.25" if form == "capacity" else "dropless"
            print(f"| {name} | {', '.join(f'{t:,.0f}' for t in runs)} | {statistics.median(runs):,.0f} | "
                  f"{bytes_per_layer(form, N, args.experts, args.top_k, args.d_model):,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
