"""What dpjax does on this machine's accelerators, as a markdown table for RESULTS.md:
the main job (`python -m dpjax.train`, default model) on every device (`--mesh Nx1`,
and the README's `2x4` where there are 8) and on one (`1x1`), in tokens/s and model
FLOPs utilisation, then the collectives benchmark (`bench_collectives.py`): XLA's psum
and dpjax's best explicit allreduce in bus bandwidth against the device's peak.

    pip install -e ".[cuda]"                                   # JAX with CUDA 12
    python experiments/gpu_check.py --markdown gpu.md          # on whatever GPUs are present
    python experiments/gpu_check.py --smoke                    # CPU, seconds: what the tests run

Each run is a process of its own (this one starts no JAX backend: on a GPU it would take
the memory the runs need; it imports dpjax only for its table of device peaks). Tokens/s
is the median over the steps after the first `--skip` (which compile). MFU = 6 x
parameters x tokens/s / (devices x peak), the usual estimate (Kaplan et al. 2020;
attention's FLOPs left out); the peak is the dense TF32 tensor-core rate, since the model
trains in float32 and XLA's default matmul precision on NVIDIA GPUs is TF32. Peaks (TF32
FLOP/s, NVLink bandwidth) are dpjax's one table, `dpjax.train.efficiency.DEVICE_PEAKS`
(the vendors' datasheet figures); a device not in it shows n/a. With --markdown the table
goes to that file only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SMOKE_MODEL = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "16", "--batch-size", "16"]


def peak(kind: str):
    """(dense TF32 FLOP/s, NVLink bytes/s per GPU and direction) of a device kind, from
    dpjax's table (None where it has no figure)."""
    from dpjax.train.efficiency import device_peaks

    peaks = device_peaks(kind)
    scale = lambda key, unit: None if key not in peaks else peaks[key] * unit  # noqa: E731
    return scale("float32", 1e12), scale("link", 1e9)


def _env(smoke: bool, devices: int | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if smoke:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices or 2}"
    return env


def _run(cmd, env) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"gpu_check: {' '.join(cmd[:4])} ... failed ({r.returncode}): "
                         f"{(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    return r.stdout


def devices(smoke: bool) -> dict:
    """The devices JAX sees here, and the parameters of the model the runs train."""
    code = ("import jax, json; from dpjax.models import get_model; d = jax.devices(); m = get_model('gpt'{}); "
            "print(json.dumps({{'n': len(d), 'platform': d[0].platform, 'kind': d[0].device_kind, "
            "'jax': jax.__version__, 'params': m.num_params(jax.eval_shape(m.init, jax.random.key(0)))}}))").format(
        ", d_model=32, n_layers=1, n_heads=2" if smoke else "")
    return json.loads(_run([sys.executable, "-c", code], _env(smoke)).strip().splitlines()[-1])


def train(mesh: str, args, tmp: str) -> dict:
    metrics = os.path.join(tmp, f"train-{mesh}.jsonl")
    n = 1
    for part in mesh.split("x"):
        n *= int(part)
    cmd = [sys.executable, "-m", "dpjax.train", "--mesh", mesh, "--steps", str(args.steps), "--eval-every", "0",
           "--eval-batches", "1", "--progress", "none", "--data", args.data, "--metrics", metrics,
           *(SMOKE_MODEL if args.smoke else [])]
    _run(cmd, _env(args.smoke, n))
    rows = [json.loads(line) for line in open(metrics)]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > args.skip]
    return {"mesh": mesh, "devices": n, "tokens_per_s": statistics.median(tps)}


def collectives(n: int, args, tmp: str) -> list[dict]:
    out = os.path.join(tmp, "collectives.jsonl")
    cmd = [sys.executable, os.path.join(HERE, "bench_collectives.py"), "--devices", str(n), "--json", out,
           "--no-check"]
    cmd += (["--platform", "cpu", "--sizes", "4KiB", "--reps", "1", "--warmup", "0", "--algorithms", "ring"]
            if args.smoke else ["--platform", "auto", "--reps", str(args.reps)])
    _run(cmd, _env(args.smoke, n))
    return [json.loads(line) for line in open(out)]


