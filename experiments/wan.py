"""Training across a WAN, measured: real runs over emulated links, beside the alpha-beta prediction.

    python experiments/wan.py --plot experiments/plots/wan.png

Eight simulated devices as two sites of four (mesh 2x4x1: node x data) train the
byte-level MLP on the default corpus. The link between the sites (the `node` axis) is
emulated by `dpjax.links` (`dpjax.train --link node=183ms,23mbit`): every collective
that crosses it waits, inside the running program, for the latency and the bytes of
its steps that cross; everything else (the computation, the collectives on this
machine, the loop) is real, and the values are exactly those of the run without
links. The variants:

    sync, hierarchical   the gradient average every step; inside each site first, only
                         1/4 of it crosses (2 ring steps over the 2 sites)
    sync, flat ring      the same average as one ring over all 8 devices: its 14 steps
                         all cross (the ring passes the site boundary at every step)
    delayed:4, flat      DTAW between all 8 devices (ring over 8, 4 steps to arrive)
    delayed:4 / sparse:P / DiLoCo, sites
                         the rule between the 2 sites (`--workers node`), synchronous
                         data parallelism inside each site

The time to the target loss (the hierarchical sync's final validation loss + 1%) is
the wall-clock of the training steps up to the evaluation that reaches it
(evaluations are done on the side, outside the emulation). A run that would take
longer than --budget seconds is timed over its first --cap steps and extrapolated
(marked ~), after one cycle of the rule untimed, over whole cycles. The prediction beside
it: the measured compute of a step without links
plus the alpha-beta time of what crosses the link (`cost.schedule`), per step
    sync         compute + comm
    delayed:T    max(compute, comm / T, bytes / bandwidth)
    sparse:P     compute + comm / P
The links are those "Distributed Training Across the World" (Zhu et al.) quotes, and
a datacenter link for scale.

--gpt: the main job's GPT (byte-level, 2 layers, d_model 128; AdamW 3e-3, clip 1.0,
batch 32 x 128) in place of the MLP, and the compressed exchanges between the sites
(issue 20: `--compression ... --compress-axes node`, exact inside each site): sync,
delayed:T, sparse:P and DiLoCo with PowerSGD, int8 / int4, random-k on the link, in the
per-shard form (each device of a site sends its quarter of the site's gradient across;
", whole": every device the whole gradient, for comparison); 1-bit Adam between the sites
("sync onebit_adam, sites": `--optimizer onebit_adam --compression onebit,start=10
--compress-axes node`, issue 31); `--d-model` for a wider GPT. The goal: over 183 ms /
23 Mbit/s, reach the target loss of sync on the datacenter link in at most 1.0x (issue 31; 1.25x in issue 20) the
datacenter run's time; the last line says what the best variant reaches. A compressed
variant's prediction charges the ring's latencies over the 2 sites and the method's
bytes (`accounting.compressed_bytes`): a lower bound (PowerSGD chains three allreduces).

--clock virtual (the default with --gpt) runs the emulated wire on a `dpjax.links.VirtualTime`:
before each step the clock moves by the variant's compute a step (measured without
links), and the waits for the wire move it on. No step sleeps, every run goes to its
target, and the wire's share does not depend on the machine's load (the compute does).
--clock real measures wall-clock over sleeping links (the earlier method).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

import _bench
from update_runs import DATE, MACHINE, Bench, plot

from dpjax import step as S
from dpjax.collectives.cost import Link, schedule
from dpjax.compression.accounting import compressed_bytes
from dpjax.compression.shards import shard_shape
from dpjax.links import AxisLink, Clock, VirtualTime

LINKS = {  # name -> (ms, Mbps)
    "datacenter 0.01 ms / 10 Gbps": (0.01, 10_000),
    "35 ms / 63 Mbps": (35, 63),
    "183 ms / 23 Mbps": (183, 23),
    "277 ms / 13 Mbps": (277, 13),
}
# label -> (rule, --workers, allreduce[, --compression over the sites: --compress-axes node[, "whole": not per shard]])
VARIANTS = {
    "sync, hierarchical": ("sync", None, "hierarchical"),
    "sync, flat ring": ("sync", None, "ring"),
    "delayed:4, flat": ("delayed:4", None, "ring"),
    "delayed:4, sites": ("delayed:4", "node", "ring"),
    "sparse:8, sites": ("sparse:8", "node", "ring"),
    "sparse:32, sites": ("sparse:32", "node", "ring"),
    "DiLoCo sparse:32,outer=0.7, sites": ("sparse:32,outer=0.7", "node", "ring"),
    # compressed between the sites, exact inside (issue 20)
    "sync powersgd:4, sites": ("sync", "node", "ring", "powersgd:4"),
    "sync int8, sites": ("sync", "node", "ring", "int8"),
    "sync int4, sites": ("sync", "node", "ring", "int4"),
    "sync sign, sites": ("sync", "node", "ring", "sign"),
    "sync topk:0.01, sites": ("sync", "node", "ring", "topk:0.01"),
    "delayed:2 int4, sites": ("delayed:2", "node", "ring", "int4"),
    "delayed:4 int4, sites": ("delayed:4", "node", "ring", "int4"),
    "delayed:4 int4, sites, whole": ("delayed:4", "node", "ring", "int4", "whole"),
    "delayed:4 int8, sites": ("delayed:4", "node", "ring", "int8"),
    "delayed:4 randk:0.1, sites": ("delayed:4", "node", "ring", "randk:0.1"),
    "delayed:4 powersgd:4, sites": ("delayed:4", "node", "ring", "powersgd:4"),
    "delayed:8 powersgd:4, sites": ("delayed:8", "node", "ring", "powersgd:4"),
    "sparse:4 int4, sites": ("sparse:4", "node", "ring", "int4"),
    "sparse:8 int4, sites": ("sparse:8", "node", "ring", "int4"),
    "sparse:8 powersgd:4, sites": ("sparse:8", "node", "ring", "powersgd:4"),
    "sparse:8 powersgd:4, sites, whole": ("sparse:8", "node", "ring", "powersgd:4", "whole"),
    "sparse:16 int4, sites": ("sparse:16", "node", "ring", "int4"),
    "DiLoCo sparse:8,outer=0.7 int4, sites": ("sparse:8,outer=0.7", "node", "ring", "int4"),
    "DiLoCo sparse:16,outer=0.7 int4, sites": ("sparse:16,outer=0.7", "node", "ring", "int4"),
    "DiLoCo sparse:32,outer=0.7 int4, sites": ("sparse:32,outer=0.7", "node", "ring", "int4"),
    "sparse:32 int4, sites": ("sparse:32", "node", "ring", "int4"),
    # 1-bit Adam between the sites (issue 31): 10 exact AdamW steps, then the momentum's compressed allreduce
    "sync onebit_adam, sites": ("sync", "node", "ring", "onebit,start=10"),
    "sync onebit_adam:30, sites": ("sync", "node", "ring", "onebit,start=30"),
}
# else --gpt's adamw
OPTIMIZER_OF = {"sync onebit_adam, sites": "onebit_adam", "sync onebit_adam:30, sites": "onebit_adam"}
GPT_VARIANTS = ["sync, hierarchical", "sync int4, sites", "sync powersgd:4, sites", "delayed:4, sites",
                "delayed:2 int4, sites", "delayed:4 int4, sites", "delayed:4 int4, sites, whole",
                "delayed:4 int8, sites",
                "delayed:4 randk:0.1, sites", "delayed:4 powersgd:4, sites", "delayed:8 powersgd:4, sites",
                "sparse:4 int4, sites", "sparse:8 int4, sites", "sparse:16 int4, sites", "sparse:8 powersgd:4, sites",
                "sparse:8 powersgd:4, sites, whole", "DiLoCo sparse:8,outer=0.7 int4, sites",
                "DiLoCo sparse:16,outer=0.7 int4, sites", "DiLoCo sparse:32,outer=0.7 int4, sites",
                "sparse:32 int4, sites", "sync onebit_adam, sites", "sync onebit_adam:30, sites"]
GOAL = 1.0  # issue 31: at most the datacenter sync run's time to target (issue 20 asked 1.25x)


def compression_of(label):
    return VARIANTS[label][3] if len(VARIANTS[label]) > 3 else None


def whole(label) -> bool:
    """Whether a compressed variant sends the whole gradient across from every device."""
    return len(VARIANTS[label]) > 4 and VARIANTS[label][4] == "whole"


def predict(label, nelems, compute, link: Link, shapes=None) -> float:
    """Seconds per step from the alpha-beta model of what crosses the node link."""
    rule, workers, algorithm = VARIANTS[label][:3]
    if algorithm == "hierarchical":  # only the outer phase, over the 2 sites, crosses
        s = schedule("hierarchical", 4, nelems, groups=2)
        steps, nbytes = s.outer_steps, s.outer_bytes
    elif workers == "node":  # inside a site first; the rule's ring over the 2 sites crosses
        s = schedule("ring", 2, nelems)
        steps, nbytes = s.steps, s.bytes
        if compression_of(label):  # the method's bytes (of each device's shard), the ring's latencies (a lower bound)
            cut = shapes if whole(label) else [shard_shape(s, 4) for s in shapes]
            nbytes = compressed_bytes(compression_of(label), cut, 2)
    else:  # a ring over all 8: every step crosses
        s = schedule("ring", 8, nelems)
        steps, nbytes = s.steps, s.bytes
    comm, wire = steps * link.latency + nbytes / link.bandwidth, nbytes / link.bandwidth
    kind, n = rule.partition(":")[0], period(label)
    if kind == "delayed":
        return max(compute, comm / n, wire)
    if kind == "sparse":
        return compute + comm / n
    return compute + comm


def period(label) -> int:
    """Steps in one cycle of the rule's exchange (T of delayed:T, P of sparse:P; 1 for sync)."""
    _, _, n = VARIANTS[label][0].partition(":")
    return int(n.split(",")[0]) if n else 1


