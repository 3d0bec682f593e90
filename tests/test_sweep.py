"""The crash sweep (experiments/sweep.py): its rows cover every pair of option values, and
(slow) every row, run as a real `python -m dpjax.train` process, ends in exit 0 or a
one-line refusal: never a signal, never a traceback."""

from __future__ import annotations

import itertools
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import sweep  # noqa: E402


@pytest.mark.parametrize("design", list(sweep.DESIGNS))
def test_the_rows_cover_every_pair_of_values(design):
    factors = sweep.DESIGNS[design]
    rows = sweep.pairwise(factors)
    for a, b in itertools.combinations(factors, 2):
        assert {(r[a], r[b]) for r in rows} == set(itertools.product(factors[a], factors[b])), (a, b)
    # pairs, not the product: at least the two largest factors' product, at most 1.25 times it
    big = sorted(len(v) for v in factors.values())[-2:]
    assert math.prod(big) <= len(rows) <= 1.25 * math.prod(big) < math.prod(len(v) for v in factors.values()) / 100


def test_every_documented_mesh_axis_and_new_feature_is_a_factor():
    """The factors follow the README's options: each mesh axis and the newer features appear."""
    flags = " ".join(v for f in sweep.DESIGNS.values() for vs in f.values() for v in vs)
    for needle in ("context=", "expert=", "stage=", "--fsdp", "--dtype fp8", "--remat full", "onebit_adam",
                   "--commit-dir", "--ckpt-dir", "--compress-axes", "--compress-whole", "--update async",
                   "--backward-passes", "--tokenizer", "--sample-tokens", "--model llama", "--schedule interleaved"):
        assert needle in flags, needle


def test_a_refused_row_is_passed_over_where_others_cover_its_pairs():
    factors = {"a": ["x", "y"], "b": ["u", "v"], "c": ["p", "q"]}

    def covered(rows):
        return all({(r[m], r[n]) for r in rows} == set(itertools.product(factors[m], factors[n]))
                   for m, n in itertools.combinations(factors, 2))

    def triple(r):  # refuses one row of the plain cover; its pairs are in other rows that train
        return "refused" if (r["a"], r["b"], r["c"]) == ("x", "v", "q") else None

    assert any(triple(r) for r in sweep.pairwise(factors))
    rows = sweep.pairwise(factors, refuses=triple)
    assert covered(rows) and not any(triple(r) for r in rows)

    def pair(r):  # a pair dpjax always refuses: covered by one refused row, no more
        return "refused" if (r["a"], r["b"]) == ("y", "v") else None

    rows = sweep.pairwise(factors, refuses=pair)
    assert covered(rows) and sum(bool(pair(r)) for r in rows) == 1


def test_the_plan_refuses_what_the_process_refuses(tmp_path):
    """The planned cover's verdicts are dpjax.plan's: a row it refuses names the clash."""
    row = {"layout": "--mesh 8x1 --fsdp", "allreduce": "--allreduce tree"}
    assert "'tree' has none" in sweep.plan_refusal(row, str(tmp_path))
    assert sweep.plan_refusal({"layout": "--mesh 8x1 --fsdp", "allreduce": "--allreduce ring"}, str(tmp_path)) is None


def test_what_counts_as_ending_well():
    assert sweep.ends_well(0, ["devices: 8 x cpu"])
    assert sweep.ends_well(2, ["dpjax: --mesh: no axis 'modle'"])
    assert not sweep.ends_well(-6, [])  # SIGABRT
    assert not sweep.ends_well(1, ["Traceback (most recent call last):"])
    assert not sweep.ends_well(2, ["Traceback (most recent call last):", "ValueError: x"])
    assert not sweep.ends_well("timeout", [])


@pytest.mark.slow
def test_every_pair_of_options_ends_well_as_a_process(capsys):
    assert sweep.main(["--steps", "2", "--jobs", "2"]) == 0, capsys.readouterr().out


def test_pairs_seen_only_refused_are_named():
    factors = {"a": ["x", "y"], "b": ["u", "v"], "c": ["p"]}
    rows = sweep.pairwise(factors)
    exits = [2 if (r["a"], r["b"]) == ("y", "v") else 0 for r in rows]
    assert sweep.refused_only(rows, exits) == {("a", "y", "b", "v")}
