"""A chaos soak (issue 51): a job of 2 agents x 2 processes (`python -m dpjax.agent`, two
agents on 127.0.0.1 standing for two hosts, `--mesh 4x2`, each process 2 CPU devices)
trains while a seeded schedule injects one fault every `--every` steps, at a random moment
of a random step, from:

    kill        SIGKILL of a rank
    in-commit   SIGKILL of a rank in its next commit file's write (own or neighbour copy): armed
                through DPJAX_FAULT_ARM (dpjax.recovery.fault.in_write), it cuts the temporary
                file to half and kills itself before the rename
    hang        SIGSTOP of a rank (the agent's --hang-timeout finds it)
    host        SIGKILL of host h1's agent (its processes die with it); started again 1 s later
    corrupt     one byte flipped in the newest commit file of a rank, then a rank killed (so
                that a restore meets it: it must be passed over, its neighbour copy used)
    truncate    the largest file of the newest sealed orbax checkpoint cut in half, then a
                rank killed (the restore passes over that checkpoint)
    full        the commit folder (a tmpfs) filled for 3 s (`--on-full-disk skip-commits`)
    double      two ranks, one on each host, killed and stopped within one step's time

The rendezvous host (h0's agent) is never killed: the built-in rendezvous must survive
(docs/recovery.md). Then the same job without faults (same seed, same data order), and the
checks: the final parameters (every rank's last commit file, array by array) equal the
undisturbed run's bit for bit, the metrics hold every step exactly once with the
undisturbed run's losses, and both agents exit 0. The table: per fault kind, the steps
lost and the seconds lost (failure to the first step after it, from each restart record),
median and worst.

    python experiments/chaos.py                          # 300 steps, a fault every 12 steps
    python experiments/chaos.py --steps 120 --every 10   # a shorter schedule
    python experiments/chaos.py --smoke                  # 30 steps, three faults
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _bench  # noqa: E402
from _chaos_faults import inject  # noqa: E402

KINDS = ("kill", "in-commit", "hang", "host", "corrupt", "truncate", "full", "double")
MODEL = ["--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "16",
         "--batch-size", "16", "--eval-every", "0", "--eval-batches", "1", "--progress", "none", "--mesh", "4x2"]


def schedule(seed: int, steps: int, every: int, kinds) -> list:
    """[(step, kind)]: one fault every `every` steps at a random step of its stretch, the
    kinds in a seeded order that deals each once before any twice."""
    rng, out, deck = random.Random(seed), [], []
    for start in range(every, steps - every // 2, every):
        deck = deck or rng.sample(list(kinds), len(kinds))
        out.append((start + rng.randrange(max(1, every // 2)), deck.pop()))
    return out


class Job:
    """Two agents of two processes each, the faults' targets."""

    def __init__(self, tmp, train, hang_timeout: float, spares: bool = False):
        from dpjax.agent.rendezvous import free_port

        self.tmp, self.tag, self.port = tmp, uuid.uuid4().hex, free_port()
        self.metrics, self.root = os.path.join(tmp, "m.jsonl"), os.path.join(tmp, "commits")
        self.arm = os.path.join(tmp, "arm")  # where a rank is armed to die in a commit's write
        os.makedirs(self.arm, exist_ok=True)
        self.env = {**_bench.checkout_env(), "DPJAX_CHAOS": self.tag, "DPJAX_FAULT_ARM": self.arm}
        self.env.pop("XLA_FLAGS", None)
        self.cmd = [sys.executable, "-m", "dpjax.agent", "--nnodes", "2:2", "--nproc-per-node", "2", "--rdzv",
                    f"127.0.0.1:{self.port}", "--devices-per-process", "2", "--commit-dir", self.root,
                    "--max-restarts", "1000", "--hang-timeout", str(hang_timeout), "--rdzv-wait", "120",
                    *(["--spares"] if spares else [])]
        self.train = [sys.executable, "-m", "dpjax.train", *train, "--metrics", self.metrics,
                      "--ckpt-dir", os.path.join(tmp, "ckpt")]
        self.agents = {}

    def start(self, host: str) -> None:
        err = open(os.path.join(self.tmp, f"agent-{host}.err"), "a")
        self.agents[host] = subprocess.Popen([*self.cmd, "--host-id", host, "--", *self.train], env=self.env,
                                             stdout=subprocess.DEVNULL, stderr=err)
        while host == "h0":  # h0 runs the rendezvous: the other agent finds it listening
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)

    def ranks(self) -> dict:
        """{rank: pid} of this job's training processes now: from their environment, or for a
        spare (--spares: told its rank on stdin) from the pid its heartbeat file names."""
        out, ours = {}, set()
        for env in glob.glob("/proc/[0-9]*/environ"):
            try:
                with open(env, "rb") as fh:
                    kv = dict(x.split(b"=", 1) for x in fh.read().split(b"\0") if b"=" in x)
            except OSError:
                continue
            if kv.get(b"DPJAX_CHAOS") == self.tag.encode():
                ours.add(int(env.split("/")[2]))
                if b"DPJAX_PROCESS_ID" in kv:
                    out[int(kv[b"DPJAX_PROCESS_ID"])] = int(env.split("/")[2])
        for path in glob.glob(os.path.join(self.root, "heartbeat", "*", "heartbeat-*[0-9]")):
            try:
                with open(path) as fh:
                    pid = json.load(fh).get("pid")
            except (OSError, ValueError):
                continue
            if pid in ours and pid not in out.values():
                out.setdefault(int(path.rsplit("-", 1)[1]), pid)
        return out

    def rows(self) -> list:
        """The metrics rows so far; a line that is not JSON (torn by a kill) as {"torn": line}."""
        out = []
        try:
            with open(self.metrics) as fh:
                for line in fh:
                    if line.endswith("\n"):
                        try:
                            out.append(json.loads(line))
                        except ValueError:
                            out.append({"torn": line})
        except FileNotFoundError:
            pass
        return out

    def step(self) -> int:
        return max((r["step"] for r in self.rows() if "loss" in r), default=0)

    def restarts(self) -> list:
        return [r for r in self.rows() if r.get("event") == "restart"]

    def running(self) -> bool:
        return all(a.poll() is None for a in self.agents.values())


