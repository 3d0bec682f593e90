"""Adasum against averaging at large batch (Maleki et al., MLSys 2021).

    python experiments/adasum_large_batch.py --batch 8 --lr 0.1 0.5 --plot experiments/plots/adasum.png

Maleki et al., "Scaling Distributed Training with Adaptive Summation": combining the
workers' updates with Adasum instead of their average keeps convergence when the
batch (the number of workers) grows, without retuning the learning rate. Where the
workers' gradients are orthogonal Adasum adds them (the step a worker would take
alone, n times); where they agree it averages them. Horovod's advice follows: with
Adasum and SGD, keep the single worker's learning rate.

Eight simulated workers (mesh 8x1) train the byte-level MLP on the default corpus with
plain SGD (no momentum, so no per-worker optimizer state: with op="adasum" each worker
steps on its own gradient and the updates are combined, as Horovod's Adasum optimizer
does), every variant on the same samples in the same order:

    small              global batch B, lr eta, k*S steps          (the reference)
    average            batch k*B, lr eta, S steps                  (no scaling)
    average, k*eta     batch k*B, lr k*eta, S steps                (linear scaling)
    adasum             batch k*B, lr eta, S steps; Adasum of the 8 workers' updates
    adasum, k*eta      batch k*B, lr k*eta, S steps

Validation loss at half and at all of the samples (equal epochs).
"""

from __future__ import annotations

import argparse
import datetime
import sys

import _bench
from large_batch import plot_path, report
from update_runs import MACHINE, Bench


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="small global batch B")
    p.add_argument("--k", type=int, default=8, help="batch multiplier (per worker: B * k / 8)")
    p.add_argument("--steps", type=int, default=80, help="steps S of the large batch (the small one runs k*S)")
    p.add_argument("--lr", type=float, nargs="+", default=[0.5, 2.0], help="small-batch learning rates eta")
    p.add_argument("--quick", action="store_true", help="S=16")
    p.add_argument("--plot", default="experiments/plots/adasum.png")
    _bench.add_smoke(p, "batch 8, k 2, S 2, one eta")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 16
    if args.smoke:
        args.batch, args.k, args.steps, args.lr = 8, 2, 2, args.lr[:1]
        _bench.smoke_outputs(args, "plot")
    samples = args.k * args.batch * args.steps
    print(f"{MACHINE}; {datetime.date.today()}; mlp, 8 workers, plain SGD, {samples:,} sequences of 32 bytes "
          f"seen by every variant; validation loss (lower is better)\n")
    print("| eta | variant | loss at half the samples | final loss |\n|---|---|---|---|")
    for eta in args.lr:
        compare(args, eta, plot_path(args.plot, eta))
    return 0


def compare(args, eta, png):
    k = args.k
    variants = [  # (label, batch, steps, lr, op)
        (f"small: batch {args.batch}, lr {eta:g}", args.batch, k * args.steps, eta, "mean"),
        (f"average: batch {k * args.batch}, lr {eta:g}", k * args.batch, args.steps, eta, "mean"),
        (f"average: lr {k * eta:g} (linear scaling)", k * args.batch, args.steps, k * eta, "mean"),
        (f"adasum: batch {k * args.batch}, lr {eta:g}", k * args.batch, args.steps, eta, "adasum"),
        (f"adasum: lr {k * eta:g}", k * args.batch, args.steps, k * eta, "adasum"),
    ]
    results = []
    for label, batch, steps, lr, op in variants:
        # Every variant the sync rule; Adasum's runs over its own butterfly.
        bench = Bench(batch_size=batch, steps=steps, eval_every=max(1, steps // 16), optimizer="sgd", lr=lr,
                      algorithm="butterfly" if op == "adasum" else "ring", options={"op": op})
        run = bench.run("sync", verbose=False)
        results.append((label, batch, steps, run))

    report(results, eta, k * args.batch * args.steps, png,
           f"Batch x{k}, eta {eta:g}: Adasum against averaging, 8 workers, SGD")


if __name__ == "__main__":
    sys.exit(main())
