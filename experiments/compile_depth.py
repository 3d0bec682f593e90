"""Compile time of one training step against depth: the layers as a Python loop or one lax.scan.

    python experiments/compile_depth.py --plot experiments/plots/compile_depth.png \\
        --json experiments/plots/compile_depth.json
    python experiments/compile_depth.py --smoke       # 2 depths of a tiny GPT (seconds)

The step is the one `python -m dpjax.train` runs: Settings -> `dpjax.plan.resolve` ->
`dpjax.step.for_plan` (what the Trainer calls), then its train program lowered and
compiled, `step.train.lower(params, state, batch).compile()`, on abstract arguments
(shapes and shardings: nothing is initialised or run). Two numbers per compile: trace +
lower (JAX: tracing the step, the shard_map, the collectives, into StableHLO) and
compile (XLA: optimising and code generation); their sum is what a run waits for before
its first step.

"before" is `--layer-loop` (the stacked layers unrolled by a Python loop: the program
holds L copies of the layer); "after" is the default (`dpjax.compute.stack`: one `lax.scan`
over the layer axis, the layer traced and compiled once). The model is the main job's
GPT width (d_model 128, 8 heads, d_ff 512, seq 128, batch 32) at each depth, mesh 8x1
on 8 simulated CPU devices; `--extra` adds other layouts at a few depths.

Each compile starts cold: a fresh step (new jitted functions), JAX's in-memory caches
cleared and the persistent compilation cache off. Each is timed twice: wall clock, and
the CPU seconds this process spent (`time.process_time`, every thread), which a loaded
shared machine stretches far less than the wall clock. The measurements are interleaved
(each round compiles every point once, the starting variant alternating), so load from
other processes hits both variants alike; reported per point: the median over rounds,
and loop / scan, the median of the same-round ratios. A loop compile that takes more
than --loop-cap-s CPU seconds stops the loop at greater depths, that round and after (said in
the output); --resume goes on from a JSON written before.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import _bench

_bench.simulate(8)  # before jax starts

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from dpjax import step as S  # noqa: E402
from dpjax.mesh import data_axes, mesh_size  # noqa: E402
from dpjax.plan import resolve  # noqa: E402
from dpjax.settings import Settings  # noqa: E402

VARIANTS = {"loop": True, "scan": False}  # name -> --layer-loop


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 16, 32, 48], help="n_layers")
    p.add_argument("--rounds", type=int, default=3, help="compiles per point (the median is reported)")
    p.add_argument("--mesh", default="8x1")
    p.add_argument("--extra", nargs="*", default=["2x4", "8x1,fsdp"],
                   help="more layouts (MESH or MESH,fsdp), measured at --extra-depths in the same rounds")
    p.add_argument("--extra-depths", type=int, nargs="*", default=[2, 8, 32])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--loop-cap-s", type=float, default=300.0,
                   help="a loop compile taking more CPU seconds than this (trace + lower + compile) skips the loop "
                        "at greater depths")
    p.add_argument("--resume", default=None, help="a JSON this script wrote: its compiles count, the rounds go on")
    p.add_argument("--budget-s", type=float, default=float("inf"),
                   help="start no new round after this many seconds (the JSON is written after every compile)")
    p.add_argument("--plot", default=None, help="PNG: seconds against depth, loop and scan")
    p.add_argument("--json", default=None, help="every compile's times and the summary as JSON")
    _bench.add_smoke(p, "depths 1 and 2, d_model 32, seq 16, one round, mesh 2x1")
    args = p.parse_args(argv)
    if args.smoke:
        args.depths, args.rounds, args.mesh, args.extra, args.extra_depths = [1, 2], 1, "2x1", [], []
        args.d_model, args.n_heads, args.d_ff, args.seq_len, args.batch_size = 32, 4, 64, 16, 8
        args.plot, args.json = args.plot or "compile_depth.png", args.json or "compile_depth.json"
        _bench.smoke_outputs(args, "plot", "json")
    return args


def layouts(args) -> list[tuple[str, bool]]:
    out = [(args.mesh, False)]
    for text in args.extra:
        fsdp = text.endswith(",fsdp")
        out.append((text[:-len(",fsdp")] if fsdp else text, fsdp))
    return out


def name_of(layout) -> str:
    mesh, fsdp = layout
    return mesh + (" fsdp" if fsdp else "")


def settings(args, depth: int, layout, loop: bool) -> Settings:
    mesh, fsdp = layout
    # device_memory: the planner's memory check on CPU reads the host's memory available at that
    # moment, and on a shared machine another job's peak made it refuse this small step (issue
    # noted in RESULTS.md); a fixed figure keeps the check and the same policy (remat none).
    return Settings(mesh=mesh, model="gpt", fsdp=fsdp, layer_loop=loop, batch_size=args.batch_size,
                    device_memory="8GiB",
                    seq_len=args.seq_len, model_options={"n_layers": depth, "d_model": args.d_model,
                                                         "n_heads": args.n_heads, "d_ff": args.d_ff})


def abstract_args(step, plan):
    """(params, state, batch) as ShapeDtypeStructs with the shardings the Trainer's values have."""
    layout, model = plan.layout, plan.model
    params = jax.eval_shape(lambda k: plan.policy.store(layout.store(model.init(k))), jax.random.key(0))
    state = jax.eval_shape(step.init, params)[1]
    p_sh, s_sh = step.shardings()
    with_sharding = lambda xs, shs: jax.tree.map(  # noqa: E731
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), xs, shs)
    batch = jax.ShapeDtypeStruct((plan.passes, plan.global_batch, model.config.seq_len + 1), "int32",
                                 sharding=NamedSharding(plan.mesh, P(None, data_axes(plan.mesh) or None)))
    return with_sharding(params, p_sh), with_sharding(state, s_sh), batch


