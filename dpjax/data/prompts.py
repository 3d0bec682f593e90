"""Prompts for reinforcement learning from rewards (`--task grpo --prompts PATH`).

Rows, one JSON object a line, in FILE.jsonl or a folder of them (as TRL's GRPO reads them):

    {"prompt": "text", ...}                              the text as it is
    {"prompt": [{"role": "user", "content": ...}], ...}  rendered by the model's chat template for
                                                         generation (add_generation_prompt)

Any other fields stay with the row: the reward function may read them (an answer key, say).
A prompt whose ids and the completion's `max_completion` new tokens would not fit the model's
context (--seq-len) is refused with its row named: cutting a prompt changes the question.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dpjax.data import DataError
from dpjax.data.chat import ChatFormat, rows


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One row: its prompt's int32 ids as the model reads them, the row itself, where it is ("FILE:LINE")."""

    ids: np.ndarray
    row: dict
    where: str


def load(path: str, fmt: ChatFormat, seq_len: int, max_completion: int) -> list[Prompt]:
    """Every row of `path` as a Prompt, in file order."""
    out = []
    for where, row in rows(path):
        if "prompt" not in row:
            raise DataError(f"{where}: a prompt row has \"prompt\" (text or messages); got {sorted(row)}")
        ids, _ = fmt.encode_text(fmt.prompt(row, where))
        if len(ids) < 1:
            raise DataError(f"{where}: the prompt is empty")
        if len(ids) + max_completion > seq_len:
            raise DataError(f"{where}: the prompt's {len(ids)} tokens and --max-completion {max_completion} exceed "
                            f"--seq-len {seq_len}: raise --seq-len or shorten the prompt")
        out.append(Prompt(ids, row, where))
    if not out:
        raise DataError(f"--prompts {path} holds no rows")
    return out


@dataclasses.dataclass
class Prompts:
    """What a GRPO run's prompts are; shaped like `dpjax.train.streams.Chat` where the run reads
    it (its first lines, the record's "data", the end's sample: `held_out[0].where`)."""

    format: ChatFormat
    prompts: list
    reward: object = None  # --reward's function (dpjax.train.reward.Reward), imported with the prompts' reading

    @property
    def held_out(self) -> list:
        return self.prompts  # the end's sample asks the first prompt again

    def record(self) -> dict:
        lengths = [len(p.ids) for p in self.prompts]
        return {"prompts": {"rows": len(self.prompts), "tokens_min": min(lengths), "tokens_max": max(lengths)}}

    def line(self) -> str:
        r = self.record()["prompts"]
        return f"prompts: {r['rows']:,} rows of {r['tokens_min']}-{r['tokens_max']} tokens"
