"""Step time of a data-parallel GPT train step: dpjax's explicit allreduces vs XLA's own.

    python experiments/bench_train.py --reps 30 --warmup 3 --markdown table.md --json bench_train.json

Every variant trains the same model (the default `dpjax.models.get_model("gpt")`)
with the same optax AdamW (`dpjax.step.OptimizerConfig().make(batch)`) on the same
batches over the same mesh (8x1 by default: 8 data-parallel ranks):

    xla-auto          plain `jax.jit` with NamedShardings: params and optimizer state
                      replicated, the batch split over `data`; loss, grad and update are
                      written for the global batch and XLA's SPMD partitioner inserts
                      its own all-reduce (the baseline).
    dpjax <alg>       `dpjax.step.make_train_step` with `distributed_optimizer(...,
                      algorithm=<alg>, fusion_mb=...)`: one `jit(shard_map(...))`, the
                      gradient averaged by dpjax's explicit collective in fused buckets.
    no-comm           the dpjax step with the bare optimizer (no gradient average): not
                      a correct data-parallel step, the floor that shows what all the
                      communication costs.

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
programs' FLOPs (`dpjax.pipeline.cost.measure_bubble`, ticks unrolled: slow to
compile). `--memory-sweep` instead tabulates each schedule's memory against M =
`--microbatches` at a fixed micro-batch of `--microbatch-rows` sequences (no timing).

On a CPU-only machine the mesh's devices are simulated (`--devices`, default 8); with
a GPU backend that has enough devices the same script runs there unchanged.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time

import numpy as np

from dpjax.mesh import simulate_cpu_devices

DEFAULT_VARIANTS = ("xla-auto", "ring", "ring-nofusion", "psum", "butterfly", "tree", "ps", "no-comm")
ALGORITHMS = ("ring", "psum", "butterfly", "tree", "ps")  # hierarchical needs a node axis


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
    args = p.parse_args(argv)
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


def pick_devices(n_needed: int):
    """The default backend's devices if it has enough (a GPU host), else the CPU ones."""
    import jax

    devs = jax.devices()
    if len(devs) < n_needed:
        devs = jax.devices("cpu")
    if len(devs) < n_needed:
        raise SystemExit(f"error: the mesh needs {n_needed} devices, only {len(devs)} available")
    return devs[:n_needed]


def format_ops(ops) -> str:
    short = {"collective-permute": "permute", "all-reduce": "all-reduce", "all-gather": "all-gather",
             "reduce-scatter": "reduce-scatter", "all-to-all": "all-to-all"}
    return ", ".join(f"{n} {short.get(op, op)}" for op, n in sorted(ops.items())) or "none"


def git_state() -> dict:
    """The commit measured, and which dpjax files differed from it (results depend on them)."""
    import subprocess

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10,
                                  cwd=os.path.dirname(os.path.abspath(__file__))).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD").strip(),
            "modified": git("status", "--porcelain", "--", "../dpjax", "../models").splitlines()}


