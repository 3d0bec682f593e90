"""Long sequences over a context axis: per-device memory and tokens/s against the sequence
length, with the sequence split over C = 1, 2, 4, 8 devices (`dpjax.compute.context`).

Each (T, C) is planned and built the way `python -m dpjax.train --mesh context=C` builds it
(`dpjax.plan.resolve` -> `dpjax.step.for_plan`): the batch's sequences split into 2C chunks,
ring (or all-gather) attention across the axis. The per-device memory is XLA's memory
analysis of the compiled train step (arguments + temporaries); a (T, C) whose program
needs more than the budget is compiled but not run ("a sequence that does not fit on one
device trains on eight"). The others train a few steps; tokens/s counts the global batch's
tokens over the median step time.

    python experiments/context_scaling.py                  # the RESULTS.md table
    python experiments/context_scaling.py --smoke          # tiny, seconds

Simulated CPU devices share the host's cores, so tokens/s here shows the cost of the
ring's extra steps, not a speed-up; the memory per device is what each device's program
plans for, as on GPUs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import _bench

_bench.simulate(8)  # before jax starts

import jax  # noqa: E402

from dpjax import step as S  # noqa: E402
from dpjax.data import make_streams  # noqa: E402
from dpjax.plan import resolve  # noqa: E402
from dpjax.settings import Settings  # noqa: E402

MiB = 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq-lens", default="512,1024,2048,4096")
    p.add_argument("--contexts", default="1,2,4,8")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step (one data rank)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
    p.add_argument("--attention", default="ring", help="--context-attention")
    p.add_argument("--budget-mib", type=float, default=512.0, help="per-device memory budget")
    _bench.add_smoke(p, "T 32, C 1 (over a 0.3 MiB budget: compiled only) and 2 (run), 1 step")
    args = p.parse_args(argv)
    if args.smoke:
        args.seq_lens, args.contexts, args.steps, args.d_model, args.budget_mib = "32", "1,2", 1, 16, 0.3
    return args


def measure(T: int, C: int, args) -> dict:
    s = Settings(mesh=f"context={C}", data="synthetic", batch_size=args.batch_size, seq_len=T,
                 context_attention=args.attention, optimizer="adamw",
                 model_options={"d_model": args.d_model, "n_heads": args.n_heads, "n_layers": args.n_layers,
                                "d_ff": 4 * args.d_model})
    plan = resolve(s, jax.devices()[:C])
    step = S.for_plan(plan, donate=False)
    params, state = step.init(S.init_params(plan.model, plan.layout, jax.random.key(0)))
    train, _ = make_streams("synthetic", T, 0)
    batch = S.put_batch(train, 0, args.batch_size, plan.mesh, passes=1)
    mem = step.train.lower(params, state, batch).compile().memory_analysis()
    total = (mem.argument_size_in_bytes + mem.temp_size_in_bytes) / MiB
    row = {"T": T, "C": C, "memory": total, "temp": mem.temp_size_in_bytes / MiB, "fits": total <= args.budget_mib,
           "tokens/s": None, "loss": None}
    if row["fits"]:
        times = []
        for i in range(args.steps + 1):
            b = S.put_batch(train, i * args.batch_size, args.batch_size, plan.mesh, passes=1)
            t0 = time.perf_counter()
            params, state, loss = step.train(params, state, b)
            row["loss"] = float(loss)  # waits for the step
            if i:
                times.append(time.perf_counter() - t0)
        row["tokens/s"] = args.batch_size * T / statistics.median(times) if times else None
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    seq_lens = [int(x) for x in args.seq_lens.split(",")]
    contexts = [int(x) for x in args.contexts.split(",") if int(x) <= len(jax.devices())]
    print(f"GPT d_model {args.d_model}, {args.n_layers} layers, {args.n_heads} heads; batch {args.batch_size}; "
          f"{args.attention} attention; budget {args.budget_mib:g} MiB per device; load {_bench.load_avg():.1f}",
          flush=True)
    rows = []
    for T in seq_lens:
        for C in contexts:
            if T % (2 * C):
                continue
            row = measure(T, C, args)
            rows.append(row)
            speed = f"{row['tokens/s']:,.0f} tok/s" if row["tokens/s"] else "compiled only (over the budget)"
            print(f"  T {T:>6} C {C}: {row['memory']:8.1f} MiB per device (temporaries {row['temp']:.1f}), {speed}",
                  flush=True)
    print()
    print(f"| T | context C | per-device memory (MiB) | within {args.budget_mib:g} MiB | tokens/s |")
    print("|---:|---:|---:|---|---:|")
    for r in rows:
        speed = f"{r['tokens/s']:,.0f}" if r["tokens/s"] else "(compiled only)"
        print(f"| {r['T']} | {r['C']} | {r['memory']:.1f} | {'yes' if r['fits'] else 'no'} | {speed} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
