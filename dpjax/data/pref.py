"""Preference pairs for `--task dpo`: rows -> (chosen, rejected) token ids and answer masks,
and the stream of `dpjax.tasks.dpo`'s batches.

Rows, one JSON object a line in FILE.jsonl or a folder of them, as TRL writes them:

    {"prompt": "text", "chosen": "text", "rejected": "text"}
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}

Each side is the row {"prompt": prompt, "completion": chosen (or rejected)} of chat data
(`dpjax.data.chat`), rendered with the model's chat template (string rows: the text as it
is and the eos token after the answer) and masked as its completion: the answer tokens
are what follows the prompt's rendering for generation (TRL's split), the end-of-turn
tokens included. A pair longer than --seq-len + 1 tokens on either side is cut as
--truncate says (`chat.fit`), or dropped; a pair whose answer was cut away on a side is
dropped (counted). A pair whose chosen and rejected are the same tokens teaches nothing
and is refused, naming its row; so is a row without the three keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dpjax.data import DataError
from dpjax.data.chat import Example, fit, rows
from dpjax.data.sft import EpochOrder

KEYS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    chosen: Example
    rejected: Example
    where: str = ""


@dataclass
class Counts:
    """What reading a preference set did, for the run record."""

    rows: int = 0
    pairs: int = 0
    truncated: int = 0
    dropped: int = 0  # too long under --truncate drop, or an answer cut away
    files: list[str] = field(default_factory=list)


def encode(row: dict, fmt, where: str = "a row") -> Pair:
    """A row as its two examples (ids and answer masks, untruncated)."""
    missing = [k for k in KEYS if k not in row]
    if missing:
        raise DataError(f"{where}: a preference row has \"prompt\", \"chosen\" and \"rejected\"; "
                        f"{', '.join(repr(k) for k in missing)} missing (got {sorted(row)})")
    chosen, rejected = (fmt.encode({"prompt": row["prompt"], "completion": row[k]}, where, "completion")
                        for k in ("chosen", "rejected"))
    if np.array_equal(chosen.tokens, rejected.tokens) and np.array_equal(chosen.loss_mask, rejected.loss_mask):
        raise DataError(f"{where}: chosen and rejected are the same answer: the pair prefers nothing; fix or "
                        "remove the row")
    for name, ex in (("chosen", chosen), ("rejected", rejected)):
        if not ex.loss_mask[1:].any():
            raise DataError(f"{where}: the {name} answer renders to no token after the prompt")
    return Pair(chosen, rejected, where)


def load(path: str, fmt, seq_len: int, truncate: str = "right") -> tuple[list[Pair], Counts]:
    """Every row of `path` as a Pair of at most seq_len + 1 tokens a side, and the counts."""
    out, counts = [], Counts(files=[path])
    for where, row in rows(path):
        counts.rows += 1
        pair = encode(row, fmt, where)
        cut = [fit(ex, seq_len, truncate) for ex in (pair.chosen, pair.rejected)]
        if any(c is None or not c.loss_mask[1:].any() for c in cut):
            counts.dropped += 1
            continue
        counts.truncated += any(len(c.tokens) < len(ex.tokens) for c, ex in zip(cut, (pair.chosen, pair.rejected)))
        out.append(Pair(cut[0], cut[1], where))
    counts.pairs = len(out)
    if not out:
        raise DataError(f"preference data {path!r}: no pair fits --seq-len {seq_len} + 1 tokens with its answers "
                        f"({counts.rows} rows, {counts.dropped} dropped); raise --seq-len")
    return out, counts


class PairStream:
    """`dpjax.tasks.dpo`'s batches: pairs in a seeded order, epoch after epoch, as the other
    streams read their windows; `ref` the reference's log-probs of each pair once they are
    set (`set_reference`; zeros until then, and for a variant without a reference).

        batch(cursor, n, rows) -> {"tokens", "rejected": n x T+1 int32, "masks": n x 2 x T f32,
                                   "ref": n x 2 f32}
        ordered(start, n, rows): the same, of pairs start .. start+n-1 in file order (wrapping)
    """

    def __init__(self, pairs: list[Pair], seq_len: int, seed: int = 0, pad_id: int = 0):
        if not pairs:
            raise DataError("no pairs to train on")
        self.seq_len, self.seed, self.num_examples = seq_len, seed, len(pairs)
        T1 = seq_len + 1
        self.tokens_Nx2xT1 = np.full((len(pairs), 2, T1), pad_id, np.int32)
        self.masks_Nx2xT1 = np.zeros((len(pairs), 2, T1), bool)
        for i, pair in enumerate(pairs):
            for side, ex in enumerate((pair.chosen, pair.rejected)):
                self.tokens_Nx2xT1[i, side, :len(ex.tokens)] = ex.tokens
                self.masks_Nx2xT1[i, side, :len(ex.tokens)] = ex.loss_mask
        self.masks_Nx2xT1[:, :, 0] = False  # nothing predicts the first token
        self.ref_Nx2 = np.zeros((len(pairs), 2), np.float32)
        self._ids = EpochOrder(len(pairs), seed)  # the examples' seeded order, as the sft stream reads them

    def set_reference(self, ref_Nx2) -> None:
        ref_Nx2 = np.asarray(ref_Nx2, np.float32)
        assert ref_Nx2.shape == self.ref_Nx2.shape, (ref_Nx2.shape, self.ref_Nx2.shape)
        self.ref_Nx2 = ref_Nx2

    def _rows(self, ids: np.ndarray) -> dict:
        tokens = self.tokens_Nx2xT1[ids]
        return {"tokens": tokens[:, 0], "rejected": tokens[:, 1],
                "masks": self.masks_Nx2xT1[ids, :, 1:].astype(np.float32), "ref": self.ref_Nx2[ids]}

    def batch(self, cursor: int, batch_size: int, rows: slice = slice(None)) -> dict:
        """Rows `rows` of the global batch of pairs that starts at `cursor`."""
        return self._rows(self._ids(np.arange(cursor, cursor + batch_size, dtype=np.int64)[rows]))

    def ordered(self, start: int, batch_size: int, rows: slice = slice(None)) -> dict:
        """Rows `rows` of pairs start .. start + batch_size - 1 in file order (past the end: from the start again)."""
        return self._rows(np.arange(start, start + batch_size, dtype=np.int64)[rows] % self.num_examples)