def build(args):
    import jax
    import optax
    from jax.flatten_util import ravel_pytree

    from dpjax import step as S
    from dpjax.collectives.cost import hlo_comm, schedule
    from dpjax.data import make_streams
    from dpjax.fusion import plan_buckets
    from dpjax.mesh import MODEL, data_axes, make_mesh, mesh_size
    from dpjax.models import get_model

    n = mesh_size(args.mesh)
    if n is None:
        raise SystemExit(f"error: give the mesh sizes explicitly, not {args.mesh!r}")
    mesh = make_mesh(args.mesh, pick_devices(n))
    if mesh.shape.get(MODEL, 1) != 1:
        raise SystemExit("error: this benchmark is pure data parallelism; use a model axis of 1 (e.g. 8x1)")
    dp = math.prod(mesh.shape[a] for a in data_axes(mesh))
    if args.batch_size % dp:
        raise SystemExit(f"error: --batch-size {args.batch_size} is not divisible by {dp} data-parallel ranks")

    model = get_model("gpt", seq_len=args.seq_len)
    opt = S.OptimizerConfig()
    rep, bat = S.replicated(mesh), S.batch_sharding(mesh)
    key = jax.random.key(args.seed)
    stream, _ = make_streams("synthetic", args.seq_len, args.seed)
    # A few batches placed once, cycled: data loading is not what is measured.
    batches = [S.put_batch(stream, i * args.batch_size, args.batch_size, mesh) for i in range(4)]

    def make_fn(alg, fusion, opt_cfg, donate=True):
        """(optax transformation, jitted step, label) of one variant with `opt_cfg`."""
        if alg is None:
            tx = opt_cfg.make(args.batch_size)

            def xla_step(params, opt_state, batch):
                loss, grads = jax.value_and_grad(model.loss)(params, batch)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            fn = jax.jit(xla_step, in_shardings=(rep, rep, bat), out_shardings=(rep, rep, rep),
                         donate_argnums=(0, 1) if donate else ())
            return tx, fn, "xla-auto"
        if alg == "no-comm":
            # The same shard_map step with the bare optimizer: each rank steps on its own
            # gradient. Wrong on purpose: it shows what the step costs without communication.
            tx = opt_cfg.make(args.batch_size)
            return tx, S.make_train_step(model, tx, mesh, donate=donate), "no-comm floor (not averaged)"
        tx = S.distributed_optimizer(opt_cfg, mesh, args.batch_size, algorithm=alg, fusion_mb=fusion)
        label = f"dpjax {alg}" + (", no fusion" if fusion == 0 else f"+fusion {fusion:g} MiB")
        return tx, S.make_train_step(model, tx, mesh, donate=donate), label

    def sgd_update(alg, fusion):
        """-(averaged gradient) of batch 0, as one flat host vector: one plain SGD step with lr 1
        and no clipping. AdamW (what is timed) is invariant to the gradient's scale, so a loss
        check alone would not notice a sum where a mean belongs; this does."""
        tx, fn, _ = make_fn(alg, fusion, S.OptimizerConfig(name="sgd", lr=1.0, clip_norm=0.0), donate=False)
        p0, o0 = S.init_state(model, tx, mesh, key)
        p1 = fn(p0, o0, batches[0])[0]
        return np.asarray(ravel_pytree(p1)[0]) - np.asarray(ravel_pytree(p0)[0])

    variants = {}
    for name in args.variants:
        alg, fusion = parse_variant(name, args.fusion_mb)
        tx, fn, label = make_fn(alg, fusion, opt)
        params, opt_state = S.init_state(model, tx, mesh, key)  # same key: same initial parameters
        plan = None if fusion is None or alg == "no-comm" else plan_buckets(params, fusion * 2**20)
        buckets = None if plan is None else len(plan.buckets)
        # Bytes the busiest device sends, from dpjax's alpha-beta model (exact for the explicit
        # algorithms); XLA's own all-reduce (xla-auto, psum) is modelled as a ring.
        if alg == "no-comm":
            model_bytes = 0
        else:
            sizes = [sum(b.sizes) for b in plan.buckets] if plan else [x.size for x in jax.tree.leaves(params)]
            model_bytes = sum(schedule(alg or "psum", dp, m).bytes for m in sizes)
        t0 = time.perf_counter()
        compiled = fn.lower(params, opt_state, batches[0]).compile()
        compile_s = time.perf_counter() - t0
        comm = hlo_comm(compiled.as_text())
        variants[name] = {"label": label, "fn": fn, "state": (params, opt_state), "buckets": buckets,
                          "ops": dict(comm.ops), "model_bytes": model_bytes,
                          "hlo_bytes": comm.max_bytes, "compile_s": compile_s,
                          "sgd_update": (lambda alg=alg, fusion=fusion: sgd_update(alg, fusion))}
    info = {"mesh": dict(mesh.shape), "platform": mesh.devices.flat[0].platform,
            "params": int(sum(x.size for x in jax.tree.leaves(variants[args.variants[0]]["state"][0]))),
            "param_bytes": S.num_bytes(variants[args.variants[0]]["state"][0]),
            "tokens_per_step": args.batch_size * args.seq_len, "jax": jax.__version__, "git": git_state()}
    return variants, batches, info


