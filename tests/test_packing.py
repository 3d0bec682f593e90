"""dpjax.data.packing: first-fit and best-fit decreasing against plain quadratic versions of the same rules,
rows that give every example back whole with its own positions, weights that never cross an example, the
efficiency on lengths drawn like a chat set's, and the one-line error."""

import numpy as np
import pytest

from dpjax.data import packing
from dpjax.data.chat import Example
from dpjax.errors import UserError


def _naive(lengths, capacity, best):
    """The rule as textbooks state it: longest first, scan every open row (first with room, or fullest)."""
    rows, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [r for r in range(len(rows)) if free[r] >= lengths[i]]
        if not fits:
            rows.append([]), free.append(capacity)
            fits = [len(rows) - 1]
        r = min(fits, key=lambda r: (free[r], r)) if best else fits[0]
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


def _examples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [Example(rng.integers(1, 1000, n, dtype=np.int32), rng.random(n) < 0.5) for n in lengths]


@pytest.mark.parametrize("seed", range(3))
def test_placement_equals_the_naive_rule(seed):
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(1, 65, 300)]
    assert packing.first_fit(lengths, 65) == _naive(lengths, 65, best=False)
    assert packing.best_fit(lengths, 65) == _naive(lengths, 65, best=True)
    assert packing.first_fit(lengths, 65) != packing.best_fit(lengths, 65)  # the two rules differ on this data


@pytest.mark.parametrize("method", list(packing.METHODS))
def test_rows_hold_each_example_whole_with_its_own_positions(method):
    lengths = [17, 3, 9, 33, 1, 12, 5, 33, 20, 8]
    examples, seq_len = _examples(lengths), 32
    p = packing.pack(examples, seq_len, method)
    assert p.tokens.shape == (len(p.rows), seq_len + 1) and p.tokens.dtype == np.int32
    assert sorted(i for row in p.rows for i in row) == list(range(len(lengths)))
    step = packing.shift(p)
    for r, row in enumerate(p.rows):
        for s, i in enumerate(row, 1):
            at = p.segment_ids[r] == s
            np.testing.assert_array_equal(p.tokens[r][at], examples[i].tokens)
            np.testing.assert_array_equal(p.loss_mask[r][at], examples[i].loss_mask)
            np.testing.assert_array_equal(p.positions[r][at], np.arange(lengths[i]))
            # the example's targets are tokens 1.. of its own, predicted from its own inputs
            tgt = np.flatnonzero(at)[1:] - 1
            np.testing.assert_array_equal(step["targets"][r][tgt], examples[i].tokens[1:])
            np.testing.assert_array_equal(step["weights"][r][tgt], examples[i].loss_mask[1:])
            assert (step["segment_ids"][r][tgt] == s).all()
        assert (p.tokens[r][p.segment_ids[r] == 0] == 0).all()
    # nothing else counts: every weight is one of an example's own targets
    assert step["weights"].sum() == sum(int(ex.loss_mask[1:].sum()) for ex in examples)
    assert p.efficiency == sum(lengths) / p.tokens.size
    if method == "none":
        assert len(p.rows) == len(lengths)


def test_efficiency_on_chat_like_lengths():
    """Lengths log-normal like a chat set's (median 400 tokens, sigma 0.9: a tail past 2,048 cut to a row), rows of
    2,048 + 1 (3.5% of them cut): first-fit and best-fit decreasing both fill 99.94% of the slots, 1,094 rows,
    the volume bound (numpy seed 0); one example a row would fill 27%."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(np.rint(rng.lognormal(np.log(400), 0.9, 4000)).astype(int) + 2, 2049).tolist()
    for rule in (packing.first_fit, packing.best_fit):
        rows = rule(lengths, 2049)
        assert max(sum(lengths[i] for i in row) for row in rows) <= 2049
        efficiency = sum(lengths) / (len(rows) * 2049)
        assert efficiency >= 0.95, efficiency
        assert len(rows) <= int(np.ceil(sum(lengths) / 2049)) + 2  # within two rows of the volume bound
    unpacked = sum(lengths) / (len(lengths) * 2049)
    assert unpacked < 0.35  # what one example a row wastes on the same lengths


def test_too_short_a_row_is_one_line():
    with pytest.raises(UserError) as e:
        packing.pack(_examples([40, 50]), 32)
    assert "--seq-len 32 is shorter than every example" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError):
        packing.pack(_examples([40, 5]), 32)


def test_a_fixed_number_of_rows():
    """num_rows: a batch of one shape whatever its examples need (the rows past theirs all padding)."""
    examples = _examples([20, 20, 5])
    p = packing.pack(examples, 32, num_rows=4)
    assert p.tokens.shape == (4, 33) and len(p.rows) == 2
    assert (p.segment_ids[2:] == 0).all() and not p.loss_mask[2:].any()
    assert p.efficiency == 45 / (4 * 33)
    with pytest.raises(ValueError):
        packing.pack(examples, 32, num_rows=1)