def compile_once(args, depth: int, layout, loop: bool) -> dict:
    """One cold compile of the train step: seconds to trace + lower, and to compile."""
    jax.clear_caches()
    gc.collect()
    plan = resolve(settings(args, depth, layout, loop), jax.devices()[:mesh_size(layout[0]) or None])
    step = S.for_plan(plan)  # fresh jitted functions: nothing traced before
    params, state, batch = abstract_args(step, plan)
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = step.train.lower(params, state, batch)
    t1, c1 = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
    assert plan.policy.scan == (not loop) and plan.policy.remat == "none", plan.policy
    hlo_lines = compiled.as_text().count("\n")
    del compiled, lowered, step
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0, "hlo_lines": hlo_lines,
            "cpu_lower_s": c1 - c0, "cpu_compile_s": c2 - c1, "cpu_total_s": c2 - c0}


def points(args):
    """(layout, depth) in the order a round visits them."""
    main, *extra = layouts(args)
    out = [(main, d) for d in args.depths]
    out += [(lay, d) for lay in extra for d in args.extra_depths]
    return out


def resumed(path, cap_s: float):
    """(times, capped) from a JSON this script wrote (--resume); the loop is capped again by
    this run's --loop-cap-s."""
    with open(path) as fh:
        saved = json.load(fh)
    times, capped = {}, {}
    for c in saved["compiles"]:
        c = dict(c)
        key = (c.pop("layout"), c.pop("depth"), c.pop("variant"))
        times.setdefault(key, []).append(c)
        if key[2] == "loop" and c["cpu_total_s"] > cap_s:
            capped[key[0]] = min(capped.get(key[0], key[1]), key[1])
    return times, capped


def measure(args, save=None):
    """({(layout name, depth, variant): [compile_once rows]}, {layout name: capped depth}),
    interleaved rounds; save(times, capped) after every compile (a long run keeps what it
    measured). No round starts after --budget-s. With --resume, a (round, point, variant)
    already measured is not measured again."""
    # capped: layout name -> the depth whose loop compile passed --loop-cap-s
    times, capped = resumed(args.resume, args.loop_cap_s) if args.resume else ({}, {})
    t0 = time.perf_counter()
    for r in range(args.rounds):
        if r and time.perf_counter() - t0 > args.budget_s:
            print(f"--budget-s {args.budget_s:g} spent: {r} rounds", flush=True)
            break
        for i, (layout, depth) in enumerate(points(args)):
            order = list(VARIANTS) if (r + i) % 2 == 0 else list(VARIANTS)[::-1]
            for variant in order:
                lname = name_of(layout)
                if variant == "loop" and lname in capped and depth > capped[lname]:
                    continue
                if any(x["round"] == r for x in times.get((lname, depth, variant), [])):
                    continue  # --resume: measured before
                row = compile_once(args, depth, layout, VARIANTS[variant])
                row["round"] = r
                times.setdefault((lname, depth, variant), []).append(row)
                print(f"  round {r + 1}/{args.rounds}  {lname:<9} L={depth:<3} {variant:<4}  wall: trace+lower "
                      f"{row['lower_s']:7.2f} s, compile {row['compile_s']:7.2f} s;  CPU: {row['cpu_lower_s']:6.2f} + "
                      f"{row['cpu_compile_s']:6.2f} s  (load {_bench.load_avg():.1f})", flush=True)
                if variant == "loop" and row["cpu_total_s"] > args.loop_cap_s:
                    capped[lname] = min(capped.get(lname, depth), depth)
                if save is not None:
                    save(times, capped)
    return times, capped


KEYS = ("lower_s", "compile_s", "total_s", "cpu_lower_s", "cpu_compile_s", "cpu_total_s")


