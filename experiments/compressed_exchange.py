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

1-bit Adam (`--optimizer onebit_adam --compression onebit,start=S`, issue 31) is a row
of its own, "onebit_adam onebit,start=S": S exact AdamW steps, then Adam's variance
frozen and the momentum sent through 1-bit Adam's compressed allreduce. A row with a
start step sends the uncompressed bytes for S steps and the compressed ones after
(`dpjax.train.comm_bytes.StepBytes`: the branch each step runs); the table gives both
the bytes of a compressed step and the run's total. Every variant runs for each of
--seeds (data order and initial parameters); the table gives the mean final loss and
the spread (min-max) over the seeds. --json is rewritten after every run, so a long
sweep cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

import _bench
from update_runs import DATE, MACHINE, Bench, parameter_count

from dpjax import step as S
from dpjax.compression.accounting import compressed_bytes
from dpjax.models import get_model
from dpjax.timeline import compiled_text

METHODS = ["powersgd:1", "powersgd:2", "powersgd:4", "int8", "int4", "sign", "topk:0.01", "randk:0.01"]
ONEBIT_ADAM = ["onebit_adam onebit,start=10", "onebit_adam onebit,start=50"]
OPTIMIZER = "adamw"  # the inner optimizer of every row but the 1-bit Adam ones


def variants(methods, onebit=ONEBIT_ADAM):
    """none, the 1-bit Adam rows, then every method with error feedback and without."""
    return ["none", *onebit] + [m + suffix for m in methods for suffix in ("", ",ef=0")]


def split(variant) -> tuple[str, str]:
    """(the optimizer, the --compression) of a variant: "onebit_adam onebit,start=10"."""
    head, _, rest = variant.partition(" ")
    return (head, rest) if rest else (OPTIMIZER, head)


def run(bench, variant):
    """(the Run of sync training through `variant`, the bytes the busiest device sends in
    a compressed step and in an exact one (a start step), the formula's bytes of a
    compressed step, the run's total bytes): one compiled step serves them all."""
    import dataclasses

    import numpy as np

    from dpjax.compression import parse
    from dpjax.train.comm_bytes import StepBytes
    from update_runs import Run

    optimizer, spec = split(variant)
    bench.compression = spec
    bench.settings = dataclasses.replace(bench.settings, optimizer=optimizer)
    layout, step = bench.step("sync", donate=False)
    params, state = step.init(S.init_params(bench.model, layout, jax.random.key(bench.seed)))
    out = Run(variant, [])
    for i, batch in enumerate(bench.train):
        params, state, loss = step.train(params, state, batch)
        out.losses.append(float(loss))
        if (i + 1) % bench.eval_every == 0 or i + 1 == bench.steps:
            out.evals.append((i + 1, float(np.mean([float(step.evaluate(params, b)) for b in bench.val]))))
    sent = StepBytes(compiled_text(step.train, params, state, bench.train[0]))  # the cached program
    shapes = [tuple(x.shape) for x in jax.tree.leaves(jax.eval_shape(bench.model.init, jax.random.key(0)))]
    formula = compressed_bytes(None if spec == "none" else spec, shapes, layout.mesh.size)
    exact_steps = 0 if spec == "none" else sum(parse(spec).exact_at(t) for t in range(bench.steps))
    total = exact_steps * sent.at(False) + (bench.steps - exact_steps) * sent.at(True)
    return out, sent.at(True), sent.at(False), formula, total


