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

    python experiments/moe_dropless.py             # the RESULTS.md figures
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
    _bench.add_smoke(p, "256 rows, 2 repetitions, one 3-step run of each form")
    args = p.parse_args(argv)
    if args.smoke:
        args.rows, args.reps, args.steps, args.runs = 256, 2, 3, 1
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


def main(argv=None) -> int:
    args = parse_args(argv)
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
