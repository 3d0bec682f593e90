"""The autotuned exchange setting against the best of the full grid, measured in the same run.

    python experiments/autotune_vs_grid.py --mesh 8x1 --rounds 10 --json /tmp/autotune_8x1.json

1. A real run of `python -m dpjax.train --mesh M --allreduce auto --fusion-mb auto` (the
   `Trainer`, in this process, for exactly the steps its search takes): the search times
   each algorithm at the default cap, then each fusion cap (one per distinct bucket plan)
   for the chosen algorithm, by successive halving on the run's own steps, and keeps the
   winner; its choice and measured gain are what the run logs.
2. Right after, in the same process and on the same training state: every point of the
   grid the search chose from (each algorithm it tried x each cap it could have tried)
   runs `--rounds` more training steps, interleaved round-robin (starting point rotating),
   each step awaited; medians. The autotuned setting is a point of that grid; its median
   over the best median is the figure (the issue asks for within 5%). The best of many
   noisy medians is the luckiest, so the script also picks the best on half the rounds
   and compares on the other half (both ways), and gives the spread of the psum row,
   whose points are one program (XLA's combiner merges the psums whatever the cap): the
   noise floor of the grid on this machine.

On a CPU-only machine the mesh's devices are simulated. Load from other jobs on a shared
machine moves every point alike only within a round; the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import _bench
from _bench import median
from dpjax.mesh import mesh_size

# --smoke: the model and batch of its run (the search and the grid alike)
SMOKE_RUN = {"model": "mlp", "seq_len": 16, "batch_size": 4, "model_options": {"d_hidden": 32}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="8x1")
    p.add_argument("--rounds", type=int, default=10, help="interleaved grid rounds (steps per grid point)")
    p.add_argument("--samples", type=int, default=3, help="--autotune-samples of the search")
    p.add_argument("--data", default="stdlib")
    p.add_argument("--json", metavar="FILE", help="write every measurement as JSON")
    _bench.add_smoke(p, "mesh 2x1, a small MLP, 1 sample per candidate, 2 rounds")
    args = p.parse_args(argv)
    if args.smoke:
        args.mesh, args.rounds, args.samples = "2x1", 2, 1
        _bench.smoke_outputs(args, "json")
    _bench.simulate(mesh_size(args.mesh))
    import jax

    from dpjax.train.autotune import Setting
    from dpjax.train import Settings, Trainer

    load = [os.getloadavg()]
    cfg = Settings(mesh=args.mesh, allreduce="auto", fusion_mb="auto", steps=10**6, eval_every=0,
                      eval_batches=1, progress="log", data=args.data, autotune_samples=args.samples,
                      **(SMOKE_RUN if args.smoke else {}))
    trainer = Trainer(cfg)
    cfg.steps = trainer.start + trainer.parts.autotune.tuner.budget  # exactly the search
    t0 = time.time()
    trainer.run()
    search_s = time.time() - t0
    auto = trainer.record["autotune"]
    chosen = Setting(auto["allreduce"], auto["fusion_mb"])
    algorithms = [s.split("@")[0] for s in auto["stages"][0]["medians_ms"]]
    caps = sorted({float(s.split("@")[1]) for s in auto["stages"][-1]["medians_ms"]}, reverse=True)
    grid = [Setting(a, c) for a in algorithms for c in caps]
    print(f"search: {chosen} after {auto['steps']} steps ({search_s:.0f} s); grid {len(algorithms)} x {len(caps)}",
          flush=True)

    def step(setting):
        batch = trainer.batch()  # placed before the clock starts: the step is what is timed
        t = time.perf_counter()
        trainer.params, trainer.opt_state, loss = trainer.step_for(setting).train(trainer.params,
                                                                                  trainer.opt_state, batch)
        jax.block_until_ready((trainer.params, trainer.opt_state, loss))
        return time.perf_counter() - t

    t0 = time.time()
    for s in grid:  # compiles what the search did not
        step(s)
    compile_s = time.time() - t0
    load.append(os.getloadavg())
    # every point one step a round, the starting point rotating
    secs = _bench.interleave({s: (lambda i, s=s: step(s)) for s in grid}, args.rounds)
    ms = {s: [t * 1e3 for t in v] for s, v in secs.items()}
    load.append(os.getloadavg())
    med = {s: median(v) for s, v in ms.items()}
    best = min(med, key=med.get)
    ratio = med[chosen] / med[best]
    # The best of 35 noisy medians is biased low (it is the luckiest): also pick the best
    # on half the rounds and compare on the other half, both ways.
    held_out = []
    for pick, judge in ((range(0, args.rounds, 2), range(1, args.rounds, 2)),
                        (range(1, args.rounds, 2), range(0, args.rounds, 2))):
        b = min(grid, key=lambda s: median(ms[s][r] for r in pick))
        held_out.append({"best_on_other_half": str(b), "ratio": median(ms[chosen][r] for r in judge)
                         / median(ms[b][r] for r in judge)})
    # The noise floor: psum at every cap is one program up to the packing (XLA's combiner
    # merges the psums), so their spread is what this machine's load alone does.
    same = [med[s] for s in grid if s.algorithm == "psum"]
    floor = max(same) / min(same) if same else None
    lines = ["| algorithm | " + " | ".join(f"{c:g} MiB" for c in caps) + " |",
             "|---|" + "---:|" * len(caps)]
    for a in algorithms:
        cells = []
        for c in caps:
            s = Setting(a, c)
            mark = ("**" if s == best else "") + ("(auto) " if s == chosen else "")
            cells.append(f"{mark}{med[s]:.1f}{'**' if s == best else ''}")
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(f"\n{table}\n\nautotuned {chosen}: {med[chosen]:.1f} ms; best of the grid {best}: {med[best]:.1f} ms; "
          f"ratio {ratio:.3f}; held out {[round(h['ratio'], 3) for h in held_out]} (best picked on the other half: "
          f"{[h['best_on_other_half'] for h in held_out]}); psum at every cap (one program) spreads "
          f"{'-' if floor is None else f'{floor:.3f}'}x; search gain over ring@64 {auto['gain']}; "
          f"load {load}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M"), "mesh": args.mesh,
                       "autotune": auto, "search_seconds": search_s, "grid_compile_seconds": compile_s,
                       "rounds": args.rounds, "grid_ms": {str(s): v for s, v in ms.items()},
                       "grid_median_ms": {str(s): m for s, m in med.items()}, "best": str(best),
                       "chosen": str(chosen), "ratio": ratio, "held_out": held_out, "psum_spread": floor,
                       "load_1_5_15": load, "table": table}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
