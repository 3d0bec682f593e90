"""The run's checkpoints (--ckpt-dir): the built-in hook that owns the `Checkpointer`
(`dpjax.recovery.checkpoint`, orbax) and the steps saved. It restores while the trainer
starts (`restore`), and saves every --ckpt-every steps, at the last step and at a stop."""

from __future__ import annotations

import os
import sys

import jax

from dpjax.recovery.checkpoint import Checkpointer, NoneGood
from dpjax.recovery.env import restart_number
from dpjax.train import nonfinite, record, resume
from dpjax.train.hooks import Hook


class Checkpoints(Hook):
    """Owns --ckpt-dir's `Checkpointer` and the steps saved: the restore while the trainer
    starts, a checkpoint every --ckpt-every steps, at the last step and at a stop (Ctrl-C's
    included); closed at the end, and one whose state gave a NaN set aside then."""

    def __init__(self, cfg):
        self.cfg, self.saved, self.set_aside = cfg, [], []
        self.ckpt: Checkpointer | None = None  # --ckpt-dir's, once opened

    def restore(self, trainer) -> None:
        """The newest checkpoint in --ckpt-dir into `trainer` (nothing there: a fresh start)."""
        cfg = self.cfg
        if not cfg.ckpt_dir or not os.path.isdir(cfg.ckpt_dir):  # the folder is made when the run is sure to start
            return
        self.ckpt = Checkpointer(cfg.ckpt_dir)
        latest = self.ckpt.latest_step()
        if latest is None:
            return
        if resume.refuse_fresh_into(cfg, "--ckpt-dir", cfg.ckpt_dir, "checkpoints", latest):
            self.ckpt.clear()  # --overwrite: a fresh run, its checkpoints the only ones there
            return
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                trainer.state())
        try:
            state, saved = self.ckpt.restore(abstract, expect=trainer.record)
        except NoneGood as e:
            if restart_number() == 0:
                raise
            # an agent's restart: the job's commits hold its state (dpjax.train.elastic restores
            # them next); a corrupt checkpoint must not end a job that lost a rank (the chaos soak:
            # the only checkpoint cut in half, every restart ended with exit 2)
            print(f"dpjax.recovery: {e}; the restart restores the job's commits", file=sys.stderr, flush=True)
            return
        trainer.load_state(state, saved["step"], saved["cursor"])
        trainer.resumed = saved
        self.saved = [saved["step"]]  # good as far as is known: a non-finite loss at this step sets it aside

    def open(self, trainer) -> None:
        """--ckpt-dir's Checkpointer (the folder made now, not for a refusal) and its run.json."""
        if not self.cfg.ckpt_dir:
            return
        self.ckpt = self.ckpt or Checkpointer(self.cfg.ckpt_dir)
        if jax.process_index() == 0:
            record.write_run_file(self.cfg.ckpt_dir, trainer.run_record)

    def save(self, trainer, step_done: int) -> None:
        """A checkpoint of the state after `step_done` steps; never of a state that holds
        a NaN or Inf (the run stops instead, naming the last good one)."""
        if not nonfinite.finite((trainer.params, trainer.opt_state)):
            raise nonfinite.stop(f"the update of step {step_done} turned the parameters or optimizer state NaN "
                                 "or Inf (not saved)", step_done, self.cfg, self.saved)
        assert self.ckpt is not None, "a checkpoint is saved only with --ckpt-dir (after_step)"
        self.ckpt.save(step_done, trainer.state(), {**trainer.record, "step": step_done, "cursor": trainer.cursor})
        self.saved.append(step_done)

    def after(self, loop, step: int) -> None:
        if self.ckpt and (step % self.cfg.ckpt_every == 0 or step == self.cfg.steps or loop.stopping):
            loop.drain()
            with loop.phase("checkpoint"):
                self.save(loop.trainer, step)
            loop.reset_clock()  # nor is saving

    def close(self, loop) -> None:
        loop.outcome["saved"] = self.saved[-1] if self.saved else None
        if self.ckpt:
            self.ckpt.close()
            for step in self.set_aside:  # its save finished (close waits)
                nonfinite.set_aside(self.ckpt.directory, step)
