"""Examples for supervised fine-tuning (`--task sft`): each example's token ids and which
of them count in the loss (an answer's), as the rows of `dpjax.tasks.sft`'s batch.

    ExampleStream(examples, seq_len, seed, window).batch(cursor, n, rows)
        -> {"tokens": n x seq_len+1 int32, "weights": n x seq_len float32}

An example is (ids, mask): `mask[i]` says whether token i is one the model is trained to
produce. A row holds one example from its start, padded with `pad_id` (weight 0). Examples
are read in a seeded order, epoch after epoch, as the other streams read their windows.

The weights make the step's mean the mean over answer tokens of the whole step
(`dpjax.tasks.sft`): the `window` examples a step reads (--batch-size x the micro-batches;
an evaluation batch's --batch-size) hold n answer targets in N = window x seq_len slots,
and each answer target's weight is N / n. Every step starts its window at a multiple of
`window` (the trainer's cursor moves by that much a step), so the normaliser is the same
whichever rows a process reads and however the rows are split.
"""

from __future__ import annotations

import numpy as np

from dpjax.data import DataError


class ExampleStream:
    def __init__(self, examples, seq_len: int, seed: int = 0, window: int = 1, pad_id: int = 0):
        if not examples:
            raise DataError("no examples to train on")
        self.seq_len, self.seed, self.window, self.pad_id = seq_len, seed, window, pad_id
        n, T1 = len(examples), seq_len + 1
        self.tokens_NxT1 = np.full((n, T1), pad_id, np.int32)
        self.counts_NxT1 = np.zeros((n, T1), bool)  # which tokens are answer targets (position 0 never is)
        for i, (ids, mask) in enumerate(examples):
            ids, mask = np.asarray(ids, np.int32), np.asarray(mask, bool)
            if ids.shape != mask.shape or ids.ndim != 1:
                raise DataError(f"example {i}: {ids.shape[0]} ids but a mask of shape {mask.shape}")
            if ids.size > T1:
                raise DataError(f"example {i} has {ids.size} tokens, more than --seq-len {seq_len} + 1")
            self.tokens_NxT1[i, :ids.size], self.counts_NxT1[i, :ids.size] = ids, mask
        self.counts_NxT1[:, 0] = False  # nothing predicts the first token
        self.num_examples = n
        self._orders: dict[int, np.ndarray] = {}
        self._scale: tuple[int, float] | None = None  # (window start, its N / n): one count a window, not a read

    def _example_ids(self, positions: np.ndarray) -> np.ndarray:
        epochs = positions // self.num_examples
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            if epoch not in self._orders:
                self._orders = {int(epoch): np.random.default_rng((self.seed, int(epoch))).permutation(
                    self.num_examples)}
            sel = epochs == epoch
            out[sel] = self._orders[int(epoch)][positions[sel] % self.num_examples]
        return out

    def scale(self, cursor: int) -> float:
        """N / n of the window holding `cursor` (0.0 when it holds no answer token)."""
        start = cursor - cursor % self.window
        if self._scale is None or self._scale[0] != start:  # put_batch reads a window's rows in several calls
            ids = self._example_ids(np.arange(start, start + self.window, dtype=np.int64))
            n = int(self.counts_NxT1[ids].sum())
            self._scale = (start, self.window * self.seq_len / n if n else 0.0)
        return self._scale[1]

    def batch(self, cursor: int, batch_size: int, rows: slice = slice(None)) -> dict:
        """Rows `rows` of the global batch that starts at example `cursor`."""
        ids = self._example_ids(np.arange(cursor, cursor + batch_size, dtype=np.int64)[rows])
        weights_BxT = self.counts_NxT1[ids, 1:].astype(np.float32) * np.float32(self.scale(cursor))
        return {"tokens": self.tokens_NxT1[ids], "weights": weights_BxT}