def timed_run(bench, label, links, steps, skip=0):
    """Per-step wall-clock seconds of `steps` training steps (each awaited), compiled
    first; the first `skip` steps run untimed (a cut run's warm-up: delayed:T's first T
    steps have nothing to wait for yet)."""
    rule = VARIANTS[label][0]
    layout, step = bench.step(rule, links=links, donate=False)  # the bench holds the label's compression
    params, state = step.init(S.init_params(bench.model, layout, jax.random.key(bench.seed)))
    jax.block_until_ready(step.train(params, state, bench.train[0]))  # compile (and a throw-away step)
    times = []
    for i, batch in enumerate(bench.train[:skip + steps]):
        t = time.perf_counter()
        params, state, loss = step.train(params, state, batch)
        float(loss)
        if i >= skip:
            times.append(time.perf_counter() - t)
    return times


def compute_runner(bench, label):
    """run(k) -> the seconds of k more steps without links (compiled, and one step run, first)."""
    _, step = bench.step(VARIANTS[label][0], donate=False)
    carry = list(step.init(S.init_params(bench.model, step.layout, jax.random.key(bench.seed))))
    jax.block_until_ready(step.train(*carry, bench.train[0]))
    at = [0]

    def run(k):
        times = []
        for _ in range(k):
            batch = bench.train[at[0] % len(bench.train)]
            at[0] += 1
            t = time.perf_counter()
            params, state, loss = step.train(*carry, batch)
            float(loss)
            carry[:] = [params, state]
            times.append(time.perf_counter() - t)
        return times

    return run


