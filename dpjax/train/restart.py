"""What a restart keeps and changes: the settings fitted to the devices the job has now, the
compiled programs kept beside the commits, and how the global batch is cut on the new mesh
(`dpjax.train.elastic` runs the restart; the agent says the sizes through DPJAX_* variables)."""

from __future__ import annotations

import dataclasses
import os
import time

from dpjax.distributed import launched_processes
from dpjax.mesh import dp_size
from dpjax.plan import fit_devices
from dpjax.recovery.env import ENV
from dpjax.recovery.programs import Programs


STAMPS: dict = {}  # the moments of this process's start: name -> (wall time, CPU seconds of the process so far)
PHASES = ("start_import", "join", "plan", "init", "restore", "first_step")  # each ends at the stamp of its name


def stamp(name: str) -> None:
    """A moment of the start (`PHASES`), its CPU seconds beside the wall time: on a loaded machine
    the wall seconds of a phase grow with the load, its CPU seconds much less."""
    STAMPS[name] = (time.time(), time.process_time())


def breakdown(restarted: float) -> dict:
    """Where a restart's seconds went, from `restarted` (when the agent started the processes) to
    the first step's end: {"wall": {phase: s}, "cpu": {phase: s}} of the phases stamped."""
    # the process's CPU clock starts at 0; a spare's (dpjax.agent.spare) when it was handed the round
    wall, cpu, last = {}, {}, (restarted, STAMPS.get("handed", (0.0, 0.0))[1])
    for name in PHASES:
        if name in STAMPS:
            (w, c), (w0, c0) = STAMPS[name], last
            wall[name], cpu[name], last = round(w - w0, 2), round(c - c0, 2), STAMPS[name]
    return {"wall": wall, "cpu": cpu}


def env(name: str, default=None):
    """What the agent says through its DPJAX_* variable (dpjax.recovery.env), or `default`."""
    return os.environ.get(ENV[name]) or default


def fit(cfg):
    """cfg for the devices the job has now, when the agent says how many each process has
    (DPJAX_DEVICES_PER_PROCESS): the mesh resized, the global batch kept in adjusted
    micro-batches (dpjax.plan.fit_devices); unchanged otherwise."""
    per_process = env("devices")
    if not per_process or not cfg.mesh:
        return cfg
    return fit_devices(cfg, int(per_process) * launched_processes())


NOT_IN_PROGRAMS = ("steps", "resume", "metrics", "tensorboard", "progress", "ckpt_dir", "ckpt_every", "commit_dir",
                   "commit_every", "max_lost_steps", "on_full_disk", "eval_every", "overwrite")


def programs(cfg):
    """The run's compiled programs kept beside its commits (`dpjax.recovery.programs`), so that a
    restart loads them instead of tracing and compiling; None without a commit folder."""
    root = cfg.commit_dir or env("commit_dir")
    if root is None:
        return None
    # every setting but those no program depends on (a --resume of a plain run loads them too)
    run = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IN_PROGRAMS}
    return Programs(os.path.join(os.path.abspath(root), env("host", "local"), "programs"), run)


def micro_batches(cfg, mesh) -> dict:
    """How the global batch is cut on this mesh (what a restart at another size changes)."""
    return {"global_batch": cfg.batch_size * cfg.backward_passes, "backward_passes": cfg.backward_passes,
            "batch_per_pass": cfg.batch_size, "per_device": cfg.batch_size // dp_size(mesh)}
