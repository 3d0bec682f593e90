"""What a failure costs under dpjax.agent: the issue's scenarios, with two agents on
127.0.0.1 standing for two hosts of two processes x two CPU devices (`--mesh 4x2`),
a fault injected by DPJAX_FAULT, against the same job without one; and what committing
every step costs the main job (`--mesh 2x4`, one process).

    python experiments/elastic.py [--steps 120 --at 30] [--scenarios same,smaller,...]
    python experiments/elastic.py --commit-cost [--rounds 12 --block 20]
    python experiments/elastic.py --restart [--tries 3]

--restart: the restart as a user meets it, the issue's command: one agent, 4 processes x
2 CPU devices, `python -m dpjax.train --mesh 4x2 --batch-size 16 --seq-len 64`, rank 2
SIGKILLed at step 35; each try's restart record (seconds_lost and where they went, the
programs loaded and compiled again), and their medians.

Per scenario: did it finish, how long from the failure until the processes were
started again (restart_s) and until the first step after it was done (seconds_lost),
the steps of work lost, the losses against the no-failure run (bit for bit, or the
largest relative difference), and the wall time beside the no-failure run's. A job
that trained every step must end with exit 0 (but the agent a `forever` fault kills):
the script exits 1 naming the scenarios that did not.
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
# name: (rank 2's DPJAX_FAULT, {at} the step --at, --nnodes, extra agent flags, extra training flags)
SCENARIOS = {
    "same": ("step={at},kind=kill", "2:2", [], []),
    "smaller": ("step={at},kind=kill,forever", "1:2", [], []),
    "fsdp-host": ("step={at},kind=kill,host,wipe", "2:2", [], FSDP),
    "hang": ("step={at},kind=hang", "2:2", ["--hang-timeout", "10"], []),
    # after the last commit: every process's (the job's end), or its own before it said so (a restart)
    "after-end": ("step=end,kind=kill", "2:2", [], []),
    "after-commit": ("step=committed,kind=kill", "2:2", [], []),
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
             "--host-id", f"h{i}", *agent, "--", sys.executable, "-m", "dpjax.train", *train, "--metrics", metrics,
             "--overwrite"],  # a run again into the same folder replaces the last one's rows
            env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, f"agent{i}.err"), "w")))
        while i == 0:  # h0 runs the rendezvous: the faults strike h1, and a lost rendezvous host ends the job
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
    codes = [a.wait(timeout=1800) for a in agents]
    return time.time() - t0, metrics, codes


def restart(args, out_dir):
    """The issue's restart, `--tries` times (see the module's text)."""
    from dpjax.agent.rendezvous import free_port

    from dpjax.train.restart import PHASES

    # each phase's wall seconds, then (its CPU seconds: on a loaded machine the wall ones grow with the load)
    head = ["try", "seconds_lost", "agent", *PHASES, "steps_lost", "programs loaded / compiled", "load"]
    rows, train = [], ["--mesh", "4x2", "--batch-size", "16", "--seq-len", "64", "--steps", str(args.at + 5),
                       "--data", args.data, "--eval-every", "0"]
    for t in range(args.tries):
        tmp = os.path.join(out_dir, f"restart-{t}")
        os.makedirs(tmp)
        env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
               "DPJAX_FAULT": f"rank=2,step={args.at},kind=kill"}
        metrics = os.path.join(tmp, "m.jsonl")
        r = subprocess.run([sys.executable, "-m", "dpjax.agent", "--nproc-per-node", "4", "--devices-per-process", "2",
                            "--rdzv", f"127.0.0.1:{free_port()}", "--commit-dir", os.path.join(tmp, "commits"), "--",
                            sys.executable, "-m", "dpjax.train", *train, "--metrics", metrics],
                           env=env, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise SystemExit(f"try {t}: the job failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        with open(metrics) as fh:
            ev = next(r for r in map(json.loads, fh) if r.get("event") == "restart")
        b, progs = ev["breakdown"], ev.get("programs", {})
        rows.append([t + 1, ev["seconds_lost"], ev["restart_s"], *(f"{b['wall'][p]} ({b['cpu'][p]})" for p in PHASES),
                     ev["steps_lost"], f"{progs.get('loaded', '-')} / {progs.get('compiled', '-')}",
                     f"{_bench.load_avg():.1f}"])
        print(" | ".join(map(str, rows[-1])), flush=True)
    if len(rows) > 1:
        import numpy as np

        def med(i):  # a phase's "wall (cpu)": the medians of each
            if isinstance(rows[0][i], str):
                w, c = zip(*((float(x) for x in r[i].strip(")").split(" (")) for r in rows))
                return f"{np.median(w):.2f} ({np.median(c):.2f})"
            return float(np.median([r[i] for r in rows]))

        rows.append(["median", *(med(i) for i in range(1, 4 + len(PHASES))), "", ""])
    return head, rows


def scenarios(args, out_dir):
    head = ["scenario", "finished", "processes after", "restart_s", "seconds_lost", "steps_lost", "losses",
            "wall s (no failure)"]
    rows, refs, wrong = [], {}, []
    for name in args.scenarios.split(","):
        fault, nnodes, agent, extra = SCENARIOS[name]
        fault = "rank=2," + fault.format(at=args.at)
        train = [*MODEL, "--data", args.data, "--mesh", "4x2", "--steps", str(args.steps), *extra]
        key = tuple(extra)
        if key not in refs:
            refs[key] = run_job(os.path.join(out_dir, f"ref-{len(refs)}"), train)
        ref_s, ref_metrics, _ = refs[key]
        secs, metrics, codes = run_job(os.path.join(out_dir, name), train, fault, nnodes, agent)
        got, want = losses(metrics), losses(ref_metrics)
        with open(metrics) as fh:
            ev = next((r for r in map(json.loads, fh) if r.get("event") == "restart"), {})
        same = [got.get(s) for s in sorted(want)] == [want[s] for s in sorted(want)]
        worst = max((abs(got[s] - want[s]) / abs(want[s]) for s in want if s in got), default=float("nan"))
        rows.append([name, f"{len(got)}/{args.steps} steps, exit {codes}", ev.get("processes", "-"),
                     ev.get("restart_s", "-"), ev.get("seconds_lost", "-"), ev.get("steps_lost", "-"),
                     "bit for bit" if same else f"max rel diff {worst:.1e}", f"{secs:.0f} ({ref_s:.0f})"])
        print(" | ".join(map(str, rows[-1])), flush=True)
        alive = codes[:1] if "forever" in fault else codes  # h1's agent is what a `forever` fault kills
        if sorted(got) == list(range(1, args.steps + 1)) and any(alive):
            wrong.append(f"{name} (exit {codes})")
    if wrong:  # every step trained, and the job said it failed: what a scheduler would rerun (issue 53)
        raise SystemExit(f"every step was trained, yet the job did not exit 0: {', '.join(wrong)}; see {out_dir}")
    return head, rows


# --commit-cost's jobs: the main job (dpjax.train's defaults on --mesh 2x4: GPT d_model 128,
# 2 layers, seq 128, batch 32, adamw; 5 MB of state) and the GPT of 1.2 GB of state
# (100M parameters and adamw's two moments, FSDP over 8 devices: replicated it does not fit),
# on batches of 8 x 64 bytes: 1/8 of the default's compute, so that a step takes seconds on
# 2 shared cores, and a commit weighs 8 times more against it than against the default's
JOBS = {"main": ["--mesh", "2x4"],
        "gpt1g": ["--mesh", "8x1", "--fsdp", "--d-model", "1024", "--n-layers", "8", "--d-ff", "4096",
                  "--batch-size", "8", "--seq-len", "64"]}
VARIANTS = ("none", "auto", "every")  # no commit; --commit-every auto (the default); a commit every step


class Interleaved:
    """Two Elastics of the run, one with --commit-every auto, one with 1, sharing one
    Committer, switched block by block (`--block` steps each) inside one process: none,
    auto, every, none, auto, every, ..., none. The first three blocks warm up (compiles,
    the copy's jit, the auto interval's first measure). Each loop iteration's wall time
    is kept (in steady state the step time: data, dispatch, the oldest step's wait, and
    whatever the commits add). The auto Elastic sees every iteration's time (outside its
    blocks as free of its commits, or busy with the every-step ones), as it would in a
    run of its own; it commits only in its blocks."""

    def __init__(self, auto, every, block: int):
        self.auto, self.every, self.block = auto, every, block
        self.last, self.iteration, self.kind = None, {}, {}

    def after_step(self, trainer, done, write, in_flight=()):
        kind = VARIANTS[(done - 1) // self.block % 3]
        self.kind[done] = kind
        if kind == "auto":
            self.auto.after_step(trainer, done, write, in_flight)
        else:
            if kind == "every":
                self.every.after_step(trainer, done, write, in_flight)
            now, el = time.perf_counter(), self.auto
            if el.last_t is not None:  # the auto interval's view of this iteration
                el.auto.tick(now - el.last_t, busy=kind == "every" or el.committer.busy, began=False)
            el.last_t = now
        now = time.perf_counter()
        if self.last is not None:
            self.iteration[done] = now - self.last
        self.last = now

    def close(self):
        self.every.close()


def _plain_write_s(nbytes: int, folder: str) -> float:
    """Seconds a plain numpy write of nbytes into a new file in folder takes."""
    import numpy as np

    a = np.ones(nbytes // 4 + 1, np.float32)
    path = os.path.join(folder, "plain.bin")
    t = time.perf_counter()
    with open(path, "wb") as fh:
        fh.write(a)
    dt = time.perf_counter() - t
    os.remove(path)
    return dt


def commit_cost(args, out_dir):
    """What commits cost a job, measured in ONE process so that the variants share the
    compile, the data and the machine's load of the moment: blocks of --block steps of
    the three VARIANTS alternate; each commit block's median iteration time is paired
    with the mean of the two no-commit blocks around it (a slow drift of the machine's
    load cancels), and the ratios' medians over --rounds are reported. The first
    MAX_IN_FLIGHT + 1 iterations of each block are left out: the steps in flight still
    belong to the block before. Then the commit path's speed: the commits' bytes over
    their commit_s in the run (beside the steps), and, with nothing else running, a
    commit of the trained state against a plain numpy write of the same bytes into a
    new file in the same folder, alternated --writes times."""
    from dpjax.recovery.commit import Committer
    from dpjax.train.cli import parse_args
    from dpjax.train.elastic import Elastic
    from dpjax.train.trainer import Trainer
    from dpjax.train.loop import MAX_IN_FLIGHT

    block, skip = args.block, MAX_IN_FLIGHT + 1
    steps = block * (3 * args.rounds + 4)
    # the commits where dpjax.agent puts them by default: fast local storage (tmpfs)
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else out_dir
    commits = tempfile.mkdtemp(prefix="dpjax-commit-cost-", dir=shm)
    metrics = os.path.join(out_dir, "commit-cost.jsonl")
    cfg = parse_args(["--progress", "none", "--eval-every", "0", "--eval-batches", "1", "--data", args.data,
                      *JOBS[args.job], "--steps", str(steps), "--commit-dir", commits, "--metrics", metrics,
                      "--overwrite"])
    try:
        trainer = Trainer(cfg)
        commits = trainer.parts.commits  # the hook that owns the run's Elastic
        every = Elastic(trainer, commits.elastic.committer, None)
        every.every, every.auto = 1, None
        commits.elastic = probe = Interleaved(commits.elastic, every, block)
        trainer.run()
        paired = []  # (plain write s, commit s, bytes) with nothing else running
        c = Committer(os.path.join(commits, "alone"), "h", 0, 1)
        for i in range(args.writes + 1):  # the first compiles the device copy and fills the pages reused later
            t = time.perf_counter()
            c.commit(steps + 1 + i, trainer.state(), {"cursor": 0})
            c.flush()
            alone = time.perf_counter() - t
            nbytes = c.poll()[0]["commit_bytes"]
            if i:
                paired.append((_plain_write_s(nbytes, shm), alone, nbytes))
        c.close()
    finally:
        shutil.rmtree(commits, ignore_errors=True)
    with open(metrics) as fh:
        rows = [r for r in map(json.loads, fh) if "commit_s" in r]

    def blk(b):
        return [probe.iteration[s] for s in range(b * block + 1 + skip, (b + 1) * block + 1) if s in probe.iteration]

    head = ["round", "ms, no commit before", "ms, auto", "ms, every step", "ms, no commit after",
            "ratio auto", "ratio every step"]
    out, ratios = [], {"auto": [], "every": []}
    for r in range(1, args.rounds + 1):
        b = 3 * r  # the round's no-commit block; auto and every follow it
        before, auto, each, after = (_bench.median(blk(x)) for x in (b, b + 1, b + 2, b + 3))
        ratios["auto"].append(auto / ((before + after) / 2))
        ratios["every"].append(each / ((before + after) / 2))
        out.append([r, f"{1e3 * before:.0f}", f"{1e3 * auto:.0f}", f"{1e3 * each:.0f}", f"{1e3 * after:.0f}",
                    f"{ratios['auto'][-1]:.3f}", f"{ratios['every'][-1]:.3f}"])
    out.append(["median", "", "", "", "", f"{_bench.median(ratios['auto']):.3f}",
                f"{_bench.median(ratios['every']):.3f}"])
    gbs = [r["commit_bytes"] / r["commit_s"] / 1e9 for r in rows]
    chosen = sorted({r["commit_every"] for r in rows if r.get("commit_every") and
                     probe.kind.get(r["commit_step"]) == "auto"})
    notes = [f"state written per commit: {rows[0]['commit_bytes'] / 1e9:.3f} GB; auto's intervals: {chosen}",
             f"commit path in the run (beside the steps): median {_bench.median(gbs):.2f} GB/s over {len(gbs)} "
             f"commits (commit_s median {_bench.median([r['commit_s'] for r in rows]):.2f} s)",
             "alone, alternated with a plain numpy write of the same bytes to a new file in " + shm + ": "
             + "; ".join(f"commit {n / c / 1e9:.2f} GB/s, plain {n / p / 1e9:.2f} GB/s" for p, c, n in paired)
             + f"; median ratio {_bench.median([p / c for p, c, _ in paired]):.2f}"]
    return head, out, notes


def _fsdp_state(gb: float):
    """Arrays of about `gb` GB in float32, split over 8 devices as FSDP splits a GPT's
    (3 leaves: parameters and adamw's two moments), with random contents."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import dpjax

    mesh = dpjax.make_mesh("8x1", jax.devices()[:8])
    rows = max(8, int(gb * 1e9 / 3 / 4 / 4096) // 8 * 8)
    rng = np.random.default_rng(0)
    return {k: jax.device_put(rng.standard_normal((rows, 4096), np.float32), NamedSharding(mesh, P("data")))
            for k in ("params", "mu", "nu")}


def paths(args, out_dir):
    """The commit path beside its alternatives, on one state of --gb GB, the variants
    alternated --writes times in one process: to save it, a commit (dpjax.recovery.commit: device
    copy, then written by its thread), a plain numpy write of the same bytes to a new
    file, orbax's async save (what the step waits for, and until it is written); to get
    it back, dpjax's restore from the local file, the same bytes fetched from a live
    neighbour's copy over the commits' TCP channel (two processes' servers here in one,
    on 127.0.0.1), and orbax's restore."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from dpjax.recovery.commit import Committer
    from dpjax.recovery.file_format import read
    from dpjax.recovery.peer import LocalKV, Peers

    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else out_dir
    root = tempfile.mkdtemp(prefix="dpjax-commit-paths-", dir=shm)
    state = _fsdp_state(args.gb)
    nbytes = sum(x.nbytes for x in state.values())
    times: dict = {}
    try:
        c = Committer(os.path.join(root, "c"), "h", 0, 1)
        mgr = ocp.CheckpointManager(os.path.join(root, "orbax"), options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True, enable_async_checkpointing=True))
        client = LocalKV()
        server = Peers(root, 0, client, None)
        fetcher = Peers(root, 1, client, None)
        template = jax.tree.map(jax.numpy.zeros_like, state)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        for i in range(args.writes + 1):  # the first warms every path (compiles, pages), not counted
            t = time.perf_counter()
            c.commit(i + 1, state, {"cursor": 0})
            c.flush()
            commit_s = time.perf_counter() - t
            path = os.path.join(root, "c", "h", "own", "r0", f"s{i + 1:09d}_w1.bin")
            plain_s = _plain_write_s(nbytes, shm)
            t = time.perf_counter()
            mgr.save(i + 1, args=ocp.args.StandardSave(state))
            orbax_block_s = time.perf_counter() - t
            mgr.wait_until_finished()
            orbax_s = time.perf_counter() - t
            t = time.perf_counter()
            restored, _ = c.restore(template)
            jax.block_until_ready(restored)
            local_s = time.perf_counter() - t
            t = time.perf_counter()
            blob = fetcher.get(0, os.path.relpath(path, root))
            fetch_s = time.perf_counter() - t
            t = time.perf_counter()
            back = mgr.restore(i + 1, args=ocp.args.StandardRestore(abstract))
            jax.block_until_ready(back)
            orbax_restore_s = time.perf_counter() - t
            assert bytes(blob[-4096:]) == bytes(read(path)[-4096:])
            assert all(np.array_equal(np.asarray(restored[k]), np.asarray(state[k])) for k in state)
            del restored, back, blob
            if i:
                for k, v in (("commit", commit_s), ("plain write", plain_s), ("orbax save: step blocked",
                             orbax_block_s), ("orbax save: written", orbax_s), ("restore from the local file",
                             local_s), ("fetch from the neighbour (TCP)", fetch_s), ("orbax restore",
                             orbax_restore_s)):
                    times.setdefault(k, []).append(v)
        c.close()
        mgr.close()
        server.close()
        fetcher.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    head = ["path", "median s", "GB/s", "each try s"]
    rows = [[k, f"{_bench.median(v):.3f}", f"{nbytes / _bench.median(v) / 1e9:.2f}", " ".join(f"{x:.2f}" for x in v)]
            for k, v in times.items()]
    return head, rows, [f"state: {nbytes / 1e9:.3f} GB (3 float32 leaves split over 8 devices)"]


def main():
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=120, help="steps of each run")
    p.add_argument("--at", type=int, default=30, help="the step the fault strikes at")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="the scenarios to run, comma-separated")
    p.add_argument("--commit-cost", action="store_true",
                   help="measure what committing every step costs the main job instead of the scenarios")
    p.add_argument("--job", choices=tuple(JOBS), default="main",
                   help="--commit-cost: the main job or the GPT of 1.2 GB of state (8x1 FSDP, d_model 1024, 8 layers)")
    p.add_argument("--rounds", type=int, default=12, help="--commit-cost: rounds of (no commit, auto, every step)")
    p.add_argument("--block", type=int, default=20, help="--commit-cost: steps per block")
    p.add_argument("--writes", type=int, default=3, help="--commit-cost / --paths: tries of each path")
    p.add_argument("--paths", action="store_true",
                   help="the commit path beside a plain write and orbax, saving and restoring one state")
    p.add_argument("--gb", type=float, default=1.2, help="--paths: the state's size")
    p.add_argument("--restart", action="store_true",
                   help="the issue's restart as a user meets it (one agent, 4 processes, a kill at --at), "
                        "--tries times")
    p.add_argument("--tries", type=int, default=3, help="--restart: how many times")
    p.add_argument("--data", default=None, help="a text file; None: 300 kB of the stdlib corpus")
    _bench.add_smoke(p, "the same-size and after-end scenarios, 8 steps; or 2 rounds of 8-step blocks for the commit "
                        "cost")
    args = p.parse_args()
    out_dir = tempfile.mkdtemp(prefix="dpjax-elastic-")
    if args.data is None:
        from dpjax.data import load_corpus

        args.data = os.path.join(out_dir, "corpus.txt")
        with open(args.data, "wb") as fh:
            fh.write(load_corpus("stdlib", max_bytes=300_000).tobytes())
    if args.restart and args.at == p.get_default("at"):
        args.at = 35  # the step
    if args.smoke:
        args.steps, args.at, args.rounds, args.block, args.writes, args.tries = 8, 3, 2, 8, 1, 1
        args.scenarios = "same,after-end"
    if args.smoke and args.paths:
        args.gb = 0.01
    if args.commit_cost or args.paths:  # in this process: the main job's 8 simulated devices, before JAX starts
        from dpjax.collectives.cpu_runtime import simulate_cpu_devices

        simulate_cpu_devices(8)
    print(f"# {_bench.machine()}, load {_bench.load_avg():.1f}, {time.strftime('%Y-%m-%d')}, outputs in {out_dir}")
    head, rows, *notes = (commit_cost(args, out_dir) if args.commit_cost else paths(args, out_dir) if args.paths
                          else restart(args, out_dir) if args.restart else scenarios(args, out_dir))
    print(_bench.markdown_table(head, rows))
    for line in (notes[0] if notes else []):
        print(f"# {line}")
    print(f"# load after: {_bench.load_avg():.1f}")


if __name__ == "__main__":
    main()