def build_layouts(args):
    """Per layout: XLA's automatic sharding vs dpjax's explicit step, same shardings."""
    import jax
    import optax
    from jax.flatten_util import ravel_pytree

    from dpjax import step as S
    from dpjax.collectives.cost import hlo_comm
    from dpjax.data import make_streams
    from dpjax.mesh import make_mesh, mesh_size
    from dpjax.models import get_model
    from dpjax.sharding import make_layout

    model = get_model("gpt", seq_len=args.seq_len)
    opt = S.OptimizerConfig()
    key = jax.random.key(args.seed)
    stream, _ = make_streams("synthetic", args.seq_len, args.seed)
    devs = pick_devices(max(mesh_size(lay.split("/")[0]) for lay in args.layouts))
    variants, batches = {}, {}

    def make_fn(layout, auto, opt_cfg, donate=True):
        """auto: XLA's step with the layout's shardings; else dpjax's step on the layout."""
        mesh = layout.mesh
        if not auto:
            tx = S.distributed_optimizer(opt_cfg, layout, args.batch_size, algorithm=args.layout_algorithm)
            return tx, S.make_train_step(model, tx, layout, donate=donate)
        tx = opt_cfg.make(args.batch_size)
        shard_p = layout.shardings()
        shard_o = layout.shardings(S.opt_specs(tx, layout, model))

        def xla_step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(model.loss)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return tx, jax.jit(xla_step, in_shardings=(shard_p, shard_o, S.batch_sharding(mesh)),
                           out_shardings=(shard_p, shard_o, S.replicated(mesh)),
                           donate_argnums=(0, 1) if donate else ())

    for lay in args.layouts:
        spec, _, flag = lay.partition("/")
        mesh = make_mesh(spec, devs[:mesh_size(spec)])
        batches[lay] = [S.put_batch(stream, i * args.batch_size, args.batch_size, mesh) for i in range(4)]
        tp_algs = args.tp_algorithms if mesh.shape["model"] > 1 else args.tp_algorithms[:1]
        for auto, tp_alg in [(True, tp_algs[0])] + [(False, a) for a in tp_algs]:
            layout = make_layout(model, mesh, algorithm=tp_alg, fsdp=flag == "fsdp",
                                 fsdp_algorithm=args.layout_algorithm)
            name = f"{lay} " + ("xla-auto" if auto else f"{args.layout_algorithm} tp-{tp_alg}")
            tx, fn = make_fn(layout, auto, opt)
            params, opt_state = S.init_state(model, tx, layout, key)

            def sgd_update(layout=layout, auto=auto, lay=lay):
                tx, fn = make_fn(layout, auto, S.OptimizerConfig(name="sgd", lr=1.0, clip_norm=0.0), donate=False)
                p0, o0 = S.init_state(model, tx, layout, key)
                p1 = fn(p0, o0, batches[lay][0])[0]
                return np.asarray(ravel_pytree(p1)[0]) - np.asarray(ravel_pytree(p0)[0])

            t0 = time.perf_counter()
            compiled = fn.lower(params, opt_state, batches[lay][0]).compile()
            compile_s = time.perf_counter() - t0
            comm = hlo_comm(compiled.as_text())
            label = f"{lay}: " + ("xla-auto" if auto else f"dpjax {args.layout_algorithm}"
                                  + (f", tp {tp_alg}" if mesh.shape["model"] > 1 else ""))
            variants[name] = {"label": label, "fn": fn, "state": (params, opt_state), "buckets": None,
                              "ops": dict(comm.ops), "model_bytes": comm.max_bytes, "hlo_bytes": comm.max_bytes,
                              "compile_s": compile_s, "sgd_update": sgd_update, "batches": batches[lay],
                              "base": f"{lay} xla-auto"}
    info = {"mesh": {"layouts": len(args.layouts)}, "platform": devs[0].platform,
            "params": int(sum(x.size for x in jax.tree.leaves(jax.eval_shape(model.init, key)))),
            "param_bytes": 4 * int(sum(x.size for x in jax.tree.leaves(jax.eval_shape(model.init, key)))),
            "tokens_per_step": args.batch_size * args.seq_len, "jax": jax.__version__, "git": git_state()}
    return variants, batches[args.layouts[0]], info


