"""What a step optimises, one file per task: each gives a model's loss on the batch the
task needs, and the step builder (`dpjax.step`) takes any of them.

    lm    next-token prediction on every token (pretraining): the batch is tokens, B x T+1
    sft   next-token prediction weighted per target (answer-only fine-tuning): the batch is
          {"tokens": B x T+1 int32, "weights": B x T float32}, packed rows with "segment_ids"
          and "positions" too (B x T int32: `sft.py`)

A task's batch is a pytree whose leaves all have the rows first (B; A x B for the train
step's micro-batches): the data axes split every leaf alike, the micro-batches scan over
every leaf alike. `tokens(batch)` is the token ids whichever task made it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from dpjax.registry import Registry
from dpjax.tasks import lm, sft


@dataclasses.dataclass(frozen=True)
class Task:
    """A registered task: `loss(model) -> loss_fn(params, batch, par)`, and the loss with
    the model's own statistics (a mixture's router figures) when the model has them."""

    name: str
    loss: Callable[[Any], Callable]
    loss_and_stats: Callable[[Any], Callable]
    about: str = ""


TASKS: Registry[Task] = Registry("task")
TASKS.register(Task("lm", lm.loss, lm.loss_and_stats, "next-token prediction on every token (pretraining)"))
TASKS.register(Task("sft", sft.loss, sft.loss_and_stats,
                    "next-token prediction on the answers only (chat / instruction fine-tuning)"))


def tokens(batch):
    """The token ids of a task's batch (B x T+1, or A x B x T+1)."""
    return batch["tokens"] if isinstance(batch, dict) else batch


__all__ = ["TASKS", "Task", "tokens"]
