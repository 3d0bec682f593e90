"""Packing: several examples in one row of seq_len + 1 tokens, each keeping its own positions and segment.

A row of a packed batch holds whole examples one after another, then padding:

    tokens       int32 [R, seq_len + 1]   the examples' ids, 0 where padding
    loss_mask    bool  [R, seq_len + 1]   which tokens count as targets (an example's own mask)
    segment_ids  int32 [R, seq_len + 1]   1, 2, ... for the row's examples in order, 0 for padding
    positions    int32 [R, seq_len + 1]   0, 1, ... restarting at each example (0 for padding)

`shift` turns that into what a step reads: inputs [:-1], targets [1:], and `weights`, a target's mask that
also drops a target whose input belongs to another example (the first token of every example is predicted from
nothing of its own). Attention must not cross segments: a query attends to keys of its own segment id only.

Which examples share a row is bin packing (rows are bins of seq_len + 1 slots). `first_fit` and `best_fit`
place the examples longest first (first-fit / best-fit decreasing, as MaxText's grain packing and the
literature on them: FFD uses at most 11/9 OPT + 6/9 bins, Dosa 2007); `none` gives each example its own row.
First-fit finds the first row with room with a max-tree over the rows' free slots (log R a placement),
best-fit the fullest row with room by bisection of a sorted list of free slots.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from dpjax.data import DataError


def first_fit(lengths, capacity: int) -> list[list[int]]:
    """First-fit decreasing: each example (longest first) into the first row with room for it."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    free = [0] * (2 * size)  # a max-tree: leaf size + r is row r's free slots (0 for a row not opened yet)
    rows: list[list[int]] = []
    for i in order:
        n = lengths[i]
        if free[1] >= n:  # some open row has room: walk down to the leftmost such
            node = 1
            while node < size:
                node = 2 * node if free[2 * node] >= n else 2 * node + 1
            r = node - size
        else:
            r = len(rows)
            rows.append([])
            node = size + r
            free[node] = capacity
        rows[r].append(i)
        free[node] -= n
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return rows


def best_fit(lengths, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each example (longest first) into the row it leaves the fewest free slots in."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free slots, row), sorted
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(room, (n, -1))
        if k < len(room):
            left, r = room.pop(k)
        else:
            left, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        if left - n:
            bisect.insort(room, (left - n, r))
    return rows


def one_per_row(lengths, capacity: int) -> list[list[int]]:
    """No packing: each example its own row, in order."""
    return [[i] for i in range(len(lengths))]


METHODS = {"first_fit": first_fit, "best_fit": best_fit, "none": one_per_row}


@dataclass(frozen=True)
class Packed:
    """Rows of examples (see the module's docstring), and which examples each row holds."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    rows: list[list[int]]

    @property
    def efficiency(self) -> float:
        """Real tokens / slots."""
        return float((self.segment_ids > 0).sum() / max(1, self.segment_ids.size))


def pack(examples, seq_len: int, method: str = "first_fit", pad_id: int = 0, num_rows: int | None = None) -> Packed:
    """`examples` (each with int32 `tokens` and a bool `loss_mask` of the same length, at most seq_len + 1
    tokens) in rows of seq_len + 1 tokens, placed by `method` (first_fit, best_fit or none). num_rows: that
    many rows, the ones past the packing all padding (a batch of a fixed shape: one compiled step)."""
    if method not in METHODS:
        raise DataError(f"packing {method!r}: one of {', '.join(METHODS)}")
    capacity = seq_len + 1
    lengths = [len(ex.tokens) for ex in examples]
    if not lengths:
        raise DataError("nothing to pack: no examples")
    too_long = sum(n > capacity for n in lengths)
    if too_long == len(lengths):
        raise DataError(f"--seq-len {seq_len} is shorter than every example (the shortest has {min(lengths)} tokens, "
                        f"a row {capacity}); raise --seq-len or truncate the examples")
    if too_long:
        raise DataError(f"{too_long} of {len(lengths)} examples are longer than a row of {capacity} tokens; "
                        "truncate or drop them first (dpjax.data.chat.fit)")
    rows = METHODS[method](lengths, capacity)
    if num_rows is not None and len(rows) > num_rows:
        raise ValueError(f"{len(lengths)} examples need {len(rows)} rows of {capacity} tokens, more than {num_rows}")
    shape = (len(rows) if num_rows is None else num_rows, capacity)
    tokens = np.full(shape, pad_id, np.int32)
    mask = np.zeros(shape, bool)
    segments = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    for r, members in enumerate(rows):
        at = 0
        for s, i in enumerate(members, 1):
            n = lengths[i]
            tokens[r, at:at + n] = examples[i].tokens
            mask[r, at:at + n] = examples[i].loss_mask
            segments[r, at:at + n] = s
            positions[r, at:at + n] = np.arange(n)
            at += n
    return Packed(tokens, mask, segments, positions, rows)


def shift(packed: Packed) -> dict[str, np.ndarray]:
    """What a step reads, [R, seq_len] each: inputs, targets, weights (a target counts: its token is an answer
    token and its input is of the same example), and the inputs' segment_ids and positions."""
    seg = packed.segment_ids
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    return {"inputs": packed.tokens[:, :-1], "targets": packed.tokens[:, 1:],
            "weights": packed.loss_mask[:, 1:] & same,
            "segment_ids": seg[:, :-1], "positions": packed.positions[:, :-1]}
