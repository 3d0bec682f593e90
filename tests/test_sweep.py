"""The crash sweep (experiments/sweep.py): its rows cover every pair of option values, and
(slow) every row, run as a real `python -m dpjax.train` process, ends in exit 0 or a
one-line refusal: never a signal, never a traceback."""

from __future__ import annotations

import itertools
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import sweep  # noqa: E402


def test_the_rows_cover_every_pair_of_values():
    rows = sweep.pairwise(sweep.FACTORS)
    for a, b in itertools.combinations(sweep.FACTORS, 2):
        assert {(r[a], r[b]) for r in rows} == set(itertools.product(sweep.FACTORS[a], sweep.FACTORS[b])), (a, b)
    assert len(rows) < 40  # pairs, not the product (5 * 5 * 4 * 2 * 2 * 2 * 2 = 1,600 rows)


def test_what_counts_as_ending_well():
    assert sweep.ends_well(0, ["devices: 8 x cpu"])
    assert sweep.ends_well(2, ["dpjax: --mesh: no axis 'modle'"])
    assert not sweep.ends_well(-6, [])  # SIGABRT
    assert not sweep.ends_well(1, ["Traceback (most recent call last):"])
    assert not sweep.ends_well(2, ["Traceback (most recent call last):", "ValueError: x"])
    assert not sweep.ends_well("timeout", [])


@pytest.mark.slow
def test_every_pair_of_options_ends_well_as_a_process(capsys):
    assert sweep.main(["--steps", "2"]) == 0, capsys.readouterr().out
