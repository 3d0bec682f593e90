"""Starting fresh or resuming, decided out loud: a run never loses a file to a mistake.

    resuming(cfg)            --resume, or a restart by dpjax.agent (which resumes from its commits)
    check_metrics_file(cfg)  an existing --metrics file is appended to when resuming, refused
                             otherwise (--overwrite replaces it): before JAX starts
    refuse_fresh_into(...)   a fresh run into a --ckpt-dir or --commit-dir that holds another
                             run's saved state: refused (--overwrite replaces it)
    check_commit_dir(cfg)    that rule for --commit-dir, before JAX starts
    fresh_or_refuse(trainer) --resume that restored nothing is an error; a fresh run with a
                             --ckpt-dir says it starts fresh
    resume_command(argv)     the exact command that continues an interrupted run

Before these, `--resume --ckpt-dir ckpt_typo` started from step 0 without a word and
truncated the metrics file of the run it meant to continue.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys

from dpjax.errors import UserError
from dpjax.recovery.env import restart_number, under_agent
from dpjax.distributed import launched_processes
from dpjax.recovery.commit import inventory


class NothingToResume(UserError):
    """--resume, and no checkpoint or commit to resume from."""


class MetricsFileExists(UserError):
    """--metrics names a file that holds another run's rows."""


class SavedStateExists(UserError):
    """A fresh run's --ckpt-dir or --commit-dir holds another run's checkpoints or commits."""


def resuming(cfg) -> bool:
    """--resume, or an agent's restart (the same command again, continuing from the commits)."""
    return cfg.resume or restart_number() > 0


def check_metrics_file(cfg) -> None:
    """An existing --metrics file holds a run's record: a resumed run appends to it, a
    fresh run is refused, naming the flags that allow it. Run before JAX starts, so that
    the refusal costs nothing and nothing is written."""
    path = cfg.metrics
    if not path or not os.path.isfile(path) or os.path.getsize(path) == 0 or resuming(cfg) or cfg.overwrite:
        return
    with open(path, "rb") as fh:
        rows = sum(1 for _ in fh)
    raise MetricsFileExists(f"--metrics {path} already exists ({rows} rows); pass --resume to continue that run "
                            "(its rows are appended to), --overwrite to replace it, or another --metrics file")


def refuse_fresh_into(cfg, what: str, folder: str, held: str, latest: int) -> bool:
    """The rule of every folder a run saves its state in: a fresh run (no --resume, not an
    agent's restart) into one that already holds `held` (up to step `latest`) is refused,
    naming the flags that allow it; --overwrite says to replace them. True when the
    run starts fresh there (the caller removes what is held), False when it resumes."""
    if resuming(cfg):
        return False
    if not cfg.overwrite:
        raise SavedStateExists(f"{what} {folder} already holds {held} (latest step {latest}); pass --resume to "
                               f"continue that run, --overwrite to replace them, or another {what} (nothing was "
                               "overwritten)")
    return True


def check_commit_dir(cfg) -> None:
    """--commit-dir follows --ckpt-dir's rule (`refuse_fresh_into`), checked before JAX
    starts: a fresh run's Committer would remove the commits found there. With --overwrite
    every commit file there goes now (not only this process's: a restore takes the newest
    step every old rank committed, and an old run's could be newer than this run's)."""
    if not cfg.commit_dir or not os.path.isdir(cfg.commit_dir):
        return
    found = inventory(cfg.commit_dir)
    if found and refuse_fresh_into(cfg, "--commit-dir", cfg.commit_dir, "commits", max(f[1] for f in found)):
        for *_, rel in found:
            with contextlib.suppress(FileNotFoundError):  # another process of this host removed it first
                os.remove(os.path.join(cfg.commit_dir, rel))


def metrics_append(cfg) -> bool:
    """Whether the metrics file is appended to: always, unless --overwrite asks a fresh
    run to replace it (a resumed run or an agent's restart appends even then)."""
    return resuming(cfg) or not cfg.overwrite


def _where(cfg) -> str:
    """What --resume looked in, and what it found there."""
    out = []
    if cfg.ckpt_dir:
        state = "does not exist" if not os.path.isdir(cfg.ckpt_dir) else "holds no checkpoint"
        out.append(f"--ckpt-dir {cfg.ckpt_dir} {state}")
    if cfg.commit_dir:
        out.append(f"--commit-dir {cfg.commit_dir} holds no commit")
    return " and ".join(out)


def fresh_or_refuse(trainer) -> None:
    """After the checkpoint and the commits were looked for: --resume that restored
    nothing is one line, exit 2 (a misspelled folder is the usual cause); a fresh run with a
    --ckpt-dir says that it starts fresh. Under dpjax.agent, a first start with nothing
    committed is a fresh start (its restarts say what they restored themselves)."""
    cfg = trainer.cfg
    if trainer.start > 0 or restart_number() > 0:
        return
    if cfg.resume and not under_agent():
        raise NothingToResume(f"--resume: nothing to resume, {_where(cfg)}; check the path, or leave out --resume "
                              "to start a fresh run")
    if cfg.ckpt_dir and not cfg.resume:
        trainer.announce(f"starting fresh at step 0: no checkpoint in --ckpt-dir {cfg.ckpt_dir}")
    elif cfg.resume:  # under the agent: its first start
        trainer.announce("starting fresh at step 0: nothing saved or committed yet to resume from")


def resume_command(argv) -> str:
    """The command that continues this run: the same one with --resume. The interpreter
    is written `python` when that is the one on PATH, else by its path (a virtual
    environment's python is not the one on PATH unless it is activated)."""
    on_path = shutil.which("python")
    python = "python" if on_path and os.path.abspath(on_path) == sys.executable else sys.executable
    args = list(argv) + ([] if "--resume" in argv else ["--resume"])
    return shlex.join([python, "-m", "dpjax.train", *args])


def interrupted(cfg, saved: int | None, argv) -> str:
    """The end of an interrupted run's summary line: where it saved, and the command that
    continues it (in a launch of several processes: the launch, with --resume added)."""
    how = ("run the same launch with --resume added" if launched_processes() > 1
           else f"resume with: {resume_command(argv)}")
    if cfg.ckpt_dir and saved is not None:
        return f"saved step {saved} in {cfg.ckpt_dir}; {how}"
    if cfg.commit_dir:
        return f"the newest commit in {cfg.commit_dir} is kept; {how}"
    return "nothing was saved (no --ckpt-dir), so this run cannot be resumed"
