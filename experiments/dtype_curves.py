"""Compute dtypes against each other: the main job's loss curves with each (bfloat16 against
float32, issue 27; fp8 against bfloat16, issue 38).

    python experiments/dtype_curves.py --plot experiments/plots/dtype_curves.png \\
        --json experiments/plots/dtype_curves.json
    python experiments/dtype_curves.py --dtypes bfloat16 fp8 --control-seeds 1 --steps 100 \\
        --plot experiments/plots/fp8_vs_bf16.png --json experiments/plots/fp8_vs_bf16.json
    python experiments/dtype_curves.py --smoke        # a tiny GPT, 2 steps (seconds)
    python experiments/dtype_curves.py --smoke --dtypes bfloat16 fp8

Each dtype is one run of the command a user types, `python -m dpjax.train` with its
defaults (the GPT of d_model 128, 2 layers, seq 128, batch 32, AdamW 3e-3, 200 steps,
mesh 8x1 on 8 simulated CPU devices), `--dtype float32` or `--dtype bfloat16`, the same
seed and the same batches, its per-step metrics in a `--metrics` file. The master
weights, the optimizer state, layer-norm statistics, softmax, logits and loss stay
float32 whatever `--dtype` says (`dpjax.compute.policy`): only the layers' matmuls and the
residual stream change (fp8: the projections' matmuls in float8 with per-tensor scaling,
`dpjax.compute.fp8`, the rest in bfloat16). Reported: the train and validation losses side by side, the
final-loss difference in percent ((bf16 - f32) / f32), and the step times.

The runs start together and run side by side (`--sequential`: one after the other), so
load from other processes on a shared machine hits both alike; each run's step time is
its median over the steps after the first (which compiles). On CPU, XLA has few native
bfloat16 kernels: it computes most bfloat16 ops in float32 and converts around them, so
bfloat16 buys no speed there (it is a GPU / TPU setting); the loss difference is what
this experiment measures on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import _bench

ROOT = _bench.ROOT


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   help="compute dtypes (--dtype of python -m dpjax.train); the first is the reference")
    p.add_argument("--control-seeds", type=int, nargs="*", default=[],
                   help="also run the reference dtype with these --seed values: the loss difference of another "
                        "initialisation and data order, to set the dtype's difference against")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--mesh", default="8x1")
    p.add_argument("--train-args", default="", help="more flags for every run, e.g. '--n-layers 4'")
    p.add_argument("--sequential", action="store_true", help="one run after the other (default: side by side)")
    p.add_argument("--metrics-dir", default=None, help="keep the runs' --metrics files here (default: a temporary "
                                                       "directory)")
    p.add_argument("--plot", default=None, help="PNG: the loss curves and their difference")
    p.add_argument("--json", default=None, help="the curves, differences and step times as JSON")
    _bench.add_smoke(p, "mesh 2x1, d_model 32, 1 layer, seq 16, batch 8, 2 steps, control seed 1")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.mesh, args.control_seeds = 2, "2x1", args.control_seeds or [1]
        args.train_args = ("--d-model 32 --n-layers 1 --n-heads 2 --d-ff 64 --seq-len 16 --batch-size 8 "
                           "--eval-every 0 --eval-batches 1 " + args.train_args)
        if not args.plot:
            args.plot = "dtype_curves.png"
        if not args.json:
            args.json = "dtype_curves.json"
        tmp = _bench.smoke_outputs(args, "plot", "json")
        args.metrics_dir = args.metrics_dir or tmp
    return args


def variants(args) -> dict:
    """{name: (dtype, seed or None)}: one run per --dtypes, then the reference dtype with
    each --control-seeds seed (another initialisation and data order: the size of a
    difference that is not the dtype's)."""
    out = {d: (d, None) for d in args.dtypes}
    out.update({f"{args.dtypes[0]}, seed {s}": (args.dtypes[0], s) for s in args.control_seeds})
    return out


def command(args, name: str, metrics: str) -> list[str]:
    dtype, seed = variants(args)[name]
    return [sys.executable, "-m", "dpjax.train", "--mesh", args.mesh, "--steps", str(args.steps), "--dtype", dtype,
            "--metrics", metrics, "--progress", "log", *args.train_args.split(),
            *(["--seed", str(seed)] if seed is not None else [])]


def file_name(name: str) -> str:
    return "dtype_" + name.replace(", ", "_").replace(" ", "")


def read(metrics: str) -> dict:
    """A run's metrics file -> {"record", "steps", "loss", "step_time", "eval_steps", "eval_loss"}."""
    out = {"record": None, "steps": [], "loss": [], "step_time": [], "eval_steps": [], "eval_loss": []}
    with open(metrics) as fh:
        for line in fh:
            row = json.loads(line)
            if "record" in row:
                out["record"] = row["record"]
            elif "eval_loss" in row:
                out["eval_steps"].append(row["step"])
                out["eval_loss"].append(row["eval_loss"])
            elif "loss" in row:
                out["steps"].append(row["step"])
                out["loss"].append(row["loss"])
                out["step_time"].append(row["step_time"])
    return out


def run_all(args, folder: str) -> dict:
    """{dtype: metrics} of one run per dtype, side by side or one after the other."""
    env = _bench.checkout_env()
    names = list(variants(args))
    files = {d: os.path.join(folder, file_name(d) + ".jsonl") for d in names}
    logs = {d: os.path.join(folder, file_name(d) + ".log") for d in names}
    for d in names:
        if os.path.exists(files[d]):
            os.remove(files[d])  # a stale file must not be read (and dpjax.train refuses to replace it)
    procs = {}
    for d in names:
        cmd = command(args, d, files[d])
        print("$", " ".join(cmd[1:]), flush=True)
        with open(logs[d], "w") as log:
            procs[d] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if args.sequential:
            procs[d].wait()
    for d, proc in procs.items():
        if proc.wait() != 0:
            with open(logs[d]) as fh:
                tail = fh.read()[-3000:]
            raise SystemExit(f"error: the {d} run exited {proc.returncode}:\n{tail}")
        with open(logs[d]) as fh:
            print(f"  {d}: {fh.read().strip().splitlines()[-1]}", flush=True)
    return {d: read(files[d]) for d in names}


def machine() -> str:
    """The machine in words without importing jax here (the runs are subprocesses)."""
    import platform
    from importlib.metadata import version

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, 8 simulated CPU devices, "
            f"jax {version('jax')}")


