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

from dpjax.tasks.table import TASKS, Task, tokens

__all__ = ["TASKS", "Task", "tokens"]
