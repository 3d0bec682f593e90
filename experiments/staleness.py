"""Final loss against staleness for every update rule of dpjax.updates.

    python experiments/staleness.py --plot experiments/plots/staleness.png

Eight simulated workers (mesh 8x1) train the byte-level MLP on the default corpus
(the Python standard library) with Nesterov momentum SGD; for each staleness value
the run is the same data, order and initial parameters, only the rule changes:

    delayed:T          DTAW's delayed averaging with compensation (Zhu et al.)
    delayed-nocomp:T   plain delayed SGD (only the T-step-old average is applied)
    async:TAU          parameter server, gradients on copies up to TAU versions old (seeded)
    sparse:P           local SGD, parameters averaged every P steps

T, TAU in 0, 1, 2, 4, 8, 16 and P in 1, 2, 4, 8, 16, 32 (0 / 1 are sync). The loss
is the validation loss of the workers' consensus (their mean for delayed and sparse,
the server's copy for async) after the last step, the mean over --seeds.

--hybrid adds the second table: the same 8 devices as 2 sites of 4 (mesh 2x4x1,
node x data), each rule once between all 8 ranks (flat, 8 workers) and once between
the 2 sites with synchronous data parallelism inside each (`--workers node`, the
setting of training across datacenters): delayed:T, sparse:P and DiLoCo
(sparse:P,outer=0.7).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import _bench
from update_runs import DATE, MACHINE, Bench, plot

RULES = {"delayed": "delayed:{}", "delayed-nocomp": "delayed-nocomp:{}", "async": "async:{}"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--stale", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16], help="T / TAU values")
    p.add_argument("--periods", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="P values of sparse")
    p.add_argument("--seeds", type=int, default=2, help="runs per point (seeds 0..n-1: init, data order, schedule)")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--optimizer", default="momentum")
    p.add_argument("--model", default="mlp")
    p.add_argument("--quick", action="store_true", help="60 steps, T in 0 2 8, P in 1 4, one seed")
    p.add_argument("--plot", default="experiments/plots/staleness.png")
    p.add_argument("--json", help="write every run's curves here")
    p.add_argument("--hybrid", action="store_true", help="only the second table: flat rules against --workers node "
                                                         "hybrids on 2 sites of 4 devices")
    p.add_argument("--hybrid-plot", default="experiments/plots/staleness_hybrid.png")
    _bench.add_smoke(p, "4 steps, T in 0 1, P = 4, one seed")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.stale, args.periods, args.seeds = 60, [0, 2, 8], [1, 4], 1
    if args.smoke:  # P = 4: the smallest period DiLoCo (--hybrid) runs with
        args.steps, args.stale, args.periods, args.seeds = 4, [0, 1], [4], 1
        _bench.smoke_outputs(args, "plot", "json", "hybrid_plot")
    if args.hybrid:
        return hybrid(args)

    table = {}  # (rule, value) -> [final eval per seed]
    curves = []
    for seed in range(args.seeds):
        bench = Bench(model=args.model, optimizer=args.optimizer, lr=args.lr, steps=args.steps, seed=seed)
        print(f"seed {seed}", flush=True)
        jobs = [(name, t, fmt.format(t)) for name, fmt in RULES.items() for t in args.stale]
        jobs += [("sparse", P, f"sparse:{P}") for P in args.periods]
        for name, value, spec in jobs:
            run = bench.run(spec)
            table.setdefault((name, value), []).append(run.final_eval)
            curves.append({"seed": seed, "spec": spec, "evals": run.evals, "losses": run.losses})

    def mean(name, v):
        return float(np.mean(table[(name, v)]))

    def cell(name, v, base=None):
        m = mean(name, v)
        if not np.isfinite(m) or m > 20:  # above the 5.5 of a uniform guess: the run blew up
            return "diverged"
        return f"{m:.4f}" + (f" ({m - base:+.4f})" if base is not None else "")

    sync = mean("delayed", 0) if ("delayed", 0) in table else None
    print(f"\n{MACHINE}; {DATE}; {args.model}, {args.optimizer} lr {args.lr}, batch 64 over 8 workers, "
          f"{args.steps} steps, mean of {args.seeds} seed(s); validation loss (lower is better)\n")
    head = "| T / TAU | delayed (compensated) | delayed-nocomp | async |"
    print(head + "\n|---|---|---|---|")
    for t in args.stale:
        cells = [cell(n, t, sync if t else None) for n in RULES]
        print(f"| {t} | " + " | ".join(cells) + " |")
    print("\n| P | sparse (local SGD) |\n|---|---|")
    for P in args.periods:
        print(f"| {P} | {cell('sparse', P, sync if P > 1 else None)} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "table": {f"{k[0]}:{k[1]}": v for k, v in table.items()},
                       "curves": curves}, fh)
    shown = lambda n, v: mean(n, v) if cell(n, v) != "diverged" else np.nan  # noqa: E731
    series = [(f"{n}:T" if n != "async" else "async:TAU", args.stale, [shown(n, t) for t in args.stale]) for n in RULES]
    series.append(("sparse:P (x = P)", args.periods, [shown("sparse", P) for P in args.periods]))
    plot(args.plot, series, "staleness T / TAU, or period P", "validation loss after the run",
         f"Loss against staleness (8 workers, {args.model}, {args.steps} steps)", logx=True)
    return 0


def hybrid(args):
    """Each rule between 8 workers (flat) and between 2 sites of 4 synchronous devices."""
    rules = ([f"delayed:{t}" for t in args.stale if t] + [f"sparse:{p}" for p in args.periods if p > 1]
             + [f"sparse:{p},outer=0.7" for p in args.periods if p >= 4])
    table: dict = {}
    for seed in range(args.seeds):
        print(f"seed {seed}", flush=True)
        for workers in (None, "node"):
            bench = Bench(model=args.model, mesh="2x4x1", optimizer=args.optimizer, lr=args.lr, steps=args.steps,
                          seed=seed, workers=workers)
            for spec in (["sync"] if workers is None else []) + rules:
                table.setdefault((spec, workers), []).append(bench.run(spec).final_eval)
    mean = {k: float(np.mean(v)) for k, v in table.items()}
    sync = mean[("sync", None)]

    def cell(k):
        m = mean[k]
        return "diverged" if not np.isfinite(m) or m > 20 else f"{m:.4f} ({m - sync:+.4f})"

    print(f"\n{MACHINE}; {DATE}; {args.model}, {args.optimizer} lr {args.lr}, batch 64 on mesh 2x4x1, "
          f"{args.steps} steps, mean of {args.seeds} seed(s); validation loss (sync: {sync:.4f})\n")
    print("| rule | flat: 8 workers | hybrid: 2 sites x 4 (sync inside) |\n|---|---|---|")
    for spec in rules:
        print(f"| {spec} | {cell((spec, None))} | {cell((spec, 'node'))} |")
    series = []
    for kind, xs in (("delayed", [t for t in args.stale if t]), ("sparse", [p for p in args.periods if p > 1])):
        for workers, label in ((None, "flat"), ("node", "2 sites")):
            ys = [mean[(f"{kind}:{x}", workers)] for x in xs]
            series.append((f"{kind} ({label})", xs, [y if y < 20 else np.nan for y in ys]))
    plot(args.hybrid_plot, series, "delay T or period P", "validation loss after the run",
         f"Flat rules vs 2-site hybrids (8 devices, {args.model}, {args.steps} steps)", logx=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