def pct(x: float, ref: float) -> float:
    return 100.0 * (x - ref) / ref


def summarise(runs: dict) -> dict:
    ref_name = next(iter(runs))
    ref = runs[ref_name]
    tail = max(1, min(10, len(ref["loss"]) // 10))  # the last steps' mean: one step's loss is one batch's
    rows = {}
    for name, r in runs.items():
        times = r["step_time"][1:] or r["step_time"]  # the first step compiles
        row = {"final_loss": r["loss"][-1], f"mean_loss_last_{tail}": statistics.fmean(r["loss"][-tail:]),
               "final_eval_loss": r["eval_loss"][-1] if r["eval_loss"] else None,
               "median_step_s": statistics.median(times), "first_step_s": r["step_time"][0],
               "policy": (r["record"] or {}).get("plan", {}).get("policy")}
        if name != ref_name:
            row["final_loss_diff_pct"] = pct(r["loss"][-1], ref["loss"][-1])
            row[f"mean_loss_last_{tail}_diff_pct"] = pct(row[f"mean_loss_last_{tail}"],
                                                        statistics.fmean(ref["loss"][-tail:]))
            if r["eval_loss"] and ref["eval_loss"]:
                row["final_eval_loss_diff_pct"] = pct(r["eval_loss"][-1], ref["eval_loss"][-1])
            diffs = [abs(pct(a, b)) for a, b in zip(r["loss"], ref["loss"])]
            row["max_abs_step_diff_pct"] = max(diffs)
            row["step_time_ratio"] = row["median_step_s"] / statistics.median(ref["step_time"][1:] or
                                                                               ref["step_time"])
        rows[name] = row
    return rows


def plot(path: str, runs: dict, title: str) -> None:
    plt = _bench.pyplot(path)
    if plt is None:
        return
    ref_name = next(iter(runs))
    ref = runs[ref_name]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(7.5, 6.4), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    for name, r in runs.items():
        line, = ax.plot(r["steps"], r["loss"], lw=1.0, ls=":" if "seed" in name else "-",
                        label=f"train, --dtype {name}")
        if r["eval_loss"]:
            ax.plot(r["eval_steps"], r["eval_loss"], "o--", color=line.get_color(), ms=4,
                    label=f"validation, --dtype {name}")
        if name != ref_name:
            bx.plot(r["steps"], [pct(a, b) for a, b in zip(r["loss"], ref["loss"])], lw=1.0, color=line.get_color(),
                    ls=":" if "seed" in name else "-",
                    label=f"{name} vs {ref_name}")
    ax.set(ylabel="loss (nats / byte)", title=title)
    bx.axhline(0, color="k", lw=0.5)
    bx.set(xlabel="step", ylabel="train loss diff (%)")
    _bench.finish_plot(fig, (ax, bx), path)


def main(argv=None) -> int:
    args = parse_args(argv)
    load0, start = _bench.load_avg(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    folder = args.metrics_dir or tempfile.mkdtemp(prefix="dpjax-dtype-")
    os.makedirs(folder, exist_ok=True)
    t0 = time.perf_counter()
    runs = run_all(args, folder)
    wall = time.perf_counter() - t0
    rows = summarise(runs)
    load1 = _bench.load_avg()
    print(f"\n{start}; load average {load0:.1f} before, {load1:.1f} after; {wall:.0f} s; "
          f"{'one after the other' if args.sequential else 'side by side'}; mesh {args.mesh}, {args.steps} steps"
          + (f", {args.train_args}" if args.train_args else "") + "\n")
    ref_name = args.dtypes[0]
    tail_key = next(k for k in rows[ref_name] if k.startswith("mean_loss_last_"))
    head = ["--dtype", "final train loss", tail_key.replace("_", " "), "final validation loss",
            "diff final train (%)", "diff " + tail_key.replace("_", " ") + " (%)", "diff final validation (%)",
            "max abs diff, any step (%)", "median step (s)", f"step time / {ref_name}"]
    table = []
    for name, r in rows.items():
        def f(key, fmt):
            return "-" if r.get(key) is None else format(r[key], fmt)
        table.append([name, f("final_loss", ".4f"), f(tail_key, ".4f"), f("final_eval_loss", ".4f"),
                      f("final_loss_diff_pct", "+.2f"), f(tail_key + "_diff_pct", "+.2f"),
                      f("final_eval_loss_diff_pct", "+.2f"), f("max_abs_step_diff_pct", ".2f"),
                      f("median_step_s", ".3f"), f("step_time_ratio", ".2f")])
    print(_bench.markdown_table(head, table, right=range(1, len(head))))
    result = {"machine": machine(), "date": start, "load_before": load0,
              "load_after": load1, "wall_s": wall, "mesh": args.mesh, "steps": args.steps,
              "train_args": args.train_args, "side_by_side": not args.sequential,
              "commands": {d: " ".join(command(args, d, file_name(d) + ".jsonl")[1:]) for d in variants(args)},
              "summary": rows, "curves": {d: {k: r[k] for k in ("steps", "loss", "step_time", "eval_steps",
                                                                 "eval_loss")} for d, r in runs.items()},
              "git": _bench.git_state()}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {args.json}", flush=True)
    if args.plot:
        plot(args.plot, runs, f"main job (GPT, mesh {args.mesh}, {args.steps} steps): "
                              f"{' vs '.join(args.dtypes)} compute")
    return 0


if __name__ == "__main__":
    sys.exit(main())
