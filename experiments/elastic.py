"""What a failure costs under dpjax.agent: the issue's scenarios, with two agents on
127.0.0.1 standing for two hosts of two processes x two CPU devices (`--mesh 4x2`),
a fault injected by DPJAX_FAULT, against the same job without one; and what committing
every step costs the main job (`--mesh 2x4`, one process).

    python experiments/elastic.py [--steps 120 --at 30] [--scenarios same,smaller,...]
    python experiments/elastic.py --commit-cost [--rounds 12 --block 20]

Per scenario: did it finish, how long from the failure until the processes were
started again (restart_s) and until the first step after it was done (seconds_lost),
the steps of work lost, the losses against the no-failure run (bit for bit, or the
largest relative difference), and the wall time beside the no-failure run's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


class Interleaved:
    """The run's Elastic, switched on and off block by block (`--block` steps each) inside
    one process: block 0 (no commit) and block 1 (commits) warm up (compiles, the copy's
    jit); then off and on alternate, ending with off. Each loop iteration's wall time is
    kept (in steady state the step time: data, dispatch, the oldest step's wait, and the
    commit), and on the commit blocks the time the loop's thread spent in the commit
    beyond waiting for the previous step: a commit waits for the previous commit, which
    waits for its step (the lockstep of dpjax.commit), a wait the loop would otherwise
    make a few steps later in taking that step's loss; what is left is the commit's own
    cost on the loop (the previous write's tail after its step was done, the copy's
    dispatch)."""

    def __init__(self, inner, block: int):
        self.inner, self.block = inner, block
        self.last, self.iteration, self.blocked = None, {}, {}

    def after_step(self, trainer, done, write, in_flight=()):
        if (done - 1) // self.block % 2:  # a commit block
            if len(in_flight) > 1:
                in_flight[-2][1].block_until_ready()  # the previous step (the commit would wait for it)
            t = time.perf_counter()
            self.inner.after_step(trainer, done, write, in_flight)
            self.blocked[done] = time.perf_counter() - t
        now = time.perf_counter()
        if self.last is not None:
            self.iteration[done] = now - self.last
        self.last = now

    def close(self):
        self.inner.close()


def commit_cost(args, out_dir):
    """What committing every step costs the main job (dpjax.train's defaults: GPT d_model
    128, 2 layers, seq 128, batch 32, adamw, on --mesh 2x4), measured in ONE process so
    that both variants share the compile, the data and the machine's load of the moment:
    blocks of --block steps with and without commits alternate; each commit block's
    median iteration time is paired with the mean of the two no-commit blocks around it
    (a slow drift of the machine's load cancels), and the ratio's median over --rounds
    blocks is reported, beside the loop thread's median time inside the commit beyond
    waiting for the previous step (the direct measure, see Interleaved). The first MAX_IN_FLIGHT + 1 iterations of each block are left
    out: the steps in flight still belong to the block before."""
    from dpjax.train.cli import parse_args
    from dpjax.train.loop import Trainer
    from dpjax.train.run import MAX_IN_FLIGHT

    block, skip = args.block, MAX_IN_FLIGHT + 1
    steps = block * (2 * args.rounds + 3)
    # the commits where dpjax.agent puts them by default: fast local storage (tmpfs)
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else out_dir
    commits = tempfile.mkdtemp(prefix="dpjax-commit-cost-", dir=shm)
    cfg = parse_args(["--progress", "none", "--eval-every", "0", "--eval-batches", "1", "--data", args.data,
                      "--mesh", "2x4", "--steps", str(steps), "--commit-dir", commits])
    try:
        trainer = Trainer(cfg)
        trainer.elastic = probe = Interleaved(trainer.elastic, block)
        trainer.run()
    finally:
        shutil.rmtree(commits, ignore_errors=True)

    def blk(b, table):
        return [table[s] for s in range(b * block + 1 + skip, (b + 1) * block + 1) if s in table]

    head = ["commit block", "ms, no commit before", "ms, commit every step", "ms, no commit after", "ratio",
            "ms in the commit beyond its step (loop thread)", "that / step"]
    rows, ratios, shares = [], [], []
    for b in range(3, 2 * args.rounds + 3, 2):
        before, on, after = (_bench.median(blk(x, probe.iteration)) for x in (b - 1, b, b + 1))
        blocked = _bench.median(blk(b, probe.blocked))
        ratios.append(on / ((before + after) / 2))
        shares.append(blocked / on)
        rows.append([b, f"{1e3 * before:.1f}", f"{1e3 * on:.1f}", f"{1e3 * after:.1f}", f"{ratios[-1]:.3f}",
                     f"{1e3 * blocked:.2f}", f"{100 * shares[-1]:.1f}%"])
    rows.append(["median", "", "", "", f"{_bench.median(ratios):.3f}", "", f"{100 * _bench.median(shares):.1f}%"])
    return head, rows


def main():
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=120, help="steps of each run")
    p.add_argument("--at", type=int, default=30, help="the step the fault strikes at")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="the scenarios to run, comma-separated")
    p.add_argument("--commit-cost", action="store_true",
                   help="measure what committing every step costs the main job instead of the scenarios")
    p.add_argument("--rounds", type=int, default=12, help="--commit-cost: commit blocks (each between two without)")
    p.add_argument("--block", type=int, default=20, help="--commit-cost: steps per block")
    p.add_argument("--data", default=None, help="a text file; None: 300 kB of the stdlib corpus")
    _bench.add_smoke(p, "the same-size scenario, 8 steps; or 2 commit blocks of 8 steps for the commit cost")
    args = p.parse_args()
    out_dir = tempfile.mkdtemp(prefix="dpjax-elastic-")
    if args.data is None:
        from dpjax.data import load_corpus

        args.data = os.path.join(out_dir, "corpus.txt")
        with open(args.data, "wb") as fh:
            fh.write(load_corpus("stdlib", max_bytes=300_000).tobytes())
    if args.smoke:
        args.steps, args.at, args.scenarios, args.rounds, args.block = 8, 3, "same", 2, 8
    if args.commit_cost:  # in this process: the main job's 8 simulated devices, before JAX starts
        from dpjax.mesh import simulate_cpu_devices

        simulate_cpu_devices(8)
    print(f"# {_bench.machine()}, load {_bench.load_avg():.1f}, {time.strftime('%Y-%m-%d')}, outputs in {out_dir}")
    head, rows = commit_cost(args, out_dir) if args.commit_cost else scenarios(args, out_dir)
    print(_bench.markdown_table(head, rows))
    print(f"# load after: {_bench.load_avg():.1f}")


if __name__ == "__main__":
    main()
