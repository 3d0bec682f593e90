"""The tiers (tests/tiers.py): which tests the README's command leaves to CI, and the guard that
keeps a renamed test from moving between tiers unnoticed."""

from __future__ import annotations

import pathlib

import tiers

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_a_pattern_or_id_naming_no_test_of_a_collected_file_is_stale(monkeypatch):
    monkeypatch.setattr(tiers, "PATTERNS", [("tests/test_a.py::test_sweep[*-n2-*", "why")])
    monkeypatch.setattr(tiers, "MEASURED", {"tests/test_a.py::test_heavy": 9.0, "tests/test_b.py::test_x": 4.0})
    here = ["tests/test_a.py::test_sweep[ring-n2-N8]", "tests/test_a.py::test_heavy"]
    assert tiers.stale(here) == []
    renamed = ["tests/test_a.py::test_sweep[ring-n3-N8]", "tests/test_a.py::test_heavier"]
    assert tiers.stale(renamed) == ["tests/test_a.py::test_sweep[*-n2-*", "tests/test_a.py::test_heavy"]
    # test_b.py was not collected (a run of one file): its id is not judged
    assert "tests/test_b.py::test_x" not in tiers.stale(renamed)
    monkeypatch.setattr(tiers, "QUICK", {"tests/test_a.py::test_cheap": 0.1})
    assert tiers.stale(here) == ["tests/test_a.py::test_cheap"]


def test_a_cheap_test_of_a_whole_file_pattern_comes_back_to_quick(monkeypatch):
    heavy, cheap = "tests/test_train.py::test_heavy", "tests/test_train.py::test_refusal"
    monkeypatch.setattr(tiers, "QUICK", {cheap: 0.1})
    assert tiers.extended(heavy) and tiers.extended(cheap) is None


def test_extended_says_why_and_quick_is_none(monkeypatch):
    monkeypatch.setattr(tiers, "MEASURED", {"tests/test_a.py::test_heavy[x]": 9.0})
    assert tiers.extended("tests/test_a.py::test_heavy[x]") == "9.0 CPU-s"
    # a bracket in an id is not a character class: ids are compared, not matched
    assert tiers.extended("tests/test_a.py::test_heavy[y]") is None
    assert tiers.extended("tests/test_collectives.py::test_allreduce[ring-data5-over-data-f32-scalar]")
    assert tiers.extended("tests/test_collectives.py::test_allreduce[ring-data6-over-data-f32-scalar]") is None
    # the hierarchical node2_data4 mesh stays quick though it contains "data4-over"
    assert tiers.extended("tests/test_ops.py::test_every_op_and_dtype[allreduce-hierarchical-node2_data4-over-node"
                          "+data]") is None


def test_the_readme_runs_the_quick_tier_and_ci_both():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci/run").read_text()
    assert 'python -m pytest -q -m "not slow and not extended" -n 2 --dist loadfile' in readme
    assert '-m "not slow and not extended"' in ci and '-m "extended and not slow"' in ci