def markdown(dev: dict, n_params: int, runs: list, coll: list, args) -> str:
    flops, bw = peak(dev["kind"])
    pct = lambda x, top: "n/a" if top is None else f"{100 * x / top:.1f}%"  # noqa: E731
    lines = [f"### dpjax on {dev['n']} x {dev['kind']} ({dev['platform']}), jax {dev['jax']}, "
             f"{datetime.date.today().isoformat()}", "",
             f"`python experiments/gpu_check.py{' --smoke' if args.smoke else ''}`: GPT of {n_params:,} parameters, "
             f"{args.steps} steps, median tokens/s after step {args.skip}; MFU against "
             f"{'n/a' if flops is None else f'{flops / 1e12:g} TFLOP/s'} per device.", "",
             "| run | mesh | devices | tokens/s | MFU |", "|---|---|---|---|---|"]
    for r in runs:
        mfu = pct(6 * n_params * r["tokens_per_s"], None if flops is None else flops * r["devices"])
        lines.append(f"| {r['name']} | {r['mesh']} | {r['devices']} | {r['tokens_per_s']:,.0f} | {mfu} |")
    if coll:
        lines += ["", f"Allreduce across {dev['n']} devices (bus bandwidth, nccl-tests' definition; peak "
                      f"{'n/a' if bw is None else f'{bw / 1e9:g} GB/s'} per device and direction):", "",
                  "| size per device | psum GB/s | psum % of peak | best dpjax | GB/s | % of peak |",
                  "|---|---|---|---|---|---|"]
        for size in sorted({r["size_bytes"] for r in coll}):
            at = [r for r in coll if r["size_bytes"] == size]
            base = next(r for r in at if r["algorithm"] == "psum")
            best = max((r for r in at if r["algorithm"] != "psum"), key=lambda r: r["busbw_GBps"], default=base)
            lines.append(f"| {size / 1024:,.0f} KiB | {base['busbw_GBps']:.2f} | {pct(base['busbw_GBps'] * 1e9, bw)} "
                         f"| {best['label']} | {best['busbw_GBps']:.2f} | {pct(best['busbw_GBps'] * 1e9, bw)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="2 simulated CPU devices, a tiny model, a few steps")
    p.add_argument("--steps", type=int, help="training steps per run (default 60; --smoke: 4)")
    p.add_argument("--skip", type=int, help="first steps left out of the median (default 10; --smoke: 1)")
    p.add_argument("--reps", type=int, default=20, help="collectives benchmark repetitions")
    p.add_argument("--data", default="stdlib", help="dpjax.train --data")
    p.add_argument("--markdown", metavar="FILE", help="write the tables here (default: print them)")
    args = p.parse_args(argv)
    args.steps = args.steps or (4 if args.smoke else 60)
    args.skip = args.skip if args.skip is not None else (1 if args.smoke else 10)
    dev = devices(args.smoke)
    if dev["platform"] == "cpu" and not args.smoke:
        print("gpu_check: JAX sees no GPU (install JAX with CUDA: pip install -e \".[cuda]\"); measuring the CPU",
              file=sys.stderr)
    n = dev["n"]
    meshes = [("main job, every device", f"{n}x1"), ("one device", "1x1")]
    if n == 8:
        meshes.insert(1, ("the README's 2x4 (tensor parallel)", "2x4"))
    with tempfile.TemporaryDirectory() as tmp:
        runs = [{"name": name, **train(mesh, args, tmp)} for name, mesh in (meshes if n > 1 else meshes[1:])]
        coll = collectives(n, args, tmp) if n > 1 else []
    table = markdown(dev, dev["params"], runs, coll, args)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
        print(f"gpu_check: the table is in {args.markdown}")
    else:
        print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