def virtual_run(bench, label, links, steps, compute):
    """Per-step seconds of `steps` training steps on a virtual clock (`dpjax.links.VirtualTime`):
    before each step the clock moves by `compute` (the variant's measured step without
    links), and the step's waits for the emulated wire move it on. The wire's share is
    thus exact and free of the machine's load; only `compute` was measured."""
    plan = bench.plan(VARIANTS[label][0], links)
    now = VirtualTime()
    step = S.for_plan(plan, donate=False, clock=Clock(plan.mesh.size, now))
    params, state = step.init(S.init_params(bench.model, plan.layout, jax.random.key(bench.seed)))
    times = []
    for batch in bench.train[:steps]:
        t = now.now()
        now.advance(compute)
        params, state, loss = jax.block_until_ready(step.train(params, state, batch))
        times.append(now.now() - t)
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT")
    p.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS), metavar="LINK")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--budget", type=float, default=240.0, help="seconds a timed run may take before it is cut")
    p.add_argument("--cap", type=int, default=24, help="steps timed when a run is cut (then extrapolated)")
    p.add_argument("--quick", action="store_true", help="60 steps; sync, hierarchical / delayed:4, sites / "
                                                         "sparse:8, sites; the 183 ms link")
    p.add_argument("--plot", default="experiments/plots/wan.png", help="loss against measured time, one link")
    p.add_argument("--plot-link", default="183 ms / 23 Mbps")
    p.add_argument("--json")
    p.add_argument("--gpt", action="store_true", help="the main job's GPT and the compressed variants (issue 20)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the interleaved compute measurement")
    p.add_argument("--d-model", type=int, default=None, help="with --gpt: the GPT's width (default: the main job's)")
    p.add_argument("--clock", choices=("virtual", "real"), default=None,
                   help="(default: virtual with --gpt, real without, as the MLP's RESULTS entry was measured) "
                        "virtual: the wire's time on a virtual clock plus each variant's measured compute a step "
                        "(independent of the machine's load but for that compute); real: wall-clock over the "
                        "emulated links (sleeping), cut after --budget seconds")
    _bench.add_smoke(p, "8 steps; sync, hierarchical / delayed:4, sites; a datacenter link (run whole) and a "
                        "35 ms one (cut after 4 steps)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.links = 60, ["183 ms / 23 Mbps"]
        args.variants = ["sync, hierarchical", "delayed:4, sites", "sparse:8, sites"]
    args.clock = args.clock or ("virtual" if args.gpt else "real")
    if args.gpt and args.variants == list(VARIANTS):
        args.variants = GPT_VARIANTS
    if args.gpt and args.links == list(LINKS):
        args.links = ["datacenter 0.01 ms / 10 Gbps", "183 ms / 23 Mbps"]
    if args.smoke:
        # the datacenter link runs whole, the 35 ms one is cut
        args.steps, args.cap, args.budget, args.rounds = 8, 4, 0.3, 1
        args.links, args.plot_link = ["datacenter 0.01 ms / 10 Gbps", "35 ms / 63 Mbps"], "35 ms / 63 Mbps"
        args.variants = ["sync, hierarchical", "sync powersgd:4, sites" if args.gpt else "delayed:4, sites"]
        if args.gpt:
            VARIANTS["sync onebit_adam:2, sites"] = ("sync", "node", "ring", "onebit,start=2")
            OPTIMIZER_OF["sync onebit_adam:2, sites"] = "onebit_adam"
            args.variants.append("sync onebit_adam:2, sites")
        _bench.smoke_outputs(args, "plot", "json")
    model = {"model": "gpt", "optimizer": "adamw", "lr": 3e-3, "clip_norm": 1.0, "batch_size": 32,
             "seq_len": 128} if args.gpt else {"optimizer": "momentum", "lr": args.lr}
    if args.gpt and args.d_model:
        model.update(d_model=args.d_model)
    if args.gpt and args.smoke:
        model.update(seq_len=16, d_model=16)

    benches, curves, compute = {}, {}, {}
    for label in args.variants:  # the losses, and the compute of a step, without links
        rule, workers, algorithm = VARIANTS[label][:3]
        comp = compression_of(label)
        bench = Bench(mesh="2x4x1", steps=args.steps, eval_every=10, algorithm=algorithm, workers=workers,
                      compression=comp or "none", compress_axes="node" if comp else None,
                      compress_whole=whole(label),
                      **{**model, "optimizer": OPTIMIZER_OF.get(label, model["optimizer"])})
        benches[label] = bench
        curves[label] = bench.run(rule, verbose=False)
        print(f"  {label:36s} final eval {curves[label].final_eval:.4f}", flush=True)
    # the compute of a step without links: every variant in turn, --rounds times (the
    # machine's load moves; interleaving spreads it over all variants alike), the median
    runners = {label: compute_runner(benches[label], label) for label in args.variants}
    samples = {label: [] for label in args.variants}
    for _ in range(args.rounds):
        for label in args.variants:
            samples[label] += runners[label](4 if args.smoke else 6)
    for label in args.variants:
        compute[label] = _bench.median(samples[label])
        print(f"  {label:36s} compute {1e3 * compute[label]:.1f} ms/step", flush=True)
    first = next(iter(benches.values()))
    nelems = first.gradient_elements()
    shapes = [tuple(x.shape) for x in jax.tree.leaves(jax.eval_shape(first.model.init, jax.random.key(0)))]
    base = "sync, hierarchical" if "sync, hierarchical" in curves else args.variants[0]
    target = round(curves[base].final_eval * 1.01, 4)
    steps_to = {label: curves[label].steps_to(target) for label in args.variants}

    rows, results = [], {}
    for name in args.links:
        ms, mbps = LINKS[name]
        link = Link.from_ms_mbps(ms, mbps)
        axis_link = (AxisLink("node", link.latency, link.bandwidth),)
        for label in args.variants:
            if args.gpt and LINKS[name][0] < 1 and label != base:  # the datacenter run is the reference only
                continue
            s = steps_to[label]
            predicted = predict(label, nelems, compute[label], link, shapes)
            n = s or args.steps
            cut = predicted * n > args.budget and args.clock == "real"
            k = period(label)
            # a cut run: whole cycles of the rule, after one cycle of warm-up
            if args.clock == "virtual":  # no sleeping: every step up to the target (or all of them)
                times = virtual_run(benches[label], label, axis_link, n, compute[label])
            elif cut:
                times = timed_run(benches[label], label, axis_link, -(-args.cap // k) * k, skip=k)
            else:
                times = timed_run(benches[label], label, axis_link, n)
            per_step = sum(times) / len(times)
            to_target = None if s is None else (per_step * s if cut else sum(times[:s]))
            results.setdefault(name, {})[label] = {"predicted_s": predicted, "measured_s": per_step, "cut": cut,
                                                   "timed_steps": len(times), "to_target_s": to_target}
            rows.append((name, label, predicted, per_step, cut, to_target, s))
            print(f"  {name:28s} {label:36s} predicted {predicted:.3f} s/step, measured {per_step:.3f} s/step "
                  f"({len(times)} steps{', cut' if cut else ''})", flush=True)

    what = f"gpt, adamw 3e-3, clip 1.0, batch 32 x {model['seq_len']}" if args.gpt else f"mlp, batch 64, lr {args.lr}"
    clock = {"virtual": "the wire's time on a virtual clock plus each variant's measured compute a step",
             "real": "wall-clock: the wire emulated by sleeping, the rest real"}[args.clock]
    print(f"\nMEASURED over emulated links (dpjax.links; {clock}; load average {os.getloadavg()[0]:.1f} at the end). "
          f"{MACHINE}; {DATE}; "
          f"{what}, {nelems:,} parameters, mesh 2x4x1 (2 sites of 4); target "
          f"validation loss {target} (sync, hierarchical's final {curves[base].final_eval:.4f} + 1%)\n")
    print("| variant | final loss | steps to target | compute ms/step |\n|---|---|---|---|")
    for label in args.variants:
        print(f"| {label} | {curves[label].final_eval:.4f} | {steps_to[label] or 'not reached'} | "
              f"{1e3 * compute[label]:.1f} |")
    print("\n| link | variant | predicted s/step | measured s/step | measured / predicted | time to target (s) | "
          "of which waiting for the wire (s) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, label, predicted, per_step, cut, to_target, s in rows:
        tt = "not reached" if to_target is None else f"{'~' if cut else ''}{to_target:,.1f}"
        wire = ("" if to_target is None or args.clock != "virtual"  # the rest is s steps of measured compute
                else f"{to_target - s * compute[label]:,.2f}")
        print(f"| {name} | {label} | {predicted:.3f} | {per_step:.3f} | {per_step / predicted:.2f} | {tt} | {wire} |")
    dc, far = "datacenter 0.01 ms / 10 Gbps", args.plot_link
    reference = results.get(dc, {}).get(base, {}).get("to_target_s")
    reached = {label: r["to_target_s"] for label, r in results.get(far, {}).items() if r["to_target_s"]}
    if reference and reached:
        best = min(reached, key=reached.get)
        print(f"\ngoal: over {far}, the target within {GOAL}x the datacenter {base} run's {reference:.1f} s: best "
              f"{best}, {reached[best]:.1f} s = {reached[best] / reference:.2f}x "
              f"({'met' if reached[best] <= GOAL * reference else 'not met'})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "target": target, "compute_s": compute, "results": results,
                       "evals": {k: v.evals for k, v in curves.items()}}, fh)
    if args.plot_link in results:
        series = [(label, [s * results[args.plot_link][label]["measured_s"] for s, _ in curves[label].evals],
                   [v for _, v in curves[label].evals]) for label in args.variants]
        plot(args.plot, series, f"measured wall-clock (s) over an emulated {args.plot_link} link",
             "validation loss", "Across 2 sites of 4 devices (dpjax.links)", logx=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
