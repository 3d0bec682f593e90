"""Step time of a data-parallel GPT train step: dpjax's explicit allreduces vs XLA's own.

    python experiments/bench_train.py --reps 30 --warmup 3 --markdown table.md --json bench_train.json

Every variant trains the same model (the default `dpjax.models.get_model("gpt")`)
with the same optax AdamW (`dpjax.optim.OptimizerConfig().make(batch)`) on the same
batches over the same mesh (8x1 by default: 8 data-parallel ranks):

    xla-auto          plain `jax.jit` with NamedShardings: params and optimizer state
                      replicated, the batch split over `data`; loss, grad and update are
                      written for the global batch and XLA's SPMD partitioner inserts
                      its own all-reduce (the baseline).
    dpjax <alg>       `dpjax.step.for_model` (the sync rule) with `Exchange(<alg>,
                      fusion_mb)`: one `jit(shard_map(...))`, the gradient averaged by
                      dpjax's explicit collective in fused buckets.
    no-comm           the dpjax step with every data rank its own worker and nothing
                      exchanged (no gradient average): not a correct data-parallel step,
                      the floor that shows what all the communication costs.

Before timing, every variant runs a few AdamW steps from the same initial parameters
on the same batches and its losses are compared with xla-auto's, and one plain SGD
step whose update (the averaged gradient) is compared too: the comparison is only fair
if they compute the same thing. Timing is interleaved: each repetition runs one
step of every variant in turn (the starting variant rotates), each step is awaited
(the CPU backend deadlocks with ~40+ collective programs in flight, and an awaited
step is what we want to time), and the median over repetitions is reported, so
load from other processes on the machine hits every variant alike.

With `--layouts 8x1,2x4,1x8,8x1/fsdp` the comparison is per layout instead: for each
mesh (and `/fsdp` for ZeRO-3), xla-auto is plain `jax.jit` with the parameters and
optimizer state given dpjax's shardings for that layout (`dpjax.sharding.make_layout`:
split over `model` by the model's table, and over `data` too under FSDP), so XLA's SPMD
partitioner places every collective itself, against dpjax's explicit step on the same
layout (`--layout-algorithm` over the data axes, `--tp-algorithm` over `model`). All
variants of all layouts are interleaved in one run; each ratio is to its own layout's
xla-auto.

With `--pipeline stage=4,data=2` the comparison is pipeline parallelism against no
stages on the same devices: the same GPT (`--n-layers`, default 8) and global batch
trained by dpjax's step on the `stage` mesh with each schedule in `--schedules` and each
micro-batch count in `--microbatches` (interleaved with `--virtual-stages`), against
the plain data-parallel step on `data=<all devices>` (the `stage=1` row: no stage axis,
every device a data rank). Each variant first takes `--check-steps` SGD steps (no
clipping) from the same initial parameters, whose losses must match the baseline's;
then the AdamW steps are timed, interleaved as above. Per variant the compiled step's
memory analysis (arguments: parameters, optimizer state and the batch; temporaries)
and the papers' bubble; with `--flops` also the bubble measured from the compiled
programs' FLOPs (`dpjax.plan.pipeline_cost.measure_bubble`, ticks unrolled: slow to
compile). `--memory-sweep` instead tabulates each schedule's memory against M =
`--microbatches` at a fixed micro-batch of `--microbatch-rows` sequences (no timing).

On a CPU-only machine the mesh's devices are simulated (`--devices`, default 8); with
a GPU backend that has enough devices the same script runs there unchanged. `--smoke`
runs every mode's code path in seconds (a tiny model, 2 variants, 1 step each).
The variants are built in `_train_variants.py` (`make_steps`: the one place a dpjax
step is made from these settings), the pipeline mode in `_train_pipeline.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import _bench
from _train_variants import ALGORITHMS

DEFAULT_VARIANTS = ("xla-auto", "ring", "ring-nofusion", "psum", "butterfly", "tree", "ps", "no-comm")
# --smoke: every code path of each mode, in seconds (a small GPT, few variants, 1-2 steps)
SMOKE = {"mesh": "2x1", "batch_size": 8, "seq_len": 16, "reps": 2, "warmup": 1, "check_steps": 1,
         "variants": "xla-auto,ring@0.01,no-comm", "layouts": "1x2,2x1/fsdp", "tp_algorithm": "ring,psum",
         "schedules": "gpipe,interleaved", "microbatches": "2", "n_layers": 4, "d_model": 32}
SMOKE_MODEL = {"d_model": 32, "n_heads": 4, "d_ff": 64, "n_layers": 1}  # --pipeline sets n_layers


def parse_variant(name: str, fusion_mb: float):
    """'xla-auto' -> (None, None); 'ring' -> ('ring', fusion_mb); 'ring-nofusion' -> ('ring', 0);
    'ring@0.5' -> ('ring', 0.5); 'no-comm' -> ('no-comm', None). Raises ValueError otherwise."""
    if name == "xla-auto":
        return None, None
    if name == "no-comm":
        return name, None
    alg, at, mb = name.partition("@")
    if alg.endswith("-nofusion") and not at:
        alg, mb, at = alg[: -len("-nofusion")], "0", "@"
    if alg not in ALGORITHMS:
        raise ValueError(name)
    try:
        return alg, float(mb) if at else fusion_mb
    except ValueError:
        raise ValueError(name) from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Median step time of a data-parallel GPT train step: dpjax's explicit, fused "
                    "allreduces (every algorithm) against plain jax.jit with NamedSharding, where XLA "
                    "inserts its own all-reduce. Variants are interleaved round-robin in one run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--devices", type=int, default=8, help="simulated CPU devices (ignored where the backend has enough)")
    a("--mesh", default="8x1", help="mesh spec (data x model); the model axis must be 1")
    a("--batch-size", type=int, default=32, help="global batch in sequences")
    a("--seq-len", type=int, default=128, help="tokens per sequence")
    a("--fusion-mb", type=float, default=64.0, help="tensor-fusion bucket cap (MiB) of the fused variants")
    a("--warmup", type=int, default=3, help="untimed steps per variant after the correctness check")
    a("--reps", type=int, default=20, help="timed steps per variant (interleaved)")
    a("--check-steps", type=int, default=3, help="AdamW steps from the same init whose losses are compared")
    a("--rtol", type=float, default=2e-5,
      help="tolerance of the checks: relative loss difference, and gradient difference relative to its "
           "largest element (float32 round-off)")
    a("--variants", default=",".join(DEFAULT_VARIANTS),
      help=f"comma-separated: xla-auto, an algorithm ({', '.join(ALGORITHMS)}) with --fusion-mb, "
           "ALG-nofusion (one allreduce per tensor), ALG@MB (bucket cap MB MiB), or no-comm (the "
           "dpjax step with the gradient average left out: a floor, not the same training step)")
    a("--layouts", help="compare per layout instead: comma-separated meshes, '/fsdp' for ZeRO-3, "
                        "e.g. 8x1,2x4,1x8,8x1/fsdp (each against XLA's automatic sharding of the same layout)")
    a("--layout-algorithm", default="ring", help="with --layouts: dpjax's algorithm over the data axes")
    a("--tp-algorithm", default="ring",
      help="with --layouts: dpjax's allreduce over the model axis; a comma-separated list times each")
    a("--pipeline", metavar="MESH", help="compare pipeline schedules on this stage mesh (e.g. stage=4,data=2) "
                                          "against no stages on the same devices")
    a("--schedules", default=None, help="with --pipeline: the schedules compared (default: every registered one, "
                                         "dpjax.pipeline.SCHEDULES)")
    a("--microbatches", default="4,8", help="with --pipeline: micro-batches per replica (comma-separated)")
    a("--virtual-stages", type=int, default=2, help="with --pipeline: chunks per stage of interleaved")
    a("--n-layers", type=int, default=8, help="with --pipeline: the GPT's layers")
    a("--d-model", type=int, default=128, help="with --pipeline: the GPT's width")
    a("--flops", action="store_true", help="with --pipeline: measure each bubble from compiled FLOPs (slow)")
    a("--memory-sweep", action="store_true",
      help="with --pipeline: memory per schedule against --microbatches at --microbatch-rows sequences each")
    a("--microbatch-rows", type=int, default=2, help="with --memory-sweep: sequences per micro-batch")
    a("--seed", type=int, default=0)
    a("--markdown", metavar="FILE", help="write the table as markdown")
    a("--json", metavar="FILE", help="write every measurement as JSON")
    _bench.add_smoke(p, "mesh 2x1 / layouts 1x2,2x1/fsdp / stage=2 meshes, a small GPT, 3 variants, 2 reps")
    args = p.parse_args(argv)
    args.model_options = {}
    if args.smoke:  # the mode the flags chose, on the smallest meshes and sizes
        for k, v in SMOKE.items():
            if k != "layouts" or args.layouts:
                setattr(args, k, v)
        if args.pipeline:
            args.pipeline = "stage=2,data=1"
        args.model_options = SMOKE_MODEL
        _bench.smoke_outputs(args, "markdown", "json")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = []
    for v in variants:
        try:
            parse_variant(v, args.fusion_mb)
        except ValueError:
            bad.append(v)
    if bad:
        p.error(f"unknown variant(s) {', '.join(bad)}; use xla-auto, ALG, ALG-nofusion or ALG@MB "
                f"with ALG one of {', '.join(ALGORITHMS)}")
    if "xla-auto" not in variants:
        variants.insert(0, "xla-auto")  # the baseline every ratio refers to
    args.variants = variants
    if args.pipeline:
        from dpjax.pipeline import SCHEDULES

        args.schedules = (list(SCHEDULES) if args.schedules is None
                          else [v.strip() for v in args.schedules.split(",") if v.strip()])
        if any(v not in SCHEDULES for v in args.schedules):
            p.error(f"--schedules: choose from {', '.join(SCHEDULES)}")
        try:
            args.microbatches = [int(v) for v in args.microbatches.split(",") if v.strip()]
        except ValueError:
            p.error("--microbatches takes comma-separated integers")
        if "stage=" not in args.pipeline:
            p.error("--pipeline takes a named mesh with a stage axis, e.g. stage=4,data=2")
    if args.layouts:
        args.layouts = [v.strip() for v in args.layouts.split(",") if v.strip()]
        for lay in args.layouts:
            spec, _, flag = lay.partition("/")
            if flag not in ("", "fsdp") or not all(p.isdigit() for p in spec.split("x")):
                p.error(f"bad layout {lay!r}: use a mesh like 2x4, optionally with /fsdp")
        args.tp_algorithms = [v.strip() for v in args.tp_algorithm.split(",") if v.strip()]
        args.variants = [f"{lay} xla-auto" for lay in args.layouts]
    for name in ("batch_size", "seq_len", "reps", "check_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def run_step(v, i):
    """Step i of variant v on its batch i (cycled), awaited; the state carried on."""
    import jax

    params, opt_state, loss = v["fn"](*v["state"], v["batches"][i % len(v["batches"])])
    jax.block_until_ready((params, opt_state, loss))
    v["state"] = (params, opt_state)
    return loss


def time_all(args, variants):
    return _bench.interleave({name: (lambda i, v=v: run_step(v, i)) for name, v in variants.items()},
                             args.reps, args.warmup)


def check(args, variants):
    """Every variant takes the same AdamW steps from the same init (losses must match
    its baseline's), and one plain SGD step (its update, the averaged gradient, must match too)."""
    losses = {name: [float(run_step(v, i)) for i in range(args.check_steps)] for name, v in variants.items()}
    updates = {name: v["sgd_update"]() for name, v in variants.items()}
    result = {}
    for name, ls in losses.items():
        base = variants[name]["base"]
        ref, ref_u = losses[base], updates[base]
        rel = max(abs(a - b) / abs(b) for a, b in zip(ls, ref))
        urel = float(np.max(np.abs(updates[name] - ref_u))) / float(np.max(np.abs(ref_u)))
        # no-comm computes another step (un-averaged gradients): shown, not judged.
        ok = None if name == "no-comm" else (rel <= args.rtol and urel <= args.rtol)
        result[name] = {"losses": ls, "max_rel_diff": rel, "grad_max_diff_rel": urel, "ok": ok}
    return result


def format_ops(ops) -> str:
    short = {"collective-permute": "permute"}
    return ", ".join(f"{n} {short.get(op, op)}" for op, n in sorted(ops.items())) or "none"


def summarise(variants, times, checks, info):
    rows = []
    for name, v in variants.items():
        s = _bench.summary_ms(times[name], times[v["base"]])
        rows.append({
            "variant": name, "label": v["label"], **s, "tokens_per_s": info["tokens_per_step"] / s["median_ms"] * 1e3,
            "buckets": v["buckets"], "ops": v["ops"], "ops_text": format_ops(v["ops"]),
            "model_bytes_sent": v["model_bytes"], "hlo_comm_max_bytes": v["hlo_bytes"], "compile_s": v["compile_s"],
            "loss_check": checks[name], "times_ms": [t * 1e3 for t in times[name]],
        })
    return rows


# The --layouts table (RESULTS.md) has no bucket and model-bytes columns: its bytes are XLA's.
TABLE_HEAD = ("variant", "median ms (p25-p75)", "tokens/s", "x xla-auto", "paired x", "buckets",
              "MiB sent (model)", "collective ops in step")
LAYOUT_COLUMNS = (0, 1, 2, 3, 4, 7)


def table(args, rows):
    cells = [(r["label"], f"{r['median_ms']:.1f} ({r['p25_ms']:.1f}-{r['p75_ms']:.1f})",
              f"{r['tokens_per_s']:,.0f}", f"{r['ratio']:.2f}", f"{r['paired_ratio']:.2f}",
              "-" if r["buckets"] is None else str(r["buckets"]), f"{r['model_bytes_sent'] / 2**20:.2f}",
              r["ops_text"]) for r in rows]
    if not args.layouts:
        return TABLE_HEAD, cells
    return [TABLE_HEAD[i] for i in LAYOUT_COLUMNS], [[c[i] for i in LAYOUT_COLUMNS] for c in cells]


def markdown(args, rows, info, argv) -> str:
    where = (f"layouts {', '.join(args.layouts)}, each against XLA's automatic partitioning of the same "
             "shardings" if args.layouts else f"mesh {'x'.join(str(s) for s in info['mesh'].values())}")
    head, cells = table(args, rows)
    return (f"`python experiments/bench_train.py {' '.join(argv)}`".replace(" `", "`") + "\n\n"
            f"GPT {info['params']:,} parameters ({info['param_bytes'] / 2**20:.2f} MiB f32), "
            f"global batch {args.batch_size} x {args.seq_len} tokens, {where}; {info['machine']}; "
            f"median of {args.reps} interleaved steps after {args.warmup} warm-up steps. "
            "\"x xla-auto\": ratio of medians; \"paired x\": median over rounds of the ratio to "
            "xla-auto's step in the same round. \"MiB sent (model)\": bytes the busiest device "
            "sends per step under `dpjax.collectives.cost.schedule` (XLA's all-reduce modelled as a ring); "
            "\"collective ops\": `hlo_comm` of the compiled step (in dpjax steps the all-reduce is the "
            "loss `pmean`; with psum XLA merges the gradient's into it).\n\n" + _bench.markdown_table(head, cells))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    _bench.simulate(args.devices)  # before JAX initialises its backends
    console = _bench.make_console()
    if args.pipeline:
        from _train_pipeline import main_pipeline

        return main_pipeline(args, argv, console, time_all)
    from _train_variants import build, build_layouts

    variants, info = build_layouts(args) if args.layouts else build(args, parse_variant)
    info["machine"] = _bench.machine()
    console.print(f"GPT {info['params']:,} params, batch {args.batch_size}x{args.seq_len}, mesh "
                  f"{info['mesh']}; {info['machine']}")

    checks = check(args, variants)
    _bench.console_table(
        f"check: {args.check_steps} AdamW steps and 1 SGD step from the same init, same batches",
        ["variant", *[f"loss @ step {i}" for i in range(args.check_steps)], "max rel. diff vs xla-auto",
         "SGD-step gradient diff (rel. to max)", "ok"],
        [(variants[name]["label"], *[f"{x:.7f}" for x in c["losses"]], f"{c['max_rel_diff']:.1e}",
          f"{c['grad_max_diff_rel']:.1e}", "n/a" if c["ok"] is None else "yes" if c["ok"] else "[red]NO[/red]")
         for name, c in checks.items()], console=console)
    all_ok = all(c["ok"] is not False for c in checks.values())
    if not all_ok:
        console.print(f"[red]losses or gradients differ from xla-auto by more than rtol={args.rtol}: the variants "
                      "do not compute the same step; timings below compare different things[/red]")

    load = [_bench.load_avg()]
    times = time_all(args, variants)
    load.append(_bench.load_avg())
    info["load_avg_1min"] = load
    rows = summarise(variants, times, checks, info)
    _bench.console_table(f"train step, median of {args.reps} interleaved reps ({args.warmup} warm-up)",
                         *table(args, rows), console=console)
    console.print(f"1-minute load average before / after timing: {load[0]:.1f} / {load[1]:.1f} "
                  f"on {os.cpu_count()} cores")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(args, rows, info, argv))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "info": info, "loss_check_ok": all_ok, "rows": rows}, f, indent=1)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