def build_pipeline(args):
    """Per schedule and M: dpjax's pipelined step on the stage mesh; the baseline: the plain
    data-parallel step on every device (no stage axis). Same model, batch, initial values."""
    import jax

    from dpjax import step as S
    from dpjax.collectives.cost import hlo_comm
    from dpjax.data import make_streams
    from dpjax.mesh import STAGE, make_mesh, mesh_size
    from dpjax.models import get_model
    from dpjax.pipeline import SCHEDULES, Pipeline, bubble_formula
    from dpjax.sharding import make_layout

    n = mesh_size(args.pipeline)
    if n is None:
        raise SystemExit(f"error: give the mesh sizes explicitly, not {args.pipeline!r}")
    devs = pick_devices(n)
    model = get_model("gpt", seq_len=args.seq_len, n_layers=args.n_layers, d_model=args.d_model)
    stream, _ = make_streams("synthetic", args.seq_len, args.seed)
    host = jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(args.seed)))  # one init for all
    variants, batches = {}, {}

    def make(mesh, pipe, opt):
        layout = make_layout(model, mesh, pipeline=pipe)
        step = S.for_model(model, layout, global_batch=args.batch_size, opt=opt, donate=False)
        return layout, step

    def add(name, label, mesh, pipe, extra):
        batches[name] = [S.put_batch(stream, i * args.batch_size, args.batch_size, mesh, passes=1)
                         for i in range(4)]
        layout, step = make(mesh, pipe, S.OptimizerConfig())
        params, state = step.init(jax.device_put(layout.store(host), layout.shardings()))
        t0 = time.perf_counter()
        compiled = step.train.lower(params, state, batches[name][0]).compile()
        mem = compiled.memory_analysis()

        def sgd_losses(mesh=mesh, pipe=pipe, name=name):
            lay, st = make(mesh, pipe, S.OptimizerConfig(name="sgd", lr=0.1, clip_norm=0.0))
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
    return variants, batches["stage=1"], info


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
    from dpjax.pipeline import cost

    for v in variants.values():
        if "pipe" in v:
            r = cost.measure_bubble(info["model"], info["stages"], v["pipe"], rows=info["replica_rows"])
            v["bubble_measured"], v["useful_vs_expected"], v["ends_share"] = (r["bubble"], r["useful_vs_expected"],
                                                                              r["ends_share"])


def memory_sweep(args, console) -> list:
    """temp / argument bytes of the AdamW step against M at a fixed micro-batch size."""
    from dpjax import step as S
    from dpjax.mesh import make_mesh, mesh_size
    from dpjax.models import get_model
    from dpjax.pipeline import SCHEDULES, Pipeline, cost
    from dpjax.sharding import make_layout

    mesh = make_mesh(args.pipeline, pick_devices(mesh_size(args.pipeline)))
    model = get_model("gpt", seq_len=args.seq_len, n_layers=args.n_layers, d_model=args.d_model)
    dp = mesh.size // mesh.shape["stage"] // mesh.shape.get("model", 1)
    rows = []
    for schedule in args.schedules:
        V = args.virtual_stages if SCHEDULES[schedule].virtual_stages else 1
        for M in args.microbatches:
            global_batch = args.microbatch_rows * M * dp
            layout = make_layout(model, mesh, pipeline=Pipeline(schedule, M, V))
            step = S.for_model(model, layout, global_batch=global_batch, opt=S.OptimizerConfig(), donate=False)
            ma = cost.train_memory(step, model, global_batch)
            rows.append({"schedule": schedule + (f" V={V}" if V > 1 else ""), "M": M,
                         "temp_bytes": ma.temp_size_in_bytes, "args_bytes": ma.argument_size_in_bytes})
            console.print(f"{rows[-1]['schedule']:>16} M={M:<3} temp {ma.temp_size_in_bytes / 2**20:8.3f} MiB  "
                          f"arguments {ma.argument_size_in_bytes / 2**20:8.3f} MiB")
    return rows


