"""Examples for supervised fine-tuning (`--task sft`): each example's token ids and which
of them count in the loss (an answer's), as the rows of `dpjax.tasks.sft`'s batch.

    ExampleStream(examples, seq_len, seed, window).batch(cursor, n, rows)
        -> {"tokens": n x seq_len+1 int32, "weights": n x seq_len float32}

An example is (ids, mask): `mask[i]` says whether token i is one the model is trained to
produce. A row holds one example from its start, padded with `pad_id` (weight 0). Examples
are read in a seeded order, epoch after epoch, as the other streams read their windows;
with `deal_steps` W > 1 (--pack-window) the examples of each W steps are dealt among them
so that the steps hold nearly equal tokens (`dpjax.data.balance`). `PackedStream` (--pack)
places a window's examples several to a row instead.

The weights make the step's mean the mean over answer tokens of the whole step
(`dpjax.tasks.sft`): the `window` examples a step reads (--batch-size x the micro-batches;
an evaluation batch's --batch-size) hold n answer targets in N = window x seq_len slots
(packed: the window's rows x seq_len), and each answer target's weight is N / n. Every
step starts its window at a multiple of `window` (the trainer's cursor moves by that much
a step), so the normaliser is the same whichever rows a process reads and however the rows are split.
"""

from __future__ import annotations

import math

import numpy as np

from dpjax.data import DataError
from dpjax.data.balance import BalancedOrder
from dpjax.data.packing import METHODS, Packed, pack, shift


