"""The table of `DPJAX_*` environment variables (dpjax/env.py): every name the source reads
(dpjax's, its models', tests/conftest.py's, the experiments') is in it, every entry is still
read somewhere, every name the docs use is in it, and docs/environment.md shows it as it is
(issue 46: 24 variables, 10 of them documented nowhere)."""

from __future__ import annotations

import pathlib
import re

import pytest

from dpjax import env
from dpjax.recovery.env import ENV as AGENT_ENV

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bDPJAX_[A-Z0-9_]+")
PAGE = ROOT / "docs" / "environment.md"
REGENERATE = "regenerate the table: python -c \"from dpjax import env; print(env.markdown(), end='')\""


def names_in(paths) -> dict[str, list[str]]:
    """DPJAX_* name -> the files whose source names it."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for name in set(NAME.findall(path.read_text())):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def source_files():
    """Where a variable is read: dpjax, its models, the suite's conftest.py and the
    experiments (their scripts and the processes they start; the other tests only set
    the variables these read)."""
    files = [*(ROOT / "dpjax").rglob("*.py"), *(ROOT / "models").rglob("*.py"), ROOT / "tests" / "conftest.py",
             *(ROOT / "experiments").rglob("*.py")]
    return [p for p in files if p != ROOT / "dpjax" / "env.py"]


def test_every_name_in_the_source_is_in_the_table():
    used = names_in(source_files())
    missing = {n: files for n, files in used.items() if n not in env.VARS}
    assert not missing, f"add these to dpjax/env.py's VARS (and regenerate docs/environment.md): {missing}"
    assert len(used) >= 27  # the scan still finds them (issue 46 counted 24 in dpjax)


def test_every_name_the_docs_use_is_in_the_table():
    """A page naming a variable the table does not have (a typo, one that was removed)."""
    used = names_in([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
    assert set(used) <= set(env.VARS), {n: files for n, files in used.items() if n not in env.VARS}


def test_every_entry_is_read_somewhere():
    """An entry nobody reads any more leaves the table (the suite's own variable is read by
    tests/conftest.py, the chaos run's tag by experiments/chaos.py)."""
    used = names_in(source_files())
    assert set(env.VARS) <= set(used), sorted(set(env.VARS) - set(used))
    assert set(AGENT_ENV.values()) <= set(env.VARS)  # what dpjax.agent passes to its processes


def test_every_entry_says_what_it_means_and_what_unset_means():
    for var in env.VARS.values():
        assert NAME.fullmatch(var.name) and var.unset and var.set_by, var
        assert len(var.meaning) > 20 and "|" not in var.meaning + var.unset + var.set_by, var


def test_the_docs_page_shows_the_table_as_it_is():
    text = PAGE.read_text()
    assert env.markdown() in text, REGENERATE
    rows = [line for line in text.splitlines() if line.startswith("| `DPJAX_")]
    assert [r.split("`")[1] for r in rows] == list(env.VARS), REGENERATE  # no row the table lost
    assert "environment.md" in (ROOT / "mkdocs.yml").read_text()


def test_value_reads_a_table_entry_and_refuses_an_unknown_name():
    assert env.value("DPJAX_CHECK", {"DPJAX_CHECK": "1"}) == "1"
    assert env.value("DPJAX_CHECK", {}) is None
    with pytest.raises(KeyError, match="DPJAX_CHEK is not in dpjax.env.VARS"):
        env.value("DPJAX_CHEK", {"DPJAX_CHEK": "1"})