def spread(values) -> str:
    return f"{min(values):.4f}-{max(values):.4f}" if len(values) > 1 else "(one seed)"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--onebit", nargs="*", default=ONEBIT_ADAM, help="the 1-bit Adam rows ('onebit_adam SPEC')")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--plot", default="experiments/plots/compression.png")
    p.add_argument("--json", help="write every run here (rewritten after each one)")
    p.add_argument("--only", nargs="+", metavar="VARIANT",
                   help="run exactly these variants (e.g. none 'sign,ef=0' 'onebit_adam onebit,start=3,refresh=2'), "
                        "not none + --onebit + --methods")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="run nothing: the table and plot of the runs these --json files hold (a variant's seeds "
                        "from every file; a seed run twice, the later file's); --json writes them merged")
    _bench.add_smoke(p, "3 steps of a d_model 16 GPT, one seed; none, 1-bit Adam from step 1, and int8 with and "
                        "without feedback")
    args = p.parse_args(argv)
    d_model = None
    if args.smoke:
        args.steps, args.methods, args.seq_len, d_model = 3, ["int8"], 16, 16
        args.onebit, args.seeds = ["onebit_adam onebit,start=1"], [0]
        args.json = args.json or "compression.json"  # so that the smoke run reads it back as --merge does
        _bench.smoke_outputs(args, "plot", "json")
    if args.merge:
        results = merged(args.merge)
        if args.json:  # the merged runs, in the same form (a later --merge can read it)
            with open(args.json, "w") as fh:
                json.dump({"args": vars(args), "results": results}, fh)
        rows = table(results, args, parameter_count(get_model("gpt", seq_len=args.seq_len)))
        plot_points(args.plot, rows, args.steps)
        return 0
    # variant -> [(seed, final eval, final train, bytes compressed step, bytes exact step, formula, total)]
    results = {}
    benches = {seed: Bench(model="gpt", mesh="8x1", batch_size=args.batch_size, seq_len=args.seq_len,
                           steps=args.steps, optimizer="adamw", lr=3e-3, clip_norm=1.0,
                           eval_every=max(1, args.steps // 10), d_model=d_model, seed=seed)
               for seed in args.seeds}  # a seed's variants share its Bench (data, initial parameters)
    for variant in args.only or variants(args.methods, args.onebit):  # every seed of a variant before the next
        for seed, bench in benches.items():
            run_, step_bytes, exact_bytes, formula, total = run(bench, variant)
            results.setdefault(variant, []).append((seed, run_.final_eval, run_.losses[-1], step_bytes, exact_bytes,
                                                    formula, total, run_.evals))
            print(f"  seed {seed} {variant:30s} final eval {run_.final_eval:.4f}  {step_bytes:>12,} B/step "
                  f"(formula {formula:,}), {total / 1e6:,.1f} MB in the run", flush=True)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({"args": vars(args), "results": results}, fh)
    rows = table(results, args, bench.gradient_elements())
    plot_points(args.plot, rows, args.steps)
    if args.smoke:  # --merge's path: the file this run wrote, read back, gives the same table
        assert table(merged([args.json]), args, bench.gradient_elements()) == rows
    return 0


def merged(paths) -> dict:
    """The results of several --json files: variant -> its runs, one a seed (the later
    file's where two hold the same seed), variants in the order first seen."""
    out: dict = {}
    for path in paths:
        with open(path) as fh:
            for variant, runs in json.load(fh)["results"].items():
                by_seed = {r[0]: r for r in out.get(variant, [])}
                by_seed.update({r[0]: r for r in runs})
                out[variant] = [by_seed[k] for k in sorted(by_seed)]
    return out


def table(results, args, n_params: int):
    """Print the markdown table (mean over the seeds, the spread) of a run of the GPT of
    `n_params` parameters; returns the plot's rows."""
    import statistics

    base = statistics.mean(r[6] for r in results["none"]) if "none" in results else None
    base_step = results["none"][0][3] if "none" in results else None
    print(f"\nMEASURED: {MACHINE}; {DATE}; gpt ({n_params:,} parameters), mesh 8x1, batch "
          f"{args.batch_size} x {args.seq_len}, adamw lr 3e-3, clip 1.0, {args.steps} steps, sync, seeds "
          f"{' '.join(map(str, sorted({r[0] for rs in results.values() for r in rs})))}\n")
    print("| variant | seeds | final eval loss (mean) | spread over seeds | vs none | final train loss (mean) | "
          "bytes of a compressed step (busiest device) | formula | x fewer a step | MB sent in the run | "
          "x fewer over the run |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    none_eval = statistics.mean(r[1] for r in results["none"]) if "none" in results else None
    for variant, rs in results.items():
        ev, tr = statistics.mean(r[1] for r in rs), statistics.mean(r[2] for r in rs)
        step_bytes, formula, total = rs[0][3], rs[0][5], statistics.mean(r[6] for r in rs)
        rel = f"{100 * (ev / none_eval - 1):+.1f}%" if none_eval else ""
        print(f"| `{variant}` | {len(rs)} | {ev:.4f} | {spread([r[1] for r in rs])} | {rel} | {tr:.4f} | "
              f"{step_bytes:,} | "
              f"{formula:,} | {base_step / step_bytes if base_step else 0:.1f} | {total / 1e6:,.1f} | "
              f"{base / total if base else 0:.1f} |")
        rows.append((variant, ev, tr, step_bytes, total))
    return rows


def plot_points(path, rows, steps):
    """One point per variant (the mean over the seeds): a colour per method, filled with
    error feedback, hollow without."""
    plt = _bench.pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    methods = list(dict.fromkeys(variant.split(",")[0] for variant, *_ in rows))
    colours = plt.get_cmap("tab10")
    first_onebit = next((v for v, *_ in rows if v.startswith("onebit_adam")), None)
    for variant, ev, _, _, total in rows:
        method = variant.split(",")[0]
        c = colours(methods.index(method) % 10)
        ef = not variant.endswith(",ef=0")
        ax.scatter([total / 1e6], [ev], s=60, color=c if ef else "none", edgecolors=c, linewidths=1.5,
                   marker="*" if variant.startswith("onebit_adam") else "o",
                   label=("1-bit Adam" if variant == first_onebit else None) if variant.startswith("onebit_adam")
                   else (method if ef or method == "none" else None))
        if variant.startswith("onebit_adam"):  # the stars share a colour: each says which it is
            ax.annotate(variant.partition(",")[2], (total / 1e6, ev), textcoords="offset points", xytext=(6, -3),
                        fontsize=7)
    ax.set_xscale("log")
    ax.set(xlabel="MB sent by the busiest device over the run (log)", ylabel="final validation loss (mean of seeds)",
           title=f"GPT on 8 devices, {steps} steps (filled: error feedback; hollow: ef=0; star: 1-bit Adam)")
    _bench.finish_plot(fig, ax, path)


if __name__ == "__main__":
    sys.exit(main())
