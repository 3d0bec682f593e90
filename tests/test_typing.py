"""The typed spine (issue 46): no field of `Plan`, `Parallel`, `Exchange` or `Settings` is
`Any` to mypy.

A field can turn Any without any error: mypy runs with ignore_missing_imports, so a type
from a module it cannot find (dpjax.models, which is the top-level models/ folder: mypy
finds it through pyproject's mypy_path, the link .mypy/dpjax/models) or from a package
without type information (optax: follow_untyped_imports) is Any in silence. mypy's
`reveal_type` of every field, read from the dataclasses themselves (a new field is
checked too), says what mypy sees; any Any in one fails the test.

The mypy run takes about a minute with a cold cache (.mypy_cache in the repository, which
`mypy` run there warms), hence extended.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest

from dpjax.compression.exchange import Exchange
from dpjax.compute.tensor_parallel import Parallel
from dpjax.plan.plan import Plan
from dpjax.settings import Settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPINE = {"plan": Plan, "par": Parallel, "exchange": Exchange, "settings": Settings}
REVEALED = re.compile(r":(\d+): note: Revealed type is \"(.*)\"$")


def test_mypy_finds_models_through_the_link():
    """The link mypy resolves dpjax.models through is models/ itself (no copy that could
    drift), and pyproject's [tool.mypy] looks there."""
    link = ROOT / ".mypy" / "dpjax" / "models"
    assert link.is_symlink() and link.resolve() == (ROOT / "models").resolve()
    assert 'mypy_path = "$MYPY_CONFIG_FILE_DIR/.mypy"' in (ROOT / "pyproject.toml").read_text()


def named_tuples_by_name(t: str) -> str:
    """mypy reveals a NamedTuple (optax's GradientTransformation, an UpdateRule) as its
    items' types with `fallback=` its class: the class is the field's type (what its
    items hold is the class's own business), so each such tuple is read as its name."""
    while (end := t.find(", fallback=")) >= 0:
        depth, start = 0, end
        while depth >= 0:  # back to the `tuple[` this fallback closes
            start -= 1
            depth += {"]": 1, "[": -1}.get(t[start], 0)
        close = t.index("]", end)
        t = t[:start - len("tuple")] + t[end + len(", fallback="):close] + t[close + 1:]
    return t


def snippet() -> tuple[str, list[str]]:
    """A module revealing each spine field's type, and the field each line reveals."""
    lines = ["from dpjax.compression.exchange import Exchange", "from dpjax.compute.tensor_parallel import Parallel",
             "from dpjax.plan.plan import Plan", "from dpjax.settings import Settings", "",
             "def fields(" + ", ".join(f"{v}: {c.__name__}" for v, c in SPINE.items()) + ") -> None:"]
    names = []
    for var, cls in SPINE.items():
        for f in dataclasses.fields(cls):
            lines.append(f"    reveal_type({var}.{f.name})")
            names.append(f"{cls.__name__}.{f.name}")
    return "\n".join(lines) + "\n", names


@pytest.mark.extended
def test_no_spine_field_is_any(tmp_path):
    text, names = snippet()
    path = tmp_path / "spine_fields.py"
    path.write_text(text)
    first = text.splitlines().index(f"    reveal_type(plan.{dataclasses.fields(Plan)[0].name})") + 1
    # in the repository's root with its config, as `mypy` runs there (the root is where dpjax is found)
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), str(path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    revealed = {int(m[1]): m[2] for m in map(REVEALED.search, out.stdout.splitlines()) if m}
    assert sorted(revealed) == list(range(first, first + len(names))), out.stdout
    types = dict(zip(names, (revealed[i] for i in sorted(revealed))))
    anys = {name: t for name, t in types.items() if re.search(r"\bAny\b", named_tuples_by_name(t))}
    assert not anys, f"fields mypy sees as Any: {anys}"
    # the three that were Any before mypy found dpjax.models and read optax
    assert types["Plan.model"] == "dpjax.models.base.Decoder | None"
    assert types["Plan.split"] == "dpjax.models.lora.Split | None"
    assert "optax._src.base.GradientTransformation" in types["Plan.optimizer"]
