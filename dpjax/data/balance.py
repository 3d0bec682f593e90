"""Steps of nearly equal tokens: the conversations of a group of steps dealt among them (`--pack-window`).

A packed step holds its own `--batch-size` conversations (its loss is their answer-token mean) in a number
of rows fixed for the run (one compiled step): the most any step needs. Read in the seeded order, a step's
tokens vary widely (64 conversations of a chat set: from about 10 to 20 rows of 2,049), and every step pays
for the heaviest. Dealing evens them out: the conversations of W consecutive steps (W x window of them, in
the seeded order) are taken longest first and each given to the step of the group that holds the fewest
tokens so far among those not yet full (greedy LPT scheduling with a count per machine, Graham 1969), so
every step still reads exactly `window` conversations, each conversation is read once in its group, and the
group's steps end within a few buckets' tokens of each other (100-200 of about 7,000 for 16 chat-like
conversations a step). Over an epoch's steps (the default) every step is that close to the set's mean, and
its rows are what the mean needs.

The lengths are sorted in buckets of `BUCKET` tokens, shuffled within a bucket by the seed: sorted exactly,
the same long conversations would share a step in every epoch (their ranks pair them); in buckets the
pairs repeat between epochs no more often than in a plain shuffle, and the totals stay as even (the
short conversations dealt last level them). The steps' ties are broken in a seeded order too.
"""

from __future__ import annotations

import heapq

import numpy as np

BUCKET = 64  # tokens: the sort's resolution (see the docstring)


def deal(lengths, steps: int, per_step: int, rng: np.random.Generator) -> np.ndarray:
    """`steps` x `per_step` indices into `lengths` (steps * per_step of them): step s reads row s, and
    the rows' length sums are nearly equal (the module's docstring)."""
    lengths = np.asarray(lengths, np.int64)
    assert lengths.shape == (steps * per_step,), (lengths.shape, steps, per_step)
    order = np.lexsort((rng.permutation(lengths.size), -(lengths // BUCKET)))  # longest bucket first
    heap = [(0, int(t), s) for s, t in enumerate(rng.permutation(steps))]  # (tokens, tie-break, step)
    heapq.heapify(heap)
    out = np.empty((steps, per_step), np.int64)
    filled = [0] * steps
    for i in order:
        tokens, tie, s = heapq.heappop(heap)
        out[s, filled[s]] = i
        filled[s] += 1
        if filled[s] < per_step:
            heapq.heappush(heap, (tokens + int(lengths[i]), tie, s))
    return out


class BalancedOrder:
    """The example read at each stream position, as `order` (an `dpjax.data.sft.EpochOrder`) reads them,
    but with each group of `steps` windows' positions (positions g W w .. (g+1) W w - 1, w the window)
    dealt among the group's windows by `deal`. A position's example depends only on the seed, the
    lengths and its group: the same in every process and on every resume. Called on an array of
    positions; the newest group's dealing is kept."""

    def __init__(self, order, lengths, window: int, steps: int, seed: int):
        self.order, self.window, self.steps, self.seed = order, window, steps, seed
        self.lengths = np.asarray(lengths, np.int64)
        self._group: tuple[int, np.ndarray] | None = None  # (group, its example ids in position order)

    def _ids(self, group: int) -> np.ndarray:
        if self._group is None or self._group[0] != group:
            size = self.steps * self.window
            ids = self.order(np.arange(group * size, (group + 1) * size, dtype=np.int64))
            dealt = deal(self.lengths[ids], self.steps, self.window, np.random.default_rng((self.seed, group, 1)))
            self._group = (group, ids[dealt.reshape(-1)])
        return self._group[1]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        size = self.steps * self.window
        groups = positions // size
        out = np.empty_like(positions)
        for group in np.unique(groups):
            sel = groups == group
            out[sel] = self._ids(int(group))[positions[sel] % size]
        return out
