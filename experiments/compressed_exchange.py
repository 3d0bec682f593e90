"""Gradient compression with and without error feedback: final loss against bytes sent.

    python experiments/compressed_exchange.py --plot experiments/plots/compression.png

(Not compression.py: experiments/ is first on sys.path, and a module of that name would
shadow the `compression` package JAX imports when it starts.)

The main job's GPT (`python -m dpjax.train`'s default model: byte-level, 2 layers,
d_model 128) on 8 simulated devices, synchronous data parallelism, AdamW at the main
job's settings, the same data, initial parameters and steps for every variant; only
`--compression` changes: PowerSGD rank 1, 2, 4; int8; int4; scaled sign; top-k 1% (and
random-k 1%), each with error feedback and without (`,ef=0`). Bytes sent are what the
busiest device sends per step, read from the compiled program (`cost.hlo_comm`, what
`comm_bytes` in the metrics reports), times the steps; each method's formula
(`accounting.compressed_bytes`) is printed beside it (the program sends 14 bytes more: the
reported loss's scalar mean).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

import _bench
from update_runs import DATE, MACHINE, Bench

from dpjax import step as S
from dpjax.collectives.cost import hlo_comm
from dpjax.compression.accounting import compressed_bytes
from dpjax.timeline import compiled_text

METHODS = ["powersgd:1", "powersgd:2", "powersgd:4", "int8", "int4", "sign", "topk:0.01", "randk:0.01"]


def variants(methods):
    """none, then every method with error feedback and without."""
    return ["none"] + [m + suffix for m in methods for suffix in ("", ",ef=0")]


def run(bench, spec):
    """(the Run of sync training through `spec`, bytes the busiest device sends per step in
    the compiled train step, the formula's): one compiled step serves all three."""
    import numpy as np

    from update_runs import Run

    bench.compression = spec
    layout, step = bench.step("sync", donate=False)
    params, state = step.init(S.init_params(bench.model, layout, jax.random.key(bench.seed)))
    out = Run(spec, [])
    for i, batch in enumerate(bench.train):
        params, state, loss = step.train(params, state, batch)
        out.losses.append(float(loss))
        if (i + 1) % bench.eval_every == 0 or i + 1 == bench.steps:
            out.evals.append((i + 1, float(np.mean([float(step.evaluate(params, b)) for b in bench.val]))))
    measured = hlo_comm(compiled_text(step.train, params, state, bench.train[0])).max_bytes  # the cached program
    shapes = [tuple(x.shape) for x in jax.tree.leaves(jax.eval_shape(bench.model.init, jax.random.key(0)))]
    return out, measured, compressed_bytes(None if spec == "none" else spec, shapes, layout.mesh.size)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--plot", default="experiments/plots/compression.png")
    p.add_argument("--json")
    _bench.add_smoke(p, "3 steps of a d_model 16 GPT; none, and int8 with and without feedback")
    args = p.parse_args(argv)
    d_model = None
    if args.smoke:
        args.steps, args.methods, args.seq_len, d_model = 3, ["int8"], 16, 16
        _bench.smoke_outputs(args, "plot", "json")
    bench = Bench(model="gpt", mesh="8x1", batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
                  optimizer="adamw", lr=3e-3, clip_norm=1.0, eval_every=max(1, args.steps // 10), d_model=d_model)
    rows, curves = [], {}
    for spec in variants(args.methods):
        run_, measured, formula = run(bench, spec)
        curves[spec] = run_
        rows.append((spec, run_.final_eval, run_.losses[-1], measured, formula))
        print(f"  {spec:18s} final eval {run_.final_eval:.4f}  {measured:>12,} B/step (formula {formula:,})",
              flush=True)
    base = rows[0][3]
    print(f"\nMEASURED: {MACHINE}; {DATE}; gpt ({bench.gradient_elements():,} parameters), mesh 8x1, batch "
          f"{args.batch_size} x {args.seq_len}, adamw lr 3e-3, clip 1.0, {args.steps} steps, sync\n")
    print("| compression | final eval loss | final train loss | bytes/step (busiest device) | x fewer than none | "
          "total MB sent |\n|---|---:|---:|---:|---:|---:|")
    for spec, ev, tr, measured, _ in rows:
        print(f"| {spec} | {ev:.4f} | {tr:.4f} | {measured:,} | {base / measured:.1f} | "
              f"{measured * args.steps / 1e6:,.1f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows, "evals": {k: v.evals for k, v in curves.items()}}, fh)
    plot_points(args.plot, rows, args.steps)
    return 0


def plot_points(path, rows, steps):
    """One point per variant: a colour per method, filled with error feedback, hollow without."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"not writing {path}: matplotlib is not installed", flush=True)
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    methods = list(dict.fromkeys(spec.split(",")[0] for spec, *_ in rows))
    colours = plt.get_cmap("tab10")
    for spec, ev, _, measured, _ in rows:
        method = spec.split(",")[0]
        c = colours(methods.index(method) % 10)
        ef = not spec.endswith(",ef=0")
        ax.scatter([measured * steps / 1e6], [ev], s=60, color=c if ef else "none", edgecolors=c, linewidths=1.5,
                   label=method if ef or method == "none" else None)
    ax.set_xscale("log")
    ax.set(xlabel="MB sent by the busiest device over the run (log)", ylabel="final validation loss",
           title=f"GPT on 8 devices, {steps} steps (filled: error feedback; hollow: ef=0)")
    _bench.finish_plot(fig, ax, path)


if __name__ == "__main__":
    sys.exit(main())
