"""Mixtures of experts over an expert axis: the all-to-all's bytes and time against its
bound, and a MoE GPT against a dense GPT of the same active FLOPs.

1. The MoE MLP (`dpjax.models.moe`) forward and backward inside a shard_map over
   `expert=n`, once per all-to-all (`pairwise`, `bruck`: dpjax's; `xla`: lax.all_to_all).
   The bytes each device sends are read from the compiled program (`cost.hlo_comm`) and
   set against the bound: four all-to-alls a layer (dispatch and combine, forward, and
   their transposes backward), each of which must move (n-1)/n of a device's E x C x D
   buffer. Time: the median of interleaved calls, each algorithm over xla's.
2. `python -m dpjax.train` on the stdlib corpus, the same tokens: a GPT whose MLPs are E
   experts of width F with top-k routing (`--mesh data=2,expert=4`) against a dense GPT
   whose MLP is k F wide (`--mesh 8x1`): the same active matmul FLOPs per token (the
   router's D x E aside, in `flops_per_token`), E/k times the MLP parameters.

    python experiments/moe_vs_dense.py             # the RESULTS.md figures
    python experiments/moe_vs_dense.py --smoke     # tiny, seconds
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
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from dpjax.collectives.cost import hlo_comm  # noqa: E402
from dpjax.mesh import make_mesh  # noqa: E402
from dpjax.models import moe  # noqa: E402

ROOT = _bench.ROOT
SPECS = {"router_DxX": P(), "w1_XexDxF": P("expert"), "b1_XexF": P("expert"), "w2_XexFxD": P("expert"),
         "b2_XexD": P("expert")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per device in part 1")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-ff", type=int, default=128, help="an expert's width; the dense GPT's is top-k times it")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--steps", type=int, default=300, help="training steps of each GPT in part 2")
    p.add_argument("--only", choices=("alltoall", "train"), default=None)
    _bench.add_smoke(p, "256 tokens, 2 repetitions, 2 training steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.reps, args.steps = 256, 2, 2
    return args


def alltoall_rows(args) -> list[dict]:
    n, E, k, D, F, N = 4, args.experts, args.top_k, args.d_model, args.d_ff, args.tokens
    mesh = make_mesh(f"expert={n}", jax.devices()[:n])
    rng = np.random.default_rng(0)
    p = {"router_DxX": rng.standard_normal((D, E)), "w1_XexDxF": rng.standard_normal((E, D, F)) / 8,
         "b1_XexF": np.zeros((E, F)), "w2_XexFxD": rng.standard_normal((E, F, D)) / 8, "b2_XexD": np.zeros((E, D))}
    p = {name: jax.device_put(v.astype(np.float32), NamedSharding(mesh, SPECS[name])) for name, v in p.items()}
    x = jax.device_put(rng.standard_normal((n * N, D)).astype(np.float32), NamedSharding(mesh, P("expert")))
    C = moe.capacity(N, E, k, 1.25)
    bound = 4 * (n - 1) * (E * C * D * 4) // n  # four all-to-alls, each (n-1)/n of the E x C x D buffer
    fns, rows = {}, []
    for algorithm in ("xla", "pairwise", "bruck"):
        def body(p, x, algorithm=algorithm):
            f = lambda p, x: moe.moe_mlp(x, p, k=k, capacity_factor=1.25, axis="expert",  # noqa: E731
                                         algorithm=algorithm)[0].sum()
            return jax.grad(f, argnums=1)(p, x)  # the tokens' gradient: every collective is an all-to-all
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(SPECS, P("expert")), out_specs=P("expert"),
                                   check_vma=False))
        comm = hlo_comm(fn.lower(p, x).compile().as_text())
        fns[algorithm] = fn
        rows.append({"algorithm": algorithm, "steps": comm.steps, "bytes": comm.max_bytes, "bound": bound,
                     "over": comm.max_bytes / bound})
        fn(p, x).block_until_ready()
    times = {a: [] for a in fns}
    for _ in range(args.reps):  # interleaved: each round times every algorithm once
        for a, fn in fns.items():
            t0 = time.perf_counter()
            fn(p, x).block_until_ready()
            times[a].append(time.perf_counter() - t0)
    base = statistics.median(times["xla"])
    for r in rows:
        r["ms"] = 1e3 * statistics.median(times[r["algorithm"]])
        r["x xla"] = r["ms"] / (1e3 * base)
    print(f"expert=4, {E} experts top {k}, {N} tokens a device, D {D}, F {F}, capacity {C} slots; the bound "
          f"{bound / 2**20:.3f} MiB a device (4 all-to-alls of the {E} x {C} x {D} float32 buffer)")
    print("| all-to-all | collective steps | bytes a device sends (MiB) | over the bound | median ms | x xla |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['algorithm']} | {r['steps']} | {r['bytes'] / 2**20:.3f} | {r['over']:.2f} | {r['ms']:.1f} | "
              f"{r['x xla']:.2f} |")
    return rows


def train(args, mesh: str, *extra) -> dict:
    cmd = [sys.executable, "-m", "dpjax.train", "--mesh", mesh, "--steps", str(args.steps), "--batch-size", "16",
           "--seq-len", "64", "--d-model", str(args.d_model), "--n-heads", "4", "--eval-batches", "4",
           "--eval-every", "0", "--progress", "none", "--lr", "3e-3", *extra]
    env = _bench.checkout_env()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
    last = r.stdout.strip().splitlines()[-1]
    got = {k: float(v.replace(",", "")) for k, v in re.findall(r"(train loss|eval loss) ([\d.,]+)", last)}
    got["tokens/s"] = float(re.search(r"([\d.,]+) tokens/s", last).group(1).replace(",", ""))
    print(f"  {mesh} {' '.join(extra)}: {last}", flush=True)
    return got


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"load {_bench.load_avg():.1f}", flush=True)
    if args.only in (None, "alltoall"):
        alltoall_rows(args)
    if args.only in (None, "train"):
        E, k, F = args.experts, args.top_k, args.d_ff
        moe_run = train(args, "data=2,expert=4", "--experts", str(E), "--top-k", str(k), "--d-ff", str(F))
        dense_run = train(args, "8x1", "--d-ff", str(k * F))
        print(f"| GPT ({args.steps} steps, batch 16 x 64 tokens) | train loss | eval loss | tokens/s |")
        print("|---|---:|---:|---:|")
        for name, r in ((f"MoE: {E} experts of width {F}, top {k}", moe_run), (f"dense: MLP width {k * F}", dense_run)):
            print(f"| {name} | {r['train loss']:.4f} | {r['eval loss']:.4f} | {r['tokens/s']:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
