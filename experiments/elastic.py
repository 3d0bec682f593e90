"""What a failure costs under dpjax.agent: the issue's scenarios, with two agents on
127.0.0.1 standing for two hosts of two processes x two CPU devices (`--mesh 4x2`),
a fault injected by DPJAX_FAULT, against the same job without one; and what committing
every step costs the main job (`--mesh 2x4`, one process).

    python experiments/elastic.py [--steps 120 --at 30] [--scenarios same,smaller,...]
    python experiments/elastic.py --commit-cost [--rounds 3 --steps 40]

Per scenario: did it finish, how long from the failure until the processes were
started again (restart_s) and until the first step after it was done (seconds_lost),
the steps of work lost, the losses against the no-failure run (bit for bit, or the
largest relative difference), and the wall time beside the no-failure run's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _bench  # noqa: E402

MODEL = ["--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "16",
         "--batch-size", "16", "--eval-every", "0", "--eval-batches", "1", "--progress", "none"]
FSDP = ["--mesh", "2x2x2", "--fsdp", "--update", "sparse:4", "--workers", "node", "--optimizer", "sgd", "--lr", "0.3"]
# name: (fault, --nnodes, extra agent flags, extra training flags)
SCENARIOS = {
    "same": ("kill", "2:2", [], []),
    "smaller": ("kill,forever", "1:2", [], []),
    "fsdp-host": ("kill,host,wipe", "2:2", [], FSDP),
    "hang": ("hang", "2:2", ["--hang-timeout", "10"], []),
}


def losses(path) -> dict:
    out = {}
    with open(path) as fh:
        for rec in map(json.loads, fh):
            if "loss" in rec:
                out[rec["step"]] = rec["loss"]
    return out


def run_job(tmp, train, fault=None, nnodes="2:2", agent=()):
    """Two agents of two processes; (seconds, metrics path, exit codes)."""
    from dpjax.agent.rendezvous import free_port

    os.makedirs(tmp, exist_ok=True)
    port, metrics = free_port(), os.path.join(tmp, "m.jsonl")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DPJAX_FAULT")}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "dpjax-elastic-jit"))
    if fault:
        env["DPJAX_FAULT"] = fault
    t0 = time.time()
    agents = []
    for i in range(2):
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "dpjax.agent", "--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv",
             f"127.0.0.1:{port}", "--devices-per-process", "2", "--commit-dir", os.path.join(tmp, "commits"),
             "--host-id", f"h{i}", *agent, "--", sys.executable, "-m", "dpjax.train", *train, "--metrics", metrics],
            env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, f"agent{i}.err"), "w")))
        while i == 0:  # h0 runs the rendezvous: the faults strike h1, and a lost rendezvous host ends the job
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
    codes = [a.wait(timeout=1800) for a in agents]
    return time.time() - t0, metrics, codes


def scenarios(args, out_dir):
    head = ["scenario", "finished", "processes after", "restart_s", "seconds_lost", "steps_lost", "losses",
            "wall s (no failure)"]
    rows, refs = [], {}
    for name in args.scenarios.split(","):
        kind, nnodes, agent, extra = SCENARIOS[name]
        train = [*MODEL, "--data", args.data, "--mesh", "4x2", "--steps", str(args.steps), *extra]
        key = tuple(extra)
        if key not in refs:
            refs[key] = run_job(os.path.join(out_dir, f"ref-{len(refs)}"), train)
        ref_s, ref_metrics, _ = refs[key]
        secs, metrics, codes = run_job(os.path.join(out_dir, name), train, f"rank=2,step={args.at},kind={kind}",
                                       nnodes, agent)
        got, want = losses(metrics), losses(ref_metrics)
        with open(metrics) as fh:
            ev = next((r for r in map(json.loads, fh) if r.get("event") == "restart"), {})
        same = [got.get(s) for s in sorted(want)] == [want[s] for s in sorted(want)]
        worst = max((abs(got[s] - want[s]) / abs(want[s]) for s in want if s in got), default=float("nan"))
        rows.append([name, f"{len(got)}/{args.steps} steps, exit {codes}", ev.get("processes", "-"),
                     ev.get("restart_s", "-"), ev.get("seconds_lost", "-"), ev.get("steps_lost", "-"),
                     "bit for bit" if same else f"max rel diff {worst:.1e}", f"{secs:.0f} ({ref_s:.0f})"])
        print(" | ".join(map(str, rows[-1])), flush=True)
    return head, rows


def commit_cost(args, out_dir):
    """Paired medians: per round, one run without and one with --commit-dir (the order
    rotating), the median step time of each (first steps, which compile, left out)."""
    head = ["round", "median step ms, no commit", "median step ms, commit every step", "ratio"]
    rows, ratios = [], []
    # the main job: dpjax.train's defaults (GPT d_model 128, 2 layers, seq 128, batch 32, adamw) on 2x4
    base = ["--progress", "none", "--eval-every", "0", "--eval-batches", "1", "--data", args.data, "--mesh", "2x4",
            "--steps", str(args.steps)]
    for r in range(args.rounds):
        med = {}
        for variant in (("plain", "commit") if r % 2 == 0 else ("commit", "plain")):
            metrics = os.path.join(out_dir, f"cost-{r}-{variant}.jsonl")
            extra = ["--commit-dir", os.path.join(out_dir, f"c{r}")] if variant == "commit" else []
            env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
            subprocess.run([sys.executable, "-m", "dpjax.train", *base, *extra, "--metrics", metrics], env=env,
                           check=True, capture_output=True)
            with open(metrics) as fh:
                times = [rec["step_time"] for rec in map(json.loads, fh) if "step_time" in rec][5:]
            med[variant] = _bench.median(times)
        ratios.append(med["commit"] / med["plain"])
        rows.append([r, f"{1e3 * med['plain']:.1f}", f"{1e3 * med['commit']:.1f}", f"{ratios[-1]:.3f}"])
    rows.append(["median", "", "", f"{_bench.median(ratios):.3f}"])
    return head, rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--at", type=int, default=30, help="the step the fault strikes at")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--commit-cost", action="store_true")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--data", default=None, help="a text file (default: 300 kB of the stdlib corpus)")
    _bench.add_smoke(p, "the same-size scenario, 8 steps; or 1 round of 8 steps of the commit cost")
    args = p.parse_args()
    out_dir = tempfile.mkdtemp(prefix="dpjax-elastic-")
    if args.data is None:
        from dpjax.data import load_corpus

        args.data = os.path.join(out_dir, "corpus.txt")
        with open(args.data, "wb") as fh:
            fh.write(load_corpus("stdlib", max_bytes=300_000).tobytes())
    if args.smoke:
        args.steps, args.at, args.scenarios, args.rounds = 8, 3, "same", 1
    print(f"# {_bench.machine()}, load {_bench.load_avg():.1f}, {time.strftime('%Y-%m-%d')}, outputs in {out_dir}")
    head, rows = commit_cost(args, out_dir) if args.commit_cost else scenarios(args, out_dir)
    print(_bench.markdown_table(head, rows))


if __name__ == "__main__":
    main()
