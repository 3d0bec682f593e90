"""Do commits stall the steps? `python -m dpjax.train` with `--commit-dir` (on /dev/shm, the
default interval, `--commit-every auto`) against the same run without commits, as
separate runs interleaved A, B, A, B, ... (the starting one alternating pair by pair), so
that the load of a shared machine hits both alike; each run's median `step_time` (the
metrics rows, the first `--skip` steps, which compile, left out), and each pair's ratio.

Issue 38: the 1.2 GB GPT (100M parameters and adamw's two moments, FSDP over 8 simulated
devices) chose a commit every 4 steps and ran at 1.20x the step without commits; the
goal is within 5% (median step), three paired runs. Also said: what `auto` chose and
from what (its printed line), and the commits' GB/s beside the steps.

    python experiments/commit_stall.py                       # the issue's GPT, 3 pairs of 20 steps
    python experiments/commit_stall.py --size small          # a 4-layer, d_model 512 GPT (a loaded machine)
    python experiments/commit_stall.py --size gpt405m --pairs 1 --steps 40   # one GPU (4.87 GB of state)
    python experiments/commit_stall.py --smoke               # tiny, one pair, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import _bench

SIZES = {"gpt1g": ["--mesh", "8x1", "--fsdp", "--d-model", "1024", "--n-layers", "8", "--n-heads", "16",
                   "--d-ff", "4096", "--seq-len", "128", "--batch-size", "8"],
         "small": ["--mesh", "8x1", "--fsdp", "--d-model", "512", "--n-layers", "4", "--n-heads", "8",
                   "--d-ff", "2048", "--seq-len", "128", "--batch-size", "8"],
         # the GPU run (issue 38): the yardstick's 405M on one GPU, 4.87 GB of state a commit
         "gpt405m": ["--mesh", "1x1", "--data", "synthetic", "--d-model", "2048", "--n-layers", "8", "--n-heads", "16",
                     "--d-ff", "8192", "--seq-len", "1024", "--batch-size", "16"],
         "tiny": ["--mesh", "4x2", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "16",
                  "--batch-size", "16"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="gpt1g")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="steps of each run")
    p.add_argument("--skip", type=int, default=2, help="first steps of each run left out of its median (compiles)")
    p.add_argument("--out", default=os.path.join(_bench.HERE, "commit_stall.json"))
    _bench.add_smoke(p, "a tiny GPT, one pair of 14 steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.pairs, args.steps = "tiny", 1, 14
    return args


def run(args, commits: str | None, folder: str) -> dict:
    """One dpjax.train run: its median step, its steps' times, its commits and what auto said."""
    metrics = os.path.join(folder, f"m{time.monotonic_ns()}.jsonl")
    cmd = [sys.executable, "-m", "dpjax.train", *SIZES[args.size], "--steps", str(args.steps),
           "--eval-every", "0", "--eval-batches", "1", "--progress", "none", "--metrics", metrics]
    if commits:
        cmd += ["--commit-dir", commits, "--overwrite"]
    load = _bench.load_avg()
    r = subprocess.run(cmd, capture_output=True, text=True, env=_bench.checkout_env(), cwd=_bench.ROOT,
                       timeout=3600)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
    with open(metrics) as fh:
        rows = [json.loads(line) for line in fh]
    steps = {r["step"]: r["step_time"] for r in rows if "step_time" in r}
    # the last step left out of both: with commits its row is written after the last commit's flush,
    # which waited for the step too (its step_time reads about 0)
    times = [t for s, t in sorted(steps.items()) if args.skip < s < args.steps]
    done = [r for r in rows if "commit_s" in r]
    # the steps beside a commit: the two after its step (they run while it is staged and written)
    beside = [steps[c + k] for c in {r["commit_step"] for r in done} for k in (1, 2) if c + k in steps]
    said = re.search(r"dpjax\.commit: committing every .*", r.stdout)
    return {"median_s": _bench.median(times), "times": times, "load": load,
            "beside_s": _bench.median(beside) if beside else None,
            "commit_steps": [r["commit_step"] for r in done],
            "commit_gbs": [r["commit_bytes"] / r["commit_s"] / 1e9 for r in done],
            "commit_bytes": done[0]["commit_bytes"] if done else None,
            "auto": said.group(0) if said else None}


def main(argv=None) -> int:
    args = parse_args(argv)
    _bench.smoke_outputs(args, "out")
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    folder = tempfile.mkdtemp(prefix="dpjax-commit-stall-")
    print(f"{args.size}: {' '.join(SIZES[args.size])}, {args.steps} steps; uptime: "
          f"{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)
    pairs = []
    try:
        for i in range(args.pairs):
            order = ("plain", "commit") if i % 2 == 0 else ("commit", "plain")
            got = {}
            for kind in order:
                commits = tempfile.mkdtemp(prefix="dpjax-commit-stall-", dir=shm) if kind == "commit" else None
                try:
                    got[kind] = run(args, commits, folder)
                finally:
                    if commits:
                        shutil.rmtree(commits, ignore_errors=True)
                print(f"  pair {i + 1} {kind}: median {got[kind]['median_s']:.3f} s (load {got[kind]['load']:.1f})"
                      + (f"; commits at {got[kind]['commit_steps']}; {got[kind]['auto']}" if kind == "commit" else ""),
                      flush=True)
            pairs.append({**got, "ratio": got["commit"]["median_s"] / got["plain"]["median_s"], "order": order})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print("| pair (order) | median step s, no commits | median step s, commits (auto) | ratio | commits at steps | "
          "steps beside a commit, median s | commit GB/s (median) | load at start (plain, commit) |")
    print("|---|---:|---:|---:|---|---:|---:|---|")
    for i, p in enumerate(pairs, 1):
        gbs, beside = p["commit"]["commit_gbs"], p["commit"]["beside_s"]
        print(f"| {i} ({', '.join(p['order'])}) | {p['plain']['median_s']:.3f} | {p['commit']['median_s']:.3f} | "
              f"{p['ratio']:.3f} | {p['commit']['commit_steps']} | {'-' if beside is None else f'{beside:.3f}'} | "
              f"{_bench.median(gbs) if gbs else 0:.2f} | {p['plain']['load']:.1f}, {p['commit']['load']:.1f} |")
    print(f"median ratio {_bench.median([p['ratio'] for p in pairs]):.3f} over {len(pairs)} pairs; uptime: "
          f"{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    with open(args.out, "w") as fh:
        json.dump({"size": args.size, "command": SIZES[args.size], "steps": args.steps, "pairs": pairs,
                   "git": _bench.git_state()}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
