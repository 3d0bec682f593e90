"""`python -m dpjax.X` for a module X that is also imported as a library (dpjax.data.chat, prepare, launch,
dpjax.agent.spare): runpy imports X's parent packages first, and when they have already imported X it warns on
every run ("RuntimeWarning: 'dpjax.data.chat' found in sys.modules after import of package 'dpjax.data', but
prior to execution of 'dpjax.data.chat'") and runs a second copy of the module. So no parent package may import
such a module; one fresh process (its own sys.modules) checks every one of them."""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def entry_modules() -> list[str]:
    """The dpjax modules, other than a package's __main__.py, that run as `python -m` (a __main__ guard)."""
    out = []
    for path in sorted((ROOT / "dpjax").rglob("*.py")):
        if path.name != "__main__.py" and 'if __name__ == "__main__":' in path.read_text():
            out.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return out


def test_no_package_imports_a_module_that_runs_as_main():
    mods = entry_modules()
    assert "dpjax.data.chat" in mods  # the one the fine-tune docs run (`python -m dpjax.data.chat`)
    parents = sorted({m.rsplit(".", 1)[0] for m in mods})
    code = ("import importlib, sys\n"
            f"for p in {parents!r}: importlib.import_module(p)\n"
            f"print([m for m in {mods!r} if m in sys.modules])")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"imported by their packages (runpy warns on python -m): {out.stdout}"


def parsers(main, monkeypatch) -> list[argparse.ArgumentParser]:
    """The parser `main` builds and its sub-commands' (argparse's _subparsers choices), caught at parse_args."""
    caught = []

    def catch(self, *args, **kw):
        caught.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(SystemExit):
        main([])
    out = []
    for p in caught:
        out.append(p)
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                out.extend(a.choices.values())
    return out


@pytest.mark.parametrize("module", ["dpjax.generate.__main__", "dpjax.hf.__main__", "dpjax.data.prepare",
                                    "dpjax.data.chat"])
def test_every_argument_is_explained_in_help(module, monkeypatch):
    """A newcomer reads --help: each argument (a positional too) says what it takes."""
    main = importlib.import_module(module).main
    bare = [f"{p.prog}: {a.dest}" for p in parsers(main, monkeypatch) for a in p._actions
            if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert bare == []