def run_step(v, batches, i):
    """Step i of variant v on batch i (cycled); per-layout variants have their own copy of
    the batches, placed on their mesh."""
    import jax

    params, opt_state = v["state"]
    batches = v.get("batches", batches)
    params, opt_state, loss = v["fn"](params, opt_state, batches[i % len(batches)])
    jax.block_until_ready((params, opt_state, loss))
    v["state"] = (params, opt_state)
    return loss


def check(args, variants, batches):
    """Every variant takes the same AdamW steps from the same init (losses must match
    xla-auto's), and one plain SGD step (its update, the averaged gradient, must match too)."""
    losses = {name: [float(run_step(v, batches, i)) for i in range(args.check_steps)]
              for name, v in variants.items()}
    updates = {name: v["sgd_update"]() for name, v in variants.items()}
    result = {}
    for name, ls in losses.items():
        base = variants[name].get("base", "xla-auto")
        ref, ref_u = losses[base], updates[base]
        scale = float(np.max(np.abs(ref_u)))
        rel = max(abs(a - b) / abs(b) for a, b in zip(ls, ref))
        urel = float(np.max(np.abs(updates[name] - ref_u))) / scale
        # no-comm computes another step (un-averaged gradients): shown, not judged.
        ok = None if name == "no-comm" else (rel <= args.rtol and urel <= args.rtol)
        result[name] = {"losses": ls, "max_rel_diff": rel, "grad_max_diff_rel": urel, "ok": ok}
    return result


