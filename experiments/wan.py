"""Training across a WAN, simulated: loss against wall-clock for sync, delayed and sparse.

    python experiments/wan.py --plot experiments/plots/wan.png

A SIMULATION from measured compute plus the alpha-beta model, not a measurement on
a WAN. The losses are real (8 simulated workers train the byte-level MLP on the
default corpus, one run per rule); the wall-clock is modelled per step from

    compute  the measured median time of one worker's step alone (its slice of the
             batch on one device: loss, gradient, optimizer; no communication);
    comm     `dpjax.collectives.cost.schedule(algorithm, 8, parameters).time(link)`:
             the allreduce of the gradient (or of the parameters, for sparse),
             latency * steps + bytes sent by the busiest worker / bandwidth.

Per step:
    sync         compute + comm                      (no overlap)
    delayed:T    max(compute, comm / T, bytes / bandwidth)
                 (the allreduce of step i is issued at step i and needed at step
                 i+T; T of them are in flight at once, sharing the bandwidth)
    sparse:P     compute + comm / P                  (one exchange every P steps)

The links are the ones "Distributed Training Across the World" (Zhu et al.) quotes
for long-haul connections (latency / bandwidth), plus a datacenter link for scale;
the 140 ms link's bandwidth is not given there and is assumed (marked *).
"""

from __future__ import annotations

import argparse
import json
import sys

from update_runs import DATE, MACHINE, Bench, plot

from dpjax.collectives.cost import Link, schedule

LINKS = {  # name -> (ms, Mbps)
    "datacenter 0.01 ms / 10 Gbps": (0.01, 10_000),
    "35 ms / 63 Mbps": (35, 63),
    "140 ms / 40 Mbps*": (140, 40),
    "183 ms / 23 Mbps": (183, 23),
    "277 ms / 13 Mbps": (277, 13),
}
DEFAULT_RULES = ["sync", "delayed:4", "delayed:16", "sparse:8", "sparse:32", "sparse:32,outer=0.7"]


def step_seconds(spec: str, compute: float, comm: float, bw_part: float) -> float:
    kind, _, rest = spec.partition(":")
    n = int(rest.split(",")[0]) if rest else 0
    if kind == "sync" or n == 0 or (kind == "sparse" and n == 1):
        return compute + comm
    if kind.startswith("delayed"):
        return max(compute, comm / n, bw_part)
    if kind == "sparse":
        return compute + comm / n
    raise ValueError(f"no time model for {spec!r}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rules", nargs="+", default=DEFAULT_RULES)
    p.add_argument("--algorithm", default="ring", help="allreduce whose schedule the links carry")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--optimizer", default="momentum")
    p.add_argument("--target", type=float, help="target validation loss (default: sync's final loss + 1%%)")
    p.add_argument("--quick", action="store_true", help="80 steps, sync / delayed:4 / sparse:8")
    p.add_argument("--plot", default="experiments/plots/wan.png", help="loss against simulated time, one link")
    p.add_argument("--plot-link", default="183 ms / 23 Mbps")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rules = 80, ["sync", "delayed:4", "sparse:8"]

    bench = Bench(optimizer=args.optimizer, lr=args.lr, steps=args.steps, eval_every=10, algorithm=args.algorithm)
    runs = {spec: bench.run(spec) for spec in args.rules}
    compute = min(bench.compute_seconds(reps=30) for _ in range(3))  # the median, taken 3 times: the quietest
    nelems = bench.gradient_elements()
    sched = schedule(args.algorithm, 8, nelems, 4)
    target = args.target or round(runs.get("sync", next(iter(runs.values()))).final_eval * 1.01, 4)

    print(f"\nSIMULATION (measured compute + alpha-beta model). {MACHINE}; {DATE}; mlp, {nelems:,} "
          f"parameters ({4 * nelems / 2**20:.2f} MiB float32), {args.algorithm} allreduce over 8 workers: "
          f"{sched.steps} steps, {sched.bytes:,} bytes sent by the busiest worker; compute {1e3 * compute:.2f} "
          f"ms/step (median of 30, one worker alone); target validation loss {target}\n")
    steps_to = {spec: r.steps_to(target) for spec, r in runs.items()}
    print("| rule | final loss | steps to target |\n|---|---|---|")
    for spec, r in runs.items():
        print(f"| {spec} | {r.final_eval:.4f} | {steps_to[spec] or 'not reached'} |")
    print("\nSimulated time to the target loss (s; per-step ms in brackets):\n")
    print("| link | " + " | ".join(args.rules) + " |\n|---|" + "---|" * len(args.rules))
    per_link = {}
    for name, (ms, mbps) in LINKS.items():
        link = Link.from_ms_mbps(ms, mbps)
        comm, bw = sched.time(link), sched.bytes / link.bandwidth
        cells = []
        for spec in args.rules:
            t = step_seconds(spec, compute, comm, bw)
            s = steps_to[spec]
            per_link.setdefault(name, {})[spec] = {"step_s": t, "to_target_s": None if s is None else s * t}
            cells.append(("not reached" if s is None else f"{s * t:,.1f}") + f" ({1e3 * t:,.1f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "compute_s": compute, "target": target, "links": per_link,
                       "evals": {s: r.evals for s, r in runs.items()}}, fh)
    ms, mbps = LINKS[args.plot_link]
    link = Link.from_ms_mbps(ms, mbps)
    series = []
    for spec, r in runs.items():
        t = step_seconds(spec, compute, sched.time(link), sched.bytes / link.bandwidth)
        series.append((spec, [s * t for s, _ in r.evals], [v for _, v in r.evals]))
    plot(args.plot, series, f"simulated wall-clock (s) on a {args.plot_link} link",
         "validation loss", "SIMULATION: measured compute + alpha-beta model (8 workers)", logx=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