def soak(tmp, args, faults, programs=None) -> dict:
    """Runs the job; injects `faults` [(step, kind)]; {"log": [...], "codes", "seconds", ...}.
    programs: a commit root whose hosts' compiled programs are copied in first (loaded, not
    compiled: the undisturbed run's, so that the faults meet a job in its steady state)."""
    os.makedirs(tmp, exist_ok=True)
    train = [*MODEL, "--data", args.data, "--steps", str(args.steps), "--ckpt-every", str(args.ckpt_every),
             "--max-lost-steps", str(args.max_lost_steps), "--on-full-disk", "skip-commits"]
    job = Job(tmp, train, args.hang_timeout, spares=args.spares and bool(faults))
    mounted = _mount(job.root, args.tmpfs_mb) if faults else False
    for host in (os.listdir(programs) if programs else []):
        if os.path.isdir(os.path.join(programs, host, "programs")):
            shutil.copytree(os.path.join(programs, host, "programs"), os.path.join(job.root, host, "programs"))
    rng, log, stalls, t0 = random.Random(args.seed + 1), [], [], time.time()
    job.start("h0")
    job.start("h1")
    try:
        for step, kind in faults:
            if kind == "full" and not mounted:
                log.append({"step": step, "kind": kind, "did": "skipped: no tmpfs could be mounted here"})
                continue
            got = wait(job, lambda s=step: job.step() >= s, args.recover_s)
            if got != "ok":
                stalls.append(f"before the fault at step {step}: {got}")
                break
            time.sleep(rng.uniform(0, 0.3))  # a random moment within the step
            before, at, reached = len(job.restarts()), time.time(), job.step()
            did = inject(job, kind, rng)
            log.append({"step": reached, "kind": kind, "did": did, "t": at, "restarts_before": before})
            print(f"step {reached}: {kind}: {did}", flush=True)
            if kind != "full" and not did.startswith("skipped"):
                got = wait(job, lambda b=before, r=reached: recovered(job, b, r), args.recover_s)
                if got != "ok":
                    stalls.append(f"after the {kind} at step {reached}: {got}")
                    if got != "ended":
                        break
        codes = {h: a.wait(timeout=1800) for h, a in job.agents.items()} if not stalls or "ended" in stalls[-1] \
            else {h: a.poll() for h, a in job.agents.items()}  # a stalled job is not waited for: killed below
        arrays = final_arrays(job, args.steps)  # before the tmpfs goes
    finally:
        for a in job.agents.values():
            if a.poll() is None:
                a.kill()
        if mounted:
            subprocess.run(["umount", "-l", job.root], capture_output=True)
    return {"log": log, "stalls": stalls, "codes": codes, "seconds": time.time() - t0, "rows": job.rows(),
            "arrays": arrays, "logs": _agent_logs(job)}


def wait(job: Job, until, limit: float, poll: float = 0.05, first: float = 1800.0) -> str:
    """Waits until `until()` holds ("ok"), the job ends ("ended"), or it trains no new step for
    `limit` seconds (a job stuck, or a restart that never trains again), `first` before its first
    step (the start's imports and compiles: 5 minutes at load 40-50): said, not waited for."""
    last, since = job.step(), time.time()
    while not until():
        if not job.running():
            return "ended"
        now, step = time.time(), job.step()
        if step != last:
            last, since = step, now
        elif now - since > (limit if step else first):
            return f"no new step for {limit if step else first:g} s (the job at step {step})"
        time.sleep(poll)
    return "ok"


