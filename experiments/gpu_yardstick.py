"""dpjax against the plain-JAX yardstick on one accelerator, in one run (issue 27's GPU check).

`../shared/gpu/ref_gpt.py` is 40 lines of plain JAX with dpjax's architecture and FLOP
formula (bf16 compute, cuDNN flash attention, layers scanned and rematerialised). This
script runs it and `python -m dpjax.train` (its defaults: the compute policy's `auto`)
one after the other on the same device, at the two sizes of `../shared/gpu/README.md`:

    405M  --d-model 2048 --n-layers 8  --n-heads 16 --d-ff 8192 --seq-len 1024 --batch 16
    1.2B  --d-model 2048 --n-layers 24 --n-heads 16 --d-ff 8192 --seq-len 2048 --batch 8

and writes a markdown table (median step time, model TFLOP/s, MFU against the bf16 peak,
the ratio dpjax / yardstick) plus whether `--timeline` built a timeline on the device.

    python experiments/gpu_yardstick.py --ref ../shared/gpu/ref_gpt.py --out yardstick.md
    python experiments/gpu_yardstick.py --smoke      # CPU, seconds, tiny sizes: what the tests run
    python experiments/gpu_yardstick.py --ref ../shared/gpu/ref_gpt.py --fp8 --sizes 1.2B --steps 100

`--remats auto,none` (issue 38's last 5%) runs dpjax once per remat at each size (auto: the
plan's choice, dots on a GPU since issue 38; none: what auto chose on the H200 before), so
one call shows the remat's share of the gap. `--hlo` runs `hlo_side_by_side.py` at each
size on the device (dpjax's step with auto's remat against the yardstick's, cuDNN attention
on a GPU: ops, matmul dtypes, what the layer scans keep, XLA's cost analysis there) and adds
its tables to the output: the compiled programs of the same call, side by side.

`--fp8` (issue 38) runs dpjax once more at each size with `--dtype fp8` and both dpjax runs
on the stdlib corpus (a loss that moves; the step time does not depend on the bytes): fp8's
step against dpjax's bf16 step and the final-loss difference after the same steps (the
goal: >= 1.2x at 1.2B, loss within 2%).

Each run is a process of its own (this one never imports JAX: on a GPU it would take the
memory the runs need). dpjax's step time is the median of its metrics rows after the
first `--skip` steps (compilation); model FLOP/s = the model's FLOPs per token x tokens
per second, the formula ref_gpt.py uses too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZES = {
    "405M": dict(d_model=2048, n_layers=8, n_heads=16, d_ff=8192, seq_len=1024, batch=16),
    "1.2B": dict(d_model=2048, n_layers=24, n_heads=16, d_ff=8192, seq_len=2048, batch=8),
}
SMOKE = {"tiny": dict(d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=16, batch=4)}
BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def _env(smoke: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if smoke:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    return env


def _run(cmd, env, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


def flops_per_token(size: dict) -> float:
    """models/gpt.py's formula (ref_gpt.py's too), byte vocabulary."""
    L, D, F, T, V = size["n_layers"], size["d_model"], size["d_ff"], size["seq_len"], 256
    return 6 * (L * (4 * D * D + 2 * D * F) + V * D) + 3 * (L * 4 * T * D)


def dpjax_run(size: dict, steps: int, skip: int, env, tmp: str, extra=(), data: str = "synthetic") -> dict:
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [sys.executable, "-m", "dpjax.train", "--mesh", "1x1", "--data", data, "--steps", str(steps),
           "--eval-every", "0", "--eval-batches", "1", "--progress", "none", "--metrics", metrics,
           "--d-model", str(size["d_model"]), "--n-layers", str(size["n_layers"]), "--n-heads", str(size["n_heads"]),
           "--d-ff", str(size["d_ff"]), "--seq-len", str(size["seq_len"]), "--batch-size", str(size["batch"]),
           *extra]
    r = _run(cmd, env, timeout=3600)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    rows = [json.loads(line) for line in open(metrics)]
    record = rows[0].get("record", {})
    times = [row["step_time"] for row in rows if "step_time" in row and row.get("step", 0) > skip]
    dt = statistics.median(times)
    tokens = size["batch"] * size["seq_len"]
    return {"step_s": dt, "model_tflops": flops_per_token(size) * tokens / dt / 1e12,
            "policy": record.get("plan", {}).get("policy"), "summary": r.stdout.strip().splitlines()[-1],
            "loss": [row["loss"] for row in rows if "loss" in row][-1]}


def ref_run(ref: str, size: dict, steps: int, env) -> dict:
    cmd = [sys.executable, ref, "--variants", "bf16-cudnn-remat", "--steps", str(steps), "--warmup", "2",
           "--d-model", str(size["d_model"]), "--n-layers", str(size["n_layers"]), "--n-heads", str(size["n_heads"]),
           "--d-ff", str(size["d_ff"]), "--seq-len", str(size["seq_len"]), "--batch", str(size["batch"])]
    r = _run(cmd, env, timeout=3600)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines or "error" in lines[-1]:
        return {"error": (lines[-1].get("error") if lines else None) or (r.stderr.strip().splitlines() or ["?"])[-1]}
    return {"step_s": lines[-1]["step_s"], "model_tflops": lines[-1]["model_tflops"], "device": lines[-1]["device"]}


def hlo_tables(size: dict, env, smoke: bool) -> str:
    """hlo_side_by_side.py's tables for `size` on this call's device (a process of its own)."""
    cmd = [sys.executable, os.path.join(HERE, "hlo_side_by_side.py"), "--dpjax-remat", "auto",
           "--attention", "xla" if smoke else "cudnn", "--d-model", str(size["d_model"]),
           "--n-layers", str(size["n_layers"]), "--n-heads", str(size["n_heads"]), "--d-ff", str(size["d_ff"]),
           "--seq-len", str(size["seq_len"]), "--batch", str(size["batch"])]
    r = _run(cmd, env, timeout=1800)
    if r.returncode != 0:
        return f"hlo_side_by_side.py failed: {(r.stderr.strip().splitlines() or ['no output'])[-1][:300]}"
    return r.stdout.strip()


def timeline_works(env, tmp: str, smoke: bool) -> str:
    out = os.path.join(tmp, "tl.json.gz")
    cmd = [sys.executable, "-m", "dpjax.train", "--mesh", "1x1", "--data", "synthetic", "--steps", "4",
           "--eval-every", "0", "--eval-batches", "1", "--progress", "none", "--timeline", out, "--timeline-steps", "2"]
    if smoke:
        cmd += ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "16", "--batch-size", "4"]
    r = _run(cmd, env, timeout=1200)
    return "yes" if r.returncode == 0 and os.path.exists(out) else \
        f"no: {(r.stderr.strip().splitlines() or ['no output'])[-1][:200]}"


def table(rows: list, device: str, peak: float | None, timeline: str) -> str:
    out = [f"dpjax against `ref_gpt.py` (bf16, cuDNN flash attention, remat) on one {device}; MFU against the "
           f"bf16 peak {peak or 'n/a'} TFLOP/s.", "",
           "| size | run | step (s) | model TFLOP/s | MFU | dpjax / yardstick |", "|---|---|---|---|---|---|"]
    shown = set()  # the yardstick's row once a size, however many dpjax runs face it
    for name, mine, ref, fp8 in rows:
        remat = (mine.get("policy") or {}).get("remat") if isinstance(mine.get("policy"), dict) else None
        pair = [(f"dpjax (remat {remat})" if remat else "dpjax", mine)] + ([] if id(ref) in shown else
                                                                           [("ref_gpt.py", ref)])
        shown.add(id(ref))
        for who, r in pair:
            if "error" in r:
                out.append(f"| {name} | {who} | error: {r['error']} | | | |")
                continue
            mfu = f"{r['model_tflops'] / peak:.1%}" if peak else "n/a"
            # the same FLOPs a step on both sides: the TFLOP/s ratio is the inverse ratio of step times
            ratio = f"{ref['step_s'] / mine['step_s']:.2f}x" if who.startswith("dpjax") and "error" not in ref else ""
            out.append(f"| {name} | {who} | {r['step_s']:.4f} | {r['model_tflops']:.1f} | {mfu} | {ratio} |")
        if fp8 is not None:
            out.append(_fp8_row(name, mine, fp8))
    out += ["", f"`--timeline` on the device: {timeline}"]
    return "\n".join(out)


def _fp8_row(name: str, bf16: dict, fp8: dict) -> str:
    """The fp8 run's row: its step against dpjax's bf16 step (speed-up) and the final losses."""
    if "error" in fp8 or "error" in bf16:
        return f"| {name} | dpjax --dtype fp8 | error: {fp8.get('error') or bf16['error']} | | | |"
    diff = 100 * (fp8["loss"] - bf16["loss"]) / bf16["loss"]
    return (f"| {name} | dpjax --dtype fp8 | {fp8['step_s']:.4f} | {fp8['model_tflops']:.1f} | | "
            f"{bf16['step_s'] / fp8['step_s']:.2f}x dpjax bf16; final loss {fp8['loss']:.4f} against "
            f"{bf16['loss']:.4f} ({diff:+.2f}%) |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ref", default=os.path.join(ROOT, "..", "shared", "gpu", "ref_gpt.py"),
                   help="the plain-JAX yardstick script")
    p.add_argument("--sizes", default=",".join(SIZES), help="which sizes to run")
    p.add_argument("--steps", type=int, default=20, help="steps of each run")
    p.add_argument("--skip", type=int, default=5, help="dpjax steps left out of the median (compilation)")
    p.add_argument("--out", help="write the markdown table here (default: print it)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, a few steps: checks the script runs")
    p.add_argument("--remats", default="auto",
                   help="dpjax's --remat at each size, comma-separated (auto,none: auto's choice and no remat)")
    p.add_argument("--hlo", action="store_true",
                   help="also hlo_side_by_side.py at each size on the device: the two compiled steps side by side")
    p.add_argument("--fp8", action="store_true", help="also dpjax with --dtype fp8 at each size, both dpjax runs on "
                                                      "the stdlib corpus: fp8's step and loss against bf16's")
    a = p.parse_args(argv)
    missing = not os.path.exists(a.ref)
    if missing and not a.smoke:
        print(f"error: --ref {a.ref}: no such file (../shared/gpu/ref_gpt.py beside the repository)", file=sys.stderr)
        return 2
    if missing:  # a clone without shared/ beside it: the smoke run checks dpjax's side alone
        print(f"note: --ref {a.ref} is missing: the smoke run leaves the yardstick out", flush=True)
    sizes = SMOKE if a.smoke else {k: SIZES[k] for k in a.sizes.split(",")}
    steps, skip = (4, 1) if a.smoke else (a.steps, a.skip)
    env = _env(a.smoke)
    rows, device, hlo = [], "cpu", []
    with tempfile.TemporaryDirectory() as tmp:
        for name, size in sizes.items():
            ref = {"error": "no yardstick script"} if missing else ref_run(a.ref, size, steps, env)
            data = "stdlib" if a.fp8 else "synthetic"
            for remat in a.remats.split(","):
                mine = dpjax_run(size, steps, skip, env, tmp, ("--remat", remat), data=data)
                fp8 = None
                if a.fp8 and remat == "auto":
                    fp8 = dpjax_run(size, steps, skip, env, tmp, ("--dtype", "fp8"), data=data)
                device = ref.get("device", device)
                rows.append((f"{name} remat {remat}" if remat != "auto" else name, mine, ref, fp8))
                print(json.dumps({"size": name, "remat": remat, "dpjax": mine, "ref": ref, "fp8": fp8}), flush=True)
            if a.hlo:
                hlo.append(f"### {name}\n\n" + hlo_tables(size, env, a.smoke))
        timeline = timeline_works(env, tmp, a.smoke)
    peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in device), None)
    text = "\n\n".join([table(rows, device, peak, timeline), *hlo])
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")
    print(text)
    failed = [name for name, mine, ref, fp8 in rows
              if "error" in mine or ("error" in ref and not missing) or (fp8 is not None and "error" in fp8)]
    return 1 if failed or not timeline.startswith("yes") else 0


if __name__ == "__main__":
    sys.exit(main())
