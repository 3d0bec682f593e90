"""What a step optimises, one file per task: each gives a model's loss on the batch the
task needs, and the step builder (`dpjax.step`) takes any of them.

    lm    next-token prediction on every token (pretraining): the batch is tokens, B x T+1
    sft   next-token prediction weighted per target (answer-only fine-tuning): the batch is
          {"tokens": B x T+1 int32, "weights": B x T float32}, packed rows with "segment_ids"
          and "positions" too (B x T int32: `sft.py`)
    dpo   preference pairs against a reference (DPO, IPO, hinge, SimPO): the batch is
          {"tokens": the chosen rows, "rejected", "masks", "ref"} (`dpo.py`)
    grpo  sampled completions and their group advantages, the clipped objective with a KL
          term: {"tokens", "weights", "adv", "ref", "old"} (`grpo.py`; `dpjax.train.rollout`)

A task's batch is a pytree whose leaves all have the rows first (B; A x B for the train
step's micro-batches): the data axes split every leaf alike, the micro-batches scan over
every leaf alike. `tokens(batch)` is the token ids whichever task made it (a pair's: its
chosen row). A task's loss may read the run's settings (`loss(model, settings)`; None for
research code's plans): dpo's variant and beta.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from dpjax.registry import Registry
from dpjax.tasks import dpo, grpo, lm, sft


@dataclasses.dataclass(frozen=True)
class Task:
    """A registered task: `loss(model, settings) -> loss_fn(params, batch, par)`, and the
    loss with statistics: the model's own (a mixture's router figures) when it has them, or
    the task's (`reports`: dpo's rewards and accuracy, in every metrics row)."""

    name: str
    loss: Callable[..., Callable]
    loss_and_stats: Callable[..., Callable]
    about: str = ""
    reports: bool = False


TASKS: Registry[Task] = Registry("task")
TASKS.register(Task("lm", lm.loss, lm.loss_and_stats, "next-token prediction on every token (pretraining)"))
TASKS.register(Task("sft", sft.loss, sft.loss_and_stats,
                    "next-token prediction on the answers only (chat / instruction fine-tuning)"))

TASKS.register(Task("dpo", dpo.loss, dpo.loss_and_stats,
                    "preference pairs (--data pref:FILE.jsonl) against a reference: DPO and its variants "
                    "(--dpo-loss)", reports=True))

TASKS.register(Task("grpo", grpo.loss, grpo.loss_and_stats,
                    "rewards of sampled completions (--prompts FILE.jsonl --reward module:function): GRPO's clipped "
                    "objective with group-normalised advantages and a KL term", reports=True))


def tokens(batch):
    """The token ids of a task's batch (B x T+1, or A x B x T+1)."""
    return batch["tokens"] if isinstance(batch, dict) else batch


__all__ = ["TASKS", "Task", "tokens"]