def time_all(args, variants, batches):
    names = list(variants)
    for i in range(args.warmup):
        for name in names:
            run_step(variants[name], batches, i)
    times = {name: [] for name in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(args.reps):
            k = r % len(names)  # rotate who goes first, so no variant always follows the same one
            for name in names[k:] + names[:k]:
                t0 = time.perf_counter()
                run_step(variants[name], batches, r)
                times[name].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return times


def quantile(xs, q):
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarise(args, variants, times, checks, info):
    rows = []
    for name, v in variants.items():
        ts, base_ts = times[name], times[v.get("base", "xla-auto")]
        base = statistics.median(base_ts)
        med = statistics.median(ts)
        rows.append({
            "variant": name, "label": v["label"], "median_ms": med * 1e3,
            "p25_ms": quantile(ts, 0.25) * 1e3, "p75_ms": quantile(ts, 0.75) * 1e3,
            "tokens_per_s": info["tokens_per_step"] / med, "ratio": med / base,
            # Same-round ratios cancel load that drifts between rounds.
            "paired_ratio": statistics.median(t / b for t, b in zip(ts, base_ts)),
            "buckets": v["buckets"], "ops": v["ops"], "ops_text": format_ops(v["ops"]),
            "model_bytes_sent": v["model_bytes"], "hlo_comm_max_bytes": v["hlo_bytes"],
            "compile_s": v["compile_s"],
            "loss_check": checks[name], "times_ms": [t * 1e3 for t in ts],
        })
    return rows


TABLE_HEAD = ("variant", "median ms (p25-p75)", "tokens/s", "x xla-auto", "paired x", "buckets",
              "MiB sent (model)", "collective ops in step")


def table_cells(r):
    return (r["label"], f"{r['median_ms']:.1f} ({r['p25_ms']:.1f}-{r['p75_ms']:.1f})",
            f"{r['tokens_per_s']:,.0f}", f"{r['ratio']:.2f}", f"{r['paired_ratio']:.2f}",
            "-" if r["buckets"] is None else str(r["buckets"]), f"{r['model_bytes_sent'] / 2**20:.2f}",
            r["ops_text"])


def markdown(args, rows, info, argv) -> str:
    where = (f"layouts {', '.join(args.layouts)}, each against XLA's automatic partitioning of the same "
             "shardings" if args.layouts else f"mesh {'x'.join(str(s) for s in info['mesh'].values())}")
    lines = [f"`python experiments/bench_train.py {' '.join(argv)}`".replace(" `", "`"), "",
             f"GPT {info['params']:,} parameters ({info['param_bytes'] / 2**20:.2f} MiB f32), "
             f"global batch {args.batch_size} x {args.seq_len} tokens, {where} on {info['platform']}, "
             f"median of {args.reps} interleaved steps after {args.warmup} warm-up steps. "
             "\"x xla-auto\": ratio of medians; \"paired x\": median over rounds of the ratio to "
             "xla-auto's step in the same round. \"MiB sent (model)\": bytes the busiest device "
             "sends per step under `dpjax.collectives.cost.schedule` (XLA's all-reduce modelled as a ring); "
             "\"collective ops\": `hlo_comm` of the compiled step (in dpjax steps the all-reduce is the "
             "loss `pmean`; with psum XLA merges the gradient's into it).", "",
             "| " + " | ".join(TABLE_HEAD) + " |", "|" + "|".join(["---"] + ["---:"] * 6 + ["---"]) + "|"]
    lines += ["| " + " | ".join(table_cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    simulate_cpu_devices(args.devices)  # before JAX initialises its backends
    from rich.console import Console
    from rich.table import Table

    # Wide enough for the table when piped to a file (rich assumes 80 columns there).
    console = Console() if sys.stdout.isatty() else Console(width=150)
    if args.pipeline:
        return main_pipeline(args, argv, console)
    variants, batches, info = build_layouts(args) if args.layouts else build(args)
    console.print(f"GPT {info['params']:,} params, batch {args.batch_size}x{args.seq_len}, mesh "
                  f"{info['mesh']} on {info['platform']} ({platform.processor() or platform.machine()})")

    checks = check(args, variants, batches)
    t = Table(title=f"check: {args.check_steps} AdamW steps and 1 SGD step from the same init, same batches")
    t.add_column("variant")
    for i in range(args.check_steps):
        t.add_column(f"loss @ step {i}", justify="right")
    t.add_column("max rel. diff vs xla-auto", justify="right")
    t.add_column("SGD-step gradient diff (rel. to max)", justify="right")
    t.add_column("ok")
    for name, c in checks.items():
        t.add_row(variants[name]["label"], *[f"{x:.7f}" for x in c["losses"]], f"{c['max_rel_diff']:.1e}",
                  f"{c['grad_max_diff_rel']:.1e}", "n/a" if c["ok"] is None else "yes" if c["ok"] else "[red]NO[/red]")
    console.print(t)
    all_ok = all(c["ok"] is not False for c in checks.values())
    if not all_ok:
        console.print(f"[red]losses or gradients differ from xla-auto by more than rtol={args.rtol}: the variants "
                      "do not compute the same step; timings below compare different things[/red]")

    load = [os.getloadavg()[0]]
    times = time_all(args, variants, batches)
    load.append(os.getloadavg()[0])
    info["load_avg_1min"] = load
    rows = summarise(args, variants, times, checks, info)
    t = Table(title=f"train step, median of {args.reps} interleaved reps ({args.warmup} warm-up)")
    for i, h in enumerate(TABLE_HEAD):
        t.add_column(h, justify="left" if i in (0, len(TABLE_HEAD) - 1) else "right")
    for r in rows:
        t.add_row(*table_cells(r))
    console.print(t)
    console.print(f"1-minute load average before / after timing: {load[0]:.1f} / {load[1]:.1f} "
                  f"on {os.cpu_count()} cores")

    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(args, rows, info, argv))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "info": info, "loss_check_ok": all_ok,
                       "rows": rows}, f, indent=1)
    return 0 if all_ok else 1