class EpochOrder:
    """The example read at each stream position: epoch e (positions e*n .. (e+1)*n - 1)
    reads the n examples in a permutation seeded by (seed, e), the same in every process
    and on every resume. Called on an array of positions; the newest epoch's order is kept."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._orders: dict[int, np.ndarray] = {}

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        epochs = positions // self.n
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            if epoch not in self._orders:
                self._orders = {int(epoch): np.random.default_rng((self.seed, int(epoch))).permutation(self.n)}
            sel = epochs == epoch
            out[sel] = self._orders[int(epoch)][positions[sel] % self.n]
        return out


class ExampleStream:
    def __init__(self, examples, seq_len: int, seed: int = 0, window: int = 1, pad_id: int = 0,
                 deal_steps: int | None = 1):
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
        self.window_rows = window  # the rows a window fills (the N / n's N is window_rows x seq_len)
        self.lengths_N = np.array([len(ids) for ids, _ in examples], np.int64)
        # deal_steps W > 1: each group of W steps' conversations dealt among them (dpjax.data.balance);
        # None: an epoch's steps (the set's whole windows)
        self.deal_steps = max(1, n // window) if deal_steps is None else deal_steps
        self._example_ids = EpochOrder(n, seed)
        if self.deal_steps > 1:
            self._example_ids = BalancedOrder(self._example_ids, self.lengths_N, window, self.deal_steps, seed)
        self._scale: tuple[int, float] | None = None  # (window start, its N / n): one count a window, not a read

    def scale(self, cursor: int) -> float:
        """N / n of the window holding `cursor` (0.0 when it holds no answer token)."""
        start = cursor - cursor % self.window
        if self._scale is None or self._scale[0] != start:  # put_batch reads a window's rows in several calls
            ids = self._example_ids(np.arange(start, start + self.window, dtype=np.int64))
            n = int(self.counts_NxT1[ids].sum())
            self._scale = (start, self.window_rows * self.seq_len / n if n else 0.0)
        return self._scale[1]

    def batch(self, cursor: int, batch_size: int, rows: slice = slice(None)) -> dict:
        """Rows `rows` of the global batch that starts at example `cursor`."""
        ids = self._example_ids(np.arange(cursor, cursor + batch_size, dtype=np.int64)[rows])
        weights_BxT = self.counts_NxT1[ids, 1:].astype(np.float32) * np.float32(self.scale(cursor))
        return {"tokens": self.tokens_NxT1[ids], "weights": weights_BxT}


class _Example:
    def __init__(self, tokens, loss_mask):
        self.tokens, self.loss_mask = tokens, loss_mask


class PackedStream(ExampleStream):
    """The examples of each window (one step's: `batch_size` x passes of them, in the
    seeded order) packed several to a row (`dpjax.data.packing`: first_fit or best_fit
    decreasing), each row of seq_len + 1 tokens:

        batch(cursor, batch_size, rows) -> {"tokens": R x seq_len+1, "weights": R x seq_len,
                                            "segment_ids": R x seq_len, "positions": R x seq_len}

    for the micro-batch starting at example `cursor`: micro-batch k of a window holds rows
    k R .. (k+1) R - 1 of the window's packing. A step reads exactly the examples it reads
    unpacked (an ExampleStream of the same deal_steps), so its answer-token mean is the same
    (`dpjax.tasks.sft`).

    R is fixed for the run so that the step compiles once: the seeded order is known, so
    the constructor packs every window of the run's `steps` steps (the examples' lengths
    only: a bin packing each, about a millisecond for a window of hundreds), takes the most
    rows any window needs, divides them over the passes and rounds up to a multiple of
    `multiple` (the data axes' devices, which split the rows); a window needing fewer gets
    rows of padding (segment 0, weight 0). A resumed run of the same --steps gets the same
    R. With `deal_steps` (--pack-window: an epoch's steps by default on the command line) the
    windows hold nearly equal tokens, so that the heaviest sets R no higher than the mean
    needs. Packing a whole window rather than each micro-batch alone fills the rows better
    (more examples to choose from) and changes nothing in the step's loss, a sum over the
    window. `efficiency` is the run's real tokens / the slots it computes; `unpacked_efficiency`
    what one example a row would fill."""

    def __init__(self, examples, seq_len: int, seed: int = 0, window: int = 1, pad_id: int = 0,
                 deal_steps: int | None = 1, *, batch_size: int, method: str = "first_fit", steps: int = 1,
                 multiple: int = 1):
        super().__init__(examples, seq_len, seed, window, pad_id, deal_steps)
        if method not in METHODS:
            raise DataError(f"packing {method!r}: one of {', '.join(METHODS)}")
        if window % batch_size:
            raise DataError(f"a window of {window} examples is not whole micro-batches of {batch_size}")
        self.batch_size, self.method, self.passes = batch_size, method, window // batch_size
        capacity, most, real = seq_len + 1, 0, 0
        for w in range(steps):
            lengths = self.lengths_N[self._example_ids(np.arange(w * window, (w + 1) * window, dtype=np.int64))]
            most = max(most, len(METHODS[method](lengths.tolist(), capacity)))
            real += int(lengths.sum())
        self.rows = math.ceil(math.ceil(most / self.passes) / multiple) * multiple  # R, a micro-batch's rows
        self.window_rows = self.passes * self.rows
        self.efficiency = real / (steps * self.window_rows * capacity)
        self.unpacked_efficiency = real / (steps * window * capacity)
        self.rows_of_tokens = real / (steps * self.passes * capacity)  # a micro-batch's tokens in rows, mean
        self._packed: tuple[int, Packed] | None = None  # (window start, its packing): put_batch reads it in pieces

    def _window(self, start: int) -> dict:
        if self._packed is None or self._packed[0] != start:
            ids = self._example_ids(np.arange(start, start + self.window, dtype=np.int64))
            examples = [_Example(self.tokens_NxT1[i, :self.lengths_N[i]], self.counts_NxT1[i, :self.lengths_N[i]])
                        for i in ids]
            packed = pack(examples, self.seq_len, self.method, self.pad_id, num_rows=self.window_rows)
            self._packed = (start, {"tokens": packed.tokens, **shift(packed)})
        return self._packed[1]

    def batch(self, cursor: int, batch_size: int, rows: slice = slice(None)) -> dict:
        """Rows `rows` of the R rows of the micro-batch that starts at example `cursor`."""
        assert batch_size == self.batch_size, (batch_size, self.batch_size)
        start = cursor - cursor % self.window
        k = (cursor - start) // batch_size
        w = self._window(start)
        mine = np.arange(k * self.rows, (k + 1) * self.rows)[rows]
        return {"tokens": w["tokens"][mine],
                "weights": w["weights"][mine].astype(np.float32) * np.float32(self.scale(cursor)),
                "segment_ids": w["segment_ids"][mine], "positions": w["positions"][mine]}

    def describe(self) -> dict:
        """What the run record keeps of the packing."""
        return {"method": self.method, "rows_per_batch": self.rows, "conversations_per_batch": self.batch_size,
                "window_steps": self.deal_steps, "rows_of_tokens": round(self.rows_of_tokens, 2),
                "efficiency": round(self.efficiency, 4), "unpacked_efficiency": round(self.unpacked_efficiency, 4)}
