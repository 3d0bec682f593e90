"""Every `DPJAX_*` environment variable dpjax (or its test suite, or an experiment) reads: one table.

Each entry says what the variable means, what unset means, and who sets it when it is not
the user (dpjax.launch and dpjax.agent pass some to the processes they start). The docs'
table (docs/environment.md) is this one, rendered by `markdown()`; tests/test_env.py checks
that every `DPJAX_*` name in the source (dpjax's, its models', tests/conftest.py's and the
experiments') is here, that each entry is still read somewhere, and that the page shows
the table as it is. A new variable joins the table first: `value(name)` refuses a name
that is not in it.

    python -c "from dpjax import env; print(env.markdown(), end='')"    the docs' table
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Var:
    name: str
    unset: str  # what leaving it unset means (the default)
    meaning: str
    set_by: str = "you"  # who sets it: the user, or the dpjax tool that passes it to its processes


VARS: dict[str, Var] = {v.name: v for v in (
    # the user's switches
    Var("DPJAX_CHECK", "check the first calls only",
        "`1`: `shard_step` (and `python -m dpjax.train`) checks on every call that the values it declares "
        "replicated are equal on every device; `reference`: `shard_step` and `dpjax.jit` run each step's first "
        "call also on one device and compare (`check=\"reference\"`)"),
    Var("DPJAX_DEBUG", "one line", "`1`: the CLIs (`dpjax.train`, `dpjax.hf`, `dpjax.generate`) show the "
        "traceback of a user error too"),
    Var("DPJAX_CPU_GUARDS", "`all`", "which guards on XLA:CPU's collectives `simulate_cpu_devices` and "
        "`cpu_guards` apply: `all`, `channels` (a channel id per collective), `threads` (NPROC sized for the "
        "devices) or `none`; the others than `all` are for showing a fault"),
    Var("DPJAX_XLA_FLAGS", "`1`", "`0`: `python -m dpjax.train` adds none of its recommended GPU XLA flags "
        "(the latency-hiding scheduler) to XLA_FLAGS"),
    Var("DPJAX_FAULT", "no fault", "faults to inject for a test of recovery, e.g. `rank=2,step=30,kind=kill` "
        "(kinds kill, hang, raise; `forever`, `host`, `wipe`): see `dpjax/recovery/fault.py`"),
    Var("DPJAX_FAULT_ARM", "no fault", "a folder: a process that finds `kill-in-write-<its pid>` there when it "
        "writes a commit file cuts the file to half and SIGKILLs itself before the rename (a death in a commit's "
        "write): see `dpjax/recovery/fault.py`", "`experiments/chaos.py`"),
    Var("DPJAX_COLLECTIVE_TIMEOUT", "300", "seconds a process waits for the others to agree on a collective call "
        "(shape, dtype, op, ...) across processes before it stops with one line"),
    Var("DPJAX_INIT_TIMEOUT", "300", "seconds `dpjax.distributed.initialize` waits for every process to join"),
    Var("DPJAX_HEARTBEAT_TIMEOUT", "10", "seconds after which `jax.distributed`'s coordination service "
        "declares a silent process dead", "you, or `dpjax.agent` (past its `--hang-timeout`)"),
    Var("DPJAX_LAUNCH_GRACE", "10", "seconds between the steps of `dpjax.launch`'s Ctrl-C escalation "
        "(SIGINT, SIGTERM, SIGKILL)"),
    Var("DPJAX_LAUNCH_KILL_GRACE", "2", "seconds between SIGTERM and SIGKILL to the survivors once a rank of "
        "`dpjax.launch` died"),
    # dpjax.launch's (a user may set them by hand under any other launcher)
    Var("DPJAX_COORDINATOR", "the launcher's, or JAX_COORDINATOR_ADDRESS", "`host:port` of rank 0's "
        "`jax.distributed` coordinator; wins over what a launcher says", "`dpjax.launch`, or you"),
    Var("DPJAX_NUM_PROCESSES", "the launcher's, else 1", "the number of processes of the job",
        "`dpjax.launch`, or you"),
    Var("DPJAX_PROCESS_ID", "the launcher's, else 0", "this process's rank in the job, from 0 (the "
        "coordinator's) to the count - 1", "`dpjax.launch`, or you"),
    Var("DPJAX_LOCAL_RANK", "the launcher's", "this process's rank on its host",
        "`dpjax.launch`, or you"),
    Var("DPJAX_COLLECTIVES", "`gloo`", "the CPU collectives between processes (`gloo` or `mpi`) when "
        "`--collectives` is not given", "`dpjax.launch --collectives`, or you"),
    Var("DPJAX_SHAPED_MBIT", "not shaped", "set inside `dpjax.launch --shape-mbit`'s network namespace (the "
        "rate): the launcher there does not shape again", "`dpjax.launch`"),
    # dpjax.agent's, for each process it starts (dpjax.recovery.env)
    Var("DPJAX_RESTART", "not under the agent", "0 for a job's first attempt, n after n restarts",
        "`dpjax.agent`"),
    Var("DPJAX_HOST", "`local`", "the host's name: its folder under the commit root", "`dpjax.agent`"),
    Var("DPJAX_LOCAL_WORLD_SIZE", "1", "processes per host: a process's neighbour for peer copies is rank + this",
        "`dpjax.agent`"),
    Var("DPJAX_DEVICES_PER_PROCESS", "the mesh as given", "devices each process has: the mesh is resized for "
        "processes x this", "`dpjax.agent`"),
    Var("DPJAX_HEARTBEAT", "no heartbeat", "the file a thread of the process rewrites every second and the "
        "training loop at every step (the agent's hang check: `dpjax/recovery/heartbeat.py`)", "`dpjax.agent`"),
    Var("DPJAX_COMMIT_DIR", "no commits", "the commit root when `--commit-dir` is not given", "`dpjax.agent`"),
    Var("DPJAX_LAST_FAILURE", "none", "JSON: what ended the previous attempt, when, and how far it got",
        "`dpjax.agent`"),
    Var("DPJAX_AGENT_PID", "none", "the host's agent: a process whose host is lost takes it down too",
        "`dpjax.agent`"),
    # the test suite's and the experiments'
    Var("DPJAX_TEST_COSTS", "nothing written", "a file: `pytest` appends each test's wall and CPU seconds to it "
        "as JSON lines (tests/conftest.py)"),
    Var("DPJAX_CHAOS", "not a chaos run", "a tag on every process of one chaos run: the script finds its own "
        "training processes (and no other run's) by it in `/proc/PID/environ`", "`experiments/chaos.py`"),
)}


def value(name: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """The environment's value of a variable of the table (None when unset); a name that
    is not in the table is a bug of ours (KeyError)."""
    if name not in VARS:
        raise KeyError(f"{name} is not in dpjax.env.VARS: add it to the table first")
    return environ.get(name)


def markdown() -> str:
    """The table docs/environment.md shows."""
    rows = ["| variable | unset | meaning | set by |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.unset} | {v.meaning} | {v.set_by} |" for v in VARS.values()]
    return "\n".join(rows) + "\n"