def summarise(times) -> list[dict]:
    """One row per (layout, depth): each variant's medians; loop / scan as the median of
    same-round ratios (load that drifts between rounds cancels), wall and CPU."""
    rows, order = [], list(dict.fromkeys(k[0] for k in times))  # the main layout first, as measured
    for (lname, depth, variant), scan in sorted(times.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        if variant != "scan":
            continue
        loop = times.get((lname, depth, "loop"), [])
        row = {"layout": lname, "depth": depth, "rounds_scan": len(scan), "rounds_loop": len(loop)}
        for v, rs in (("scan", scan), ("loop", loop)):
            for k in KEYS:
                row[f"{v}_{k}"] = _bench.median([x[k] for x in rs]) if rs else None
            row[f"{v}_hlo_lines"] = rs[0]["hlo_lines"] if rs else None
        for k, key in (("ratio", "total_s"), ("ratio_cpu", "cpu_total_s")):
            same = {x["round"]: x[key] for x in scan}
            pairs = [x[key] / same[x["round"]] for x in loop if x["round"] in same]
            row[k] = _bench.median(pairs) if pairs else None
        rows.append(row)
    return rows


def plot(path, rows, title) -> None:
    plt = _bench.pyplot(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    for ax, prefix, what in ((axes[0], "", "wall clock"), (axes[1], "cpu_", "CPU time of the process")):
        for lname in dict.fromkeys(r["layout"] for r in rows):
            mine = [r for r in rows if r["layout"] == lname]
            style = "-" if lname == rows[0]["layout"] else ":"
            for v, marker in (("loop", "o"), ("scan", "s")):
                pts = [(r["depth"], r[f"{v}_{prefix}total_s"]) for r in mine if r[f"{v}_{prefix}total_s"] is not None]
                if pts:
                    label = f"{lname}: {'Python loop (--layer-loop)' if v == 'loop' else 'lax.scan (default)'}"
                    ax.plot(*zip(*pts), style, marker=marker, label=label)
        ax.set(xlabel="layers", title=what)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("trace + lower + compile (s, median)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


def fmt(x, f=".1f"):
    return "-" if x is None else format(x, f)


def table(rows) -> str:
    head = ["layout", "layers", "rounds loop / scan", "loop: wall (s)", "scan: wall (s)", "loop / scan wall",
            "loop: CPU (s)", "scan: CPU (s)", "loop / scan CPU", "loop CPU: trace+lower + compile",
            "HLO lines loop / scan"]
    out = [[r["layout"], r["depth"], f"{r['rounds_loop']} / {r['rounds_scan']}", fmt(r["loop_total_s"]),
            fmt(r["scan_total_s"]), fmt(r["ratio"], ".2f"), fmt(r["loop_cpu_total_s"]), fmt(r["scan_cpu_total_s"]),
            fmt(r["ratio_cpu"], ".2f"),
            "-" if r["loop_cpu_lower_s"] is None else f"{r['loop_cpu_lower_s']:.1f} + {r['loop_cpu_compile_s']:.1f}",
            f"{fmt(r['loop_hlo_lines'], 'd')} / {r['scan_hlo_lines']}"] for r in rows]
    return _bench.markdown_table(head, out, right=range(1, len(head)))


def main(argv=None) -> int:
    args = parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # every compile cold, whatever the environment says
    start, load0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), _bench.load_avg()
    header = (f"{_bench.machine()}; GPT d_model {args.d_model}, {args.n_heads} heads, d_ff {args.d_ff}, seq "
              f"{args.seq_len}, batch {args.batch_size}; up to {args.rounds} rounds")
    print(f"{header}; load average {load0:.1f}", flush=True)
    t0 = time.perf_counter()

    def save(times, capped, final=False):
        if not args.json:
            return
        with open(args.json, "w") as fh:
            json.dump({"machine": _bench.machine(), "date": start, "load_before": load0,
                       "load_now": _bench.load_avg(), "wall_s": time.perf_counter() - t0, "complete": final,
                       "args": {k: v for k, v in vars(args).items() if k not in ("plot", "json")},
                       "capped": capped, "summary": summarise(times),
                       "compiles": [{"layout": k[0], "depth": k[1], "variant": k[2], **x}
                                    for k, xs in times.items() for x in xs], "git": _bench.git_state()},
                      fh, indent=1)

    times, capped = measure(args, save)
    wall, load1 = time.perf_counter() - t0, _bench.load_avg()
    rows = summarise(times)
    print(f"\n{header}; {start}; load average {load0:.1f} before, {load1:.1f} after; {wall:.0f} s in all\n")
    print(table(rows))
    for lname, depth in capped.items():
        print(f"the loop on {lname} took over --loop-cap-s {args.loop_cap_s:g} CPU s at {depth} layers: "
              "not compiled deeper")
    save(times, capped, final=True)
    if args.json:
        print(f"wrote {args.json}", flush=True)
    if args.plot:
        plot(args.plot, rows, f"compile time of the train step against depth (GPT d_model {args.d_model}, "
                              f"{_bench.machine()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
