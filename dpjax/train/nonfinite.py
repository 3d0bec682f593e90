"""A loss that turns NaN or Inf stops the run in one line, naming the last good checkpoint.

A step's loss is computed from the state after the steps before it, so a non-finite
loss at step k condemns the state of k steps done: the last good checkpoint is the
newest saved before k. One saved at k itself (saved before its loss was known: the next
step donates the state's buffers) is set aside, renamed `nonfinite-<k>` and kept, so that
--resume does not start again from it. A checkpoint is never saved from a state that is
not finite (`finite`, checked before each save).

There is no --nan-policy skip: a divergence from too high a learning rate comes back at
the next step whatever one step skips, and skipping exactly one update would need every
update rule's step to carry a condition on its result; stopping with the checkpoint
named is what the run can do honestly.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from dpjax.errors import UserError

SET_ASIDE = "nonfinite-{step}"


class NonFinite(UserError):
    """The loss or the state turned NaN or Inf: the run stops (exit 2; under dpjax.agent
    the job ends rather than restart into the same divergence)."""


@functools.cache
def _all_finite():
    return jax.jit(lambda leaves: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves])))


def finite(tree) -> bool:
    """Whether every float in `tree` (global arrays: parameters, optimizer state) is finite."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return not leaves or bool(_all_finite()(leaves))


def last_good(saved: list[int], step: int) -> int | None:
    """The newest checkpoint (steps done) whose state gave a finite loss, when the loss
    of step index `step` is not finite: the newest saved before it."""
    good = [s for s in saved if s < step]
    return max(good) if good else None


def stop(what: str, step: int, cfg, saved: list[int]) -> NonFinite:
    """The one line that ends the run: what turned non-finite, and the last good
    checkpoint; `step`: the steps done whose state is bad."""
    good = last_good(saved, step)
    if good is not None:
        where = f"the last good checkpoint is step {good} in {cfg.ckpt_dir}" + (
            f" (the one of step {step} is set aside as {os.path.basename(aside_path(cfg.ckpt_dir, step))})"
            if step in saved else "")
    elif cfg.ckpt_dir:
        where = f"no checkpoint before step {step} in {cfg.ckpt_dir}"
    else:
        where = "no checkpoint was saved (--ckpt-dir keeps them)"
    return NonFinite(f"{what}: stopped; {where}. A learning rate too high for the model is the usual cause "
                     "(--lr, --warmup-steps, --clip-norm)")


def aside_path(directory: str, step: int) -> str:
    """Where checkpoint `step` goes when set aside: nonfinite-<step>, or .1, .2, ... after
    it when a resume met the same loss again."""
    name = SET_ASIDE.format(step=step)
    path, n = os.path.join(directory, name), 1
    while os.path.exists(path):
        path, n = os.path.join(directory, f"{name}.{n}"), n + 1
    return path


def set_aside(directory: str, step: int) -> None:
    """Renames checkpoint `step` out of orbax's steps (it lists integer names only): kept
    for a look, never picked by --resume. Call once its save is finished."""
    src = os.path.join(directory, str(step))
    if os.path.isdir(src):
        os.rename(src, aside_path(directory, step))
