"""What a restart keeps and changes: the settings fitted to the devices the job has now, the
compiled programs kept beside the commits, and how the global batch is cut on the new mesh
(`dpjax.train.elastic` runs the restart; the agent says the sizes through DPJAX_* variables)."""

from __future__ import annotations

import dataclasses
import os

from dpjax.distributed import launched_processes
from dpjax.mesh import dp_size
from dpjax.plan import fit_devices
from dpjax.recovery.env import ENV
from dpjax.recovery.programs import Programs


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
