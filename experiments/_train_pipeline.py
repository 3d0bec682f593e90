"""bench_train.py --pipeline: pipeline schedules against no stages on the same devices.

Each variant is dpjax's step (`_train_variants.make_steps`) on the `stage` mesh with a
schedule and a micro-batch count; the baseline (`stage=1`) is the plain data-parallel
step on every device. `--memory-sweep` tabulates each schedule's memory against M
instead (no timing). See bench_train.py's docstring for what is measured.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from _bench import console_table, git_state, load_avg, markdown_table, pick_devices, summary_ms
from _train_variants import make_steps


def build_pipeline(args):
    """Per schedule and M: dpjax's pipelined step on the stage mesh; the baseline: the plain
    data-parallel step on every device (no stage axis). Same model, batch, initial values."""
    import jax

    from dpjax import step as S
    from dpjax.collectives.cost import hlo_comm
    from dpjax.data import make_streams
    from dpjax.mesh import STAGE, make_mesh, mesh_size
    from dpjax.optim import OptimizerConfig
    from dpjax.models import get_model
    from dpjax.pipeline import SCHEDULES, Pipeline, bubble_formula

    n = mesh_size(args.pipeline)
    if n is None:
        raise SystemExit(f"error: give the mesh sizes explicitly, not {args.pipeline!r}")
    devs = pick_devices(n)
    model = get_model("gpt", seq_len=args.seq_len,
                      **{**args.model_options, "n_layers": args.n_layers, "d_model": args.d_model})
    stream, _ = make_streams("synthetic", args.seq_len, args.seed)
    host = jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(args.seed)))  # one init for all
    variants, batches = {}, {}

    def make(mesh, pipe, opt):
        return make_steps(model, mesh, global_batch=args.batch_size, opt=opt, pipeline=pipe, donate=False)

    def add(name, label, mesh, pipe, extra):
        batches[name] = [S.put_batch(stream, i * args.batch_size, args.batch_size, mesh, passes=1)
                         for i in range(4)]
        layout, step = make(mesh, pipe, OptimizerConfig())
        params, state = step.init(jax.device_put(layout.store(host), layout.shardings()))
        t0 = time.perf_counter()
        compiled = step.train.lower(params, state, batches[name][0]).compile()
        mem = compiled.memory_analysis()

        def sgd_losses(mesh=mesh, pipe=pipe, name=name):
            lay, st = make(mesh, pipe, OptimizerConfig(name="sgd", lr=0.1, clip_norm=0.0))
            p, o = st.init(jax.device_put(lay.store(host), lay.shardings()))
            out = []
            for i in range(args.check_steps):
                p, o, loss = st.train(p, o, batches[name][i % 4])
                out.append(float(loss))
            return out

        variants[name] = {"label": label, "fn": step.train, "state": (params, state), "buckets": None,
                          "ops": dict(hlo_comm(compiled.as_text()).ops), "model_bytes": 0, "hlo_bytes": 0,
                          "compile_s": time.perf_counter() - t0, "batches": batches[name], "base": "stage=1",
                          "sgd_losses": sgd_losses, "args_bytes": mem.argument_size_in_bytes,
                          "temp_bytes": mem.temp_size_in_bytes, **extra}

    flat = make_mesh(f"data={n}", devs)
    add("stage=1", f"data={n}, no stages (stage=1)", flat, None, {"bubble_formula": 0.0})
    mesh = make_mesh(args.pipeline, devs)
    S_ = mesh.shape[STAGE]
    for schedule, M in ((s, m) for s in args.schedules for m in args.microbatches):
        V = args.virtual_stages if SCHEDULES[schedule].virtual_stages else 1
        pipe = Pipeline(schedule, M, V)
        name = f"{schedule} M={M}" + (f" V={V}" if V > 1 else "")
        extra = {"bubble_formula": bubble_formula(schedule, S_, M, V), "pipe": pipe}
        add(name, f"{args.pipeline} {name}", mesh, pipe, extra)
    info = {"mesh": {"pipeline": args.pipeline}, "platform": devs[0].platform,
            "params": int(sum(x.size for x in jax.tree.leaves(host))), "param_bytes": S.num_bytes(host),
            "tokens_per_step": args.batch_size * args.seq_len, "jax": jax.__version__, "git": git_state(),
            "stages": S_, "devices": n, "replica_rows": args.batch_size // (n // S_ // mesh.shape.get("model", 1)),
            "model": model}
    return variants, info


def check_pipeline(args, variants):
    """--check-steps SGD steps (no clipping) per variant from the same initial parameters:
    the losses must match the stage-free baseline's (float32 round-off)."""
    losses = {name: v["sgd_losses"]() for name, v in variants.items()}
    ref = losses["stage=1"]
    out = {}
    for name, ls in losses.items():
        rel = max(abs(a - b) / abs(b) for a, b in zip(ls, ref))
        out[name] = {"losses": ls, "max_rel_diff": rel, "grad_max_diff_rel": float("nan"), "ok": rel <= args.rtol}
    return out