def main_pipeline(args, argv, console) -> int:
    from rich.table import Table

    if args.memory_sweep:
        rows = memory_sweep(args, console)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(f"`python experiments/bench_train.py {' '.join(argv)}`\n\n| schedule | M | temporaries MiB "
                        "| arguments MiB |\n|---|---:|---:|---:|\n")
                f.writelines(f"| {r['schedule']} | {r['M']} | {r['temp_bytes'] / 2**20:.3f} | "
                             f"{r['args_bytes'] / 2**20:.3f} |\n" for r in rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f, indent=1)
        return 0
    variants, batches, info = build_pipeline(args)
    console.print(f"GPT {info['params']:,} params, {args.n_layers} layers, batch {args.batch_size}x{args.seq_len}, "
                  f"{args.pipeline} against data={info['devices']} on {info['platform']}")
    checks = check_pipeline(args, variants)
    all_ok = all(c["ok"] for c in checks.values())
    for name, c in checks.items():
        console.print(f"check {variants[name]['label']}: SGD losses {', '.join(f'{x:.6f}' for x in c['losses'])} "
                      f"(max rel. diff {c['max_rel_diff']:.1e}) {'ok' if c['ok'] else '[red]DIFFERS[/red]'}")
    if args.flops:
        pipeline_flops(args, variants, info)
    load = [os.getloadavg()[0]]
    times = time_all(args, variants, batches)
    load.append(os.getloadavg()[0])
    base = statistics.median(times["stage=1"])
    head = ("variant", "median ms (p25-p75)", "x stage=1", "paired x", "bubble (papers)", "bubble, FLOPs",
            "arguments MiB", "temporaries MiB")
    t = Table(title=f"train step (AdamW), median of {args.reps} interleaved reps ({args.warmup} warm-up)")
    for h in head:
        t.add_column(h, justify="left" if h == "variant" else "right")
    rows = []
    for name, v in variants.items():
        ts = times[name]
        med = statistics.median(ts)
        row = {"variant": name, "label": v["label"], "median_ms": med * 1e3, "p25_ms": quantile(ts, 0.25) * 1e3,
               "p75_ms": quantile(ts, 0.75) * 1e3, "ratio": med / base,
               "paired_ratio": statistics.median(a / b for a, b in zip(ts, times["stage=1"])),
               "bubble_formula": v["bubble_formula"], "bubble_measured": v.get("bubble_measured"),
               "useful_vs_expected": v.get("useful_vs_expected"), "ends_share": v.get("ends_share"),
               "args_bytes": v["args_bytes"],
               "temp_bytes": v["temp_bytes"], "compile_s": v["compile_s"], "loss_check": checks[name],
               "times_ms": [x * 1e3 for x in ts]}
        rows.append(row)
        t.add_row(v["label"], f"{row['median_ms']:.1f} ({row['p25_ms']:.1f}-{row['p75_ms']:.1f})",
                  f"{row['ratio']:.2f}", f"{row['paired_ratio']:.2f}", f"{row['bubble_formula']:.3f}",
                  "-" if row["bubble_measured"] is None else f"{row['bubble_measured']:.3f}",
                  f"{row['args_bytes'] / 2**20:.2f}", f"{row['temp_bytes'] / 2**20:.2f}")
    console.print(t)
    console.print(f"1-minute load average before / after timing: {load[0]:.1f} / {load[1]:.1f} on {os.cpu_count()} cores")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"`python experiments/bench_train.py {' '.join(argv)}`\n\n| " + " | ".join(head) + " |\n|"
                    + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|\n")
            for r in rows:
                f.write(f"| {r['label']} | {r['median_ms']:.1f} ({r['p25_ms']:.1f}-{r['p75_ms']:.1f}) | "
                        f"{r['ratio']:.2f} | {r['paired_ratio']:.2f} | {r['bubble_formula']:.3f} | "
                        + ("-" if r["bubble_measured"] is None else f"{r['bubble_measured']:.3f}")
                        + f" | {r['args_bytes'] / 2**20:.2f} | {r['temp_bytes'] / 2**20:.2f} |\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "load_avg_1min": load, "loss_check_ok": all_ok,
                       "rows": rows}, f, indent=1, default=str)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
