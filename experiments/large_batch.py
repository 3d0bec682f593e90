"""Large-batch training: a global batch 8x larger, with and without Goyal et al.'s rules.

    python experiments/large_batch.py --plot experiments/plots/large_batch.png

Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (2017):
multiply the batch by k, multiply the learning rate by k (linear scaling) and ramp it
up from the small-batch rate over the first steps (gradual warmup); then the large
batch reaches the small batch's accuracy in the same number of epochs.

Eight simulated workers (mesh 8x1, sync rule) train the byte-level MLP on the default
corpus with Nesterov momentum SGD (0.9), the same samples in the same order:

    small              batch B, lr eta, k*S steps       (the reference)
    large, lr eta      batch k*B, lr eta, S steps        (no scaling)
    large, k*eta       batch k*B, lr k*eta, S steps      (linear scaling, no warmup)
    large, k*eta+warm  ... ramping linearly from eta to k*eta over --warmup steps

Validation loss is compared at equal samples seen (equal epochs), for each eta in --lr
(one plot per eta: PLOT with _eta<eta> before the suffix).
"""

from __future__ import annotations

import argparse
import sys

import optax

import _bench
from update_runs import DATE, MACHINE, Bench, plot


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="small global batch B")
    p.add_argument("--k", type=int, default=8, help="batch multiplier")
    p.add_argument("--steps", type=int, default=80, help="steps S of the large batch (the small one runs k*S)")
    p.add_argument("--lr", type=float, nargs="+", default=[0.05, 0.2], help="small-batch learning rates eta")
    p.add_argument("--warmup", type=int, default=10, help="warmup steps of the large batch")
    p.add_argument("--quick", action="store_true", help="S=16, warmup 4")
    p.add_argument("--plot", default="experiments/plots/large_batch.png")
    _bench.add_smoke(p, "batch 8, k 2, S 2, one eta, warmup 1")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 16, 4
    if args.smoke:
        args.batch, args.k, args.steps, args.lr, args.warmup = 8, 2, 2, args.lr[:1], 1
        _bench.smoke_outputs(args, "plot")
    k = args.k
    samples = k * args.batch * args.steps
    print(f"{MACHINE}; {DATE}; mlp, sync over 8 workers, Nesterov momentum 0.9, {samples:,} sequences "
          f"of 32 bytes seen by every variant; validation loss (lower is better)\n")
    print("| eta | variant | loss at half the samples | final loss |\n|---|---|---|---|")
    for eta in args.lr:
        compare(args, eta, plot_path(args.plot, eta))
    return 0


def compare(args, eta, png):
    k = args.k

    def sgd(lr):
        return optax.sgd(lr, momentum=0.9, nesterov=True)

    variants = [  # (label, batch, steps, inner optimizer)
        (f"small: batch {args.batch}, lr {eta:g}", args.batch, k * args.steps, sgd(eta)),
        (f"large: batch {k * args.batch}, lr {eta:g}", k * args.batch, args.steps, sgd(eta)),
        (f"large: lr {k * eta:g} (linear scaling)", k * args.batch, args.steps, sgd(k * eta)),
        (f"large: lr {k * eta:g} + warmup {args.warmup}", k * args.batch, args.steps,
         sgd(optax.linear_schedule(eta, k * eta, args.warmup))),
    ]
    results = []
    for label, batch, steps, inner in variants:
        bench = Bench(batch_size=batch, steps=steps, eval_every=max(1, steps // 16))
        bench.inner = inner
        run = bench.run("sync", verbose=False)
        results.append((label, batch, steps, run))

    report(results, eta, k * args.batch * args.steps, png,
           f"Batch x{k}, eta {eta:g}: linear scaling and warmup (Goyal et al.), 8 workers")


def plot_path(plot: str, eta: float) -> str:
    """One picture per eta: plots/x.png -> plots/x_eta0.1.png."""
    stem, dot, ext = plot.rpartition(".")
    return f"{stem}_eta{eta:g}.{ext}" if dot else f"{plot}_eta{eta:g}"


def report(results, eta, sequences, png, title):
    """One table row per run (the loss at half the sequences and at the end) and the plot.
    results: (label, batch, steps, Run); sequences: what every run sees in all."""
    for label, batch, steps, run in results:
        at_half = min(run.evals, key=lambda e: abs(e[0] * batch - sequences // 2))[1]
        fmt = lambda v: "diverged" if not v < 20 else f"{v:.4f}"  # noqa: E731
        print(f"| {eta:g} | {label} | {fmt(at_half)} | {fmt(run.final_eval)} |", flush=True)
    series = [(label, [s * batch for s, _ in run.evals], [min(v, 6.0) for _, v in run.evals])
              for label, batch, _, run in results]
    plot(png, series, "sequences seen", "validation loss (clipped at 6)", title)


if __name__ == "__main__":
    sys.exit(main())