def pipeline_flops(args, variants, info):
    """Each schedule's bubble from compiled FLOPs (one replica on a stage-only mesh)."""
    from dpjax.plan import pipeline_cost as cost

    for v in variants.values():
        if "pipe" in v:
            r = cost.measure_bubble(info["model"], info["stages"], v["pipe"], rows=info["replica_rows"])
            v["bubble_measured"], v["useful_vs_expected"], v["ends_share"] = (r["bubble"], r["useful_vs_expected"],
                                                                              r["ends_share"])


def memory_sweep(args, console) -> list:
    """temp / argument bytes of the AdamW step against M at a fixed micro-batch size."""
    from dpjax.mesh import make_mesh, mesh_size
    from dpjax.models import get_model
    from dpjax.optim import OptimizerConfig
    from dpjax.pipeline import SCHEDULES, Pipeline
    from dpjax.plan import pipeline_cost as cost

    mesh = make_mesh(args.pipeline, pick_devices(mesh_size(args.pipeline)))
    model = get_model("gpt", seq_len=args.seq_len,
                      **{**args.model_options, "n_layers": args.n_layers, "d_model": args.d_model})
    dp = mesh.size // mesh.shape["stage"] // mesh.shape.get("model", 1)
    rows = []
    for schedule in args.schedules:
        V = args.virtual_stages if SCHEDULES[schedule].virtual_stages else 1
        for M in args.microbatches:
            global_batch = args.microbatch_rows * M * dp
            _, step = make_steps(model, mesh, global_batch=global_batch, opt=OptimizerConfig(),
                                 pipeline=Pipeline(schedule, M, V), donate=False)
            ma = cost.train_memory(step, model, global_batch)
            rows.append({"schedule": schedule + (f" V={V}" if V > 1 else ""), "M": M,
                         "temp_bytes": ma.temp_size_in_bytes, "args_bytes": ma.argument_size_in_bytes})
            console.print(f"{rows[-1]['schedule']:>16} M={M:<3} temp {ma.temp_size_in_bytes / 2**20:8.3f} MiB  "
                          f"arguments {ma.argument_size_in_bytes / 2**20:8.3f} MiB")
    return rows


def main_pipeline(args, argv, console, time_all) -> int:
    """time_all(args, variants) -> {name: [seconds]}: bench_train's interleaved timing."""
    if args.memory_sweep:
        rows = memory_sweep(args, console)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(f"`python experiments/bench_train.py {' '.join(argv)}`\n\n" + markdown_table(
                    ("schedule", "M", "temporaries MiB", "arguments MiB"),
                    [(r["schedule"], r["M"], f"{r['temp_bytes'] / 2**20:.3f}", f"{r['args_bytes'] / 2**20:.3f}")
                     for r in rows], right=(1, 2, 3)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f, indent=1)
        return 0
    variants, info = build_pipeline(args)
    console.print(f"GPT {info['params']:,} params, {args.n_layers} layers, batch {args.batch_size}x{args.seq_len}, "
                  f"{args.pipeline} against data={info['devices']} on {info['platform']}")
    checks = check_pipeline(args, variants)
    all_ok = all(c["ok"] for c in checks.values())
    for name, c in checks.items():
        console.print(f"check {variants[name]['label']}: SGD losses {', '.join(f'{x:.6f}' for x in c['losses'])} "
                      f"(max rel. diff {c['max_rel_diff']:.1e}) {'ok' if c['ok'] else '[red]DIFFERS[/red]'}")
    if args.flops:
        pipeline_flops(args, variants, info)
    load = [load_avg()]
    times = time_all(args, variants)
    load.append(load_avg())
    head = ("variant", "median ms (p25-p75)", "x stage=1", "paired x", "bubble (papers)", "bubble, FLOPs",
            "arguments MiB", "temporaries MiB")
    rows, cells = [], []
    for name, v in variants.items():
        ts = times[name]
        row = {"variant": name, "label": v["label"], **summary_ms(ts, times["stage=1"]),
               "bubble_formula": v["bubble_formula"], "bubble_measured": v.get("bubble_measured"),
               "useful_vs_expected": v.get("useful_vs_expected"), "ends_share": v.get("ends_share"),
               "args_bytes": v["args_bytes"],
               "temp_bytes": v["temp_bytes"], "compile_s": v["compile_s"], "loss_check": checks[name],
               "times_ms": [x * 1e3 for x in ts]}
        rows.append(row)
        cells.append((v["label"], f"{row['median_ms']:.1f} ({row['p25_ms']:.1f}-{row['p75_ms']:.1f})",
                      f"{row['ratio']:.2f}", f"{row['paired_ratio']:.2f}", f"{row['bubble_formula']:.3f}",
                      "-" if row["bubble_measured"] is None else f"{row['bubble_measured']:.3f}",
                      f"{row['args_bytes'] / 2**20:.2f}", f"{row['temp_bytes'] / 2**20:.2f}"))
    console_table(f"train step (AdamW), median of {args.reps} interleaved reps ({args.warmup} warm-up)", head, cells,
                  right=range(1, len(head)), console=console)
    console.print(f"1-minute load average before / after timing: {load[0]:.1f} / {load[1]:.1f} "
                  f"on {os.cpu_count()} cores")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"`python experiments/bench_train.py {' '.join(argv)}`\n\n"
                    + markdown_table(head, cells, right=range(1, len(head))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "load_avg_1min": load, "loss_check_ok": all_ok,
                       "rows": rows}, f, indent=1, default=str)
    return 0 if all_ok else 1
