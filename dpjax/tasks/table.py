"""The task registry: a `Task` per name (its loss and its loss with statistics), and `tokens`."""

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