def recovered(job: Job, before: int, reached: int) -> bool:
    """Whether the job trains again after a fault struck at step `reached` with `before` restart
    rows: a new restart row and a step after its first, or steps past any the lost job could
    have had in flight (MAX_IN_FLIGHT 1: `reached` + 2) whether or not a restart row came."""
    rows = job.restarts()
    return (len(rows) > before and job.step() > rows[-1].get("restored_step", 0) + 1) or job.step() > reached + 2


def _agent_logs(job: Job) -> str:
    """Everything the agents and their processes said (the agents' stderr, every rank's log)."""
    text = []
    for path in [*glob.glob(os.path.join(job.tmp, "agent-*.err")),
                 *glob.glob(f"/tmp/dpjax-agent-{job.port}-logs/*/*")]:
        if os.path.isfile(path):
            with open(path, errors="replace") as fh:
                text.append(fh.read())
    return "\n".join(text)


def _mount(folder: str, mb: int) -> bool:
    os.makedirs(folder, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", folder], capture_output=True)
    return r.returncode == 0


def final_arrays(job: Job, steps: int) -> dict:
    """{rank: the arrays of its last commit}, read from the commit files (own copies, else
    the neighbour's: a fault after the end may hit the last own file); under a tmpfs these
    are read before it is unmounted."""
    from dpjax.recovery.file_format import CommitError, decode, read

    out = {}
    # own copies first; the neighbour's copy of a rank whose own one a fault after the job's
    # end tore or flipped (a restore would pass it over the same way)
    for where in ("own", "peer"):
        for path in glob.glob(os.path.join(job.root, "*", where, "r*", f"s{steps:09d}_w4.bin")):
            try:
                meta, arrays = decode(read(path))
            except (CommitError, OSError):
                continue
            out.setdefault(meta["rank"], [a.copy() for a in arrays])
    return out


def check(run: dict, straight: dict, steps: int) -> list:
    """What must hold after the soak; [problem, ...] (empty: all held)."""
    problems = [f"the soak stopped waiting {s}" for s in run.get("stalls", []) if "ended" not in s]
    if set(run["codes"].values()) != {0}:
        problems.append(f"the agents exited {run['codes']}")
    torn = [r["torn"][:80] for r in run["rows"] if "torn" in r]
    if torn:
        problems.append(f"metrics: {len(torn)} torn lines, the first {torn[0]!r}")
    counts = {}
    for r in run["rows"]:
        if "loss" in r:
            counts[r["step"]] = counts.get(r["step"], 0) + 1
    twice, missing = [s for s, n in counts.items() if n > 1], [s for s in range(1, steps + 1) if s not in counts]
    if twice or missing:
        problems.append(f"metrics: steps written twice {twice[:10]}, missing {missing[:10]}")
    ref = {r["step"]: r["loss"] for r in straight["rows"] if "loss" in r}
    got = {r["step"]: r["loss"] for r in run["rows"] if "loss" in r}
    if got != ref:
        problems.append(f"losses differ at steps {[s for s in ref if got.get(s) != ref[s]][:10]}")
    a, b = run["arrays"], straight["arrays"]
    if sorted(a) != sorted(b) or len(a) != 4:
        problems.append(f"final commits of ranks {sorted(a)} against {sorted(b)}")
    elif any(x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes()
             for r in a for x, y in zip(a[r], b[r], strict=True)):
        problems.append("the final parameters differ from the undisturbed run's")
    return problems


def table(run: dict) -> tuple[list, list]:
    """Per fault kind: how many, restarts, steps lost and seconds lost (median / worst); and
    the restarts no fault caused (before the first: a host that joined late), in a row of
    their own, counted in "all"'s restarts but not in its steps lost per fault."""
    restarts, log = [r for r in run["rows"] if r.get("event") == "restart"], run["log"]
    cost: dict = {}
    for i, f in enumerate(log):
        upto = log[i + 1]["restarts_before"] if i + 1 < len(log) and "restarts_before" in log[i + 1] else None
        mine = restarts[f.get("restarts_before", len(restarts)):upto]
        c = cost.setdefault(f["kind"], {"n": 0, "restarts": 0, "lost": [], "seconds": []})
        c["n"] += 1
        c["restarts"] += len(mine)
        c["lost"] += [r.get("steps_lost") or 0 for r in mine]
        c["seconds"] += [r["seconds_lost"] for r in mine if r.get("seconds_lost") is not None]
    head = ["fault", "injected", "restarts", "steps lost: median", "worst", "seconds lost: median", "worst"]
    rows = []
    for kind in KINDS:
        if kind in cost:
            c = cost[kind]
            rows.append([kind, c["n"], c["restarts"], _med(c["lost"]), max(c["lost"], default="-"),
                         _med(c["seconds"]), max(c["seconds"], default="-")])
    # restarts before the first fault: none caused them (a host that joined the job late regrows it)
    unforced = restarts[:log[0].get("restarts_before", 0)] if log else restarts
    if unforced:
        lost, secs = [r.get("steps_lost") or 0 for r in unforced], [r["seconds_lost"] for r in unforced
                                                                    if r.get("seconds_lost") is not None]
        rows.append(["(no fault: before the first)", "-", len(unforced), _med(lost), max(lost),
                     _med(secs), max(secs, default="-")])
    every = [x for c in cost.values() for x in c["lost"]]
    rows.append(["all", sum(c["n"] for c in cost.values()), len(restarts),
                 f"{sum(every) / max(1, len(log)):.2f} per fault", max(every, default="-"), "", ""])
    return head, rows


def _med(xs) -> str:
    return f"{_bench.median(xs):.3g}" if xs else "-"


def main(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="steps of the job")
    p.add_argument("--every", type=int, default=12, help="a fault every this many steps")
    p.add_argument("--kinds", default=",".join(KINDS), help="the fault kinds drawn from, comma-separated")
    p.add_argument("--seed", type=int, default=0, help="the schedule's seed (the job's is dpjax.train's default)")
    p.add_argument("--max-lost-steps", type=int, default=1, help="the job's --max-lost-steps")
    p.add_argument("--ckpt-every", type=int, default=50, help="the job's --ckpt-every (truncate's targets)")
    # a save or an evaluation is no longer held to it (dpjax.recovery.heartbeat: busy between
    # steps), only a step or a stopped process's silence: 20 s leaves a loaded machine's step room
    p.add_argument("--hang-timeout", type=float, default=20.0, help="the agents' --hang-timeout")
    p.add_argument("--recover-s", type=float, default=300.0, help="the longest wait for a restart to train again")
    p.add_argument("--tmpfs-mb", type=int, default=64, help="the commit folder's tmpfs (the full disk's)")
    p.add_argument("--spares", action="store_true", help="the agents' --spares (the faulted job's)")
    p.add_argument("--data", default=None, help="a text file; None: 300 kB of the stdlib corpus")
    _bench.add_smoke(p, "30 steps, three faults: kill in a commit's write, a corrupted commit, two at once")
    args = p.parse_args(argv)
    out = tempfile.mkdtemp(prefix="dpjax-chaos-")
    if args.smoke:
        args.steps, args.every, args.kinds, args.ckpt_every = 30, 8, "in-commit,corrupt,double", 10
    if args.data is None:
        from dpjax.data import load_corpus

        args.data = os.path.join(out, "corpus.txt")
        with open(args.data, "wb") as fh:
            fh.write(load_corpus("stdlib", max_bytes=300_000).tobytes())
    faults = schedule(args.seed, args.steps, args.every, args.kinds.split(","))
    when = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    print(f"# {os.cpu_count()} cores, load {_bench.load_avg():.1f}, {when}, {len(faults)} faults over "
          f"{args.steps} steps, outputs in {out}", flush=True)
    straight = soak(os.path.join(out, "straight"), args, [])
    run = soak(os.path.join(out, "chaos"), args, faults, programs=os.path.join(out, "straight", "commits"))
    head, rows = table(run)
    print(_bench.markdown_table(head, rows))
    for r in (r for r in run["rows"] if r.get("event") == "restart" and "breakdown" in r):
        b = r["breakdown"]  # where each restart's seconds went, wall (CPU) per phase: kept after the folder goes
        print(f"# restart {r['attempt']}: {r['seconds_lost']} s lost, agent {r['restart_s']} s, "
              + ", ".join(f"{k} {b['wall'][k]} ({b['cpu'].get(k)})" for k in b["wall"]), flush=True)
    for line in run["stalls"]:
        print(f"# stopped injecting {line}; {len(run['log'])} of {len(faults)} faults injected", flush=True)
    detected = sum(run["logs"].count(m) for m in ("passed over", "cannot be written"))
    print(f"# chaos run {run['seconds']:.0f} s, undisturbed {straight['seconds']:.0f} s; lines naming a bad or "
          f"refused file: {detected}; load after: {_bench.load_avg():.1f}")
    problems = check(run, straight, args.steps)
    for line in problems:
        print(f"FAILED: {line}", flush=True)
    if problems:
        raise SystemExit(1)
    print("every step once, the losses and the final parameters bit for bit the undisturbed run's")
    shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    main()
