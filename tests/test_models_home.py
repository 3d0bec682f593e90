"""`models/` sits at the top of the repository (DESIGN.md's layout) and is imported as
`dpjax.models` three ways: from a regular install (pyproject's package-dir puts it inside
the wheel's dpjax/), from an editable install, and from a clone run without any install
(`python -m dpjax.train` in its root, PYTHONPATH unset). A clone has no dpjax/models/, and a
`dpjax/` folder on sys.path hides setuptools' package-dir mapping (on the H200 an editable
install could not find dpjax.models with the clone's root on sys.path: experiments/RESULTS.md,
2026-11-26), so dpjax/__init__.py maps the one name dpjax.models to the models/ beside it.

Each way runs in a fresh process without PYTHONPATH and reads `dpjax.__file__`,
`dpjax.models.__file__` and a model's module back against the files they must come from.
Without the finder the clone's test fails (this machine's editable install of /work/main
answers instead); without package-dir both installs fail. The editable install passes here
even without the finder (setuptools 65.5's own finder maps dpjax.models); with it, the
answer no longer depends on the setuptools version.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import site
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROBE = ("import dpjax, dpjax.models, dpjax.models.gpt as g; "
         "print(dpjax.__file__); print(dpjax.models.__file__); print(g.GPT.__module__)")


def bare_env() -> dict[str, str]:
    """The environment without PYTHONPATH (the clone must not need it) and without the
    8 simulated devices' flags (nothing here computes)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}


def run(args, cwd, python=sys.executable, timeout=300):
    out = subprocess.run([str(python), *args], cwd=cwd, env=bare_env(), capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def probe(cwd, python=sys.executable) -> tuple[pathlib.Path, pathlib.Path, str]:
    package, models, cls_module = run(["-c", PROBE], cwd, python).split()[-3:]
    return pathlib.Path(package).resolve(), pathlib.Path(models).resolve(), cls_module


def clone(tmp_path) -> pathlib.Path:
    """A copy of the repository's tracked files (what a clone holds), so that building or
    installing writes nothing into this checkout."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split("\0")
    dest = tmp_path / "clone"
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    return dest


def venv(tmp_path) -> pathlib.Path:
    """A virtual environment that sees this python's jax, flax and the rest (installing
    dpjax with --no-deps needs no network)."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(tmp_path / "venv")], check=True,
                   timeout=300)
    python = tmp_path / "venv" / "bin" / "python"
    # this interpreter's own site-packages too, when it is itself a venv (CI's): after the new venv's own
    purelib = run(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, python).strip()
    (pathlib.Path(purelib) / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def pip_install(python, *args):
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *args],
                   check=True, env=bare_env(), capture_output=True, timeout=600)


def test_a_clone_without_an_install_finds_the_top_level_models():
    """`python -m dpjax.train` in the clone's root, PYTHONPATH unset: the clone's dpjax/ is
    the package (the current folder comes first on sys.path) and its models/ is dpjax.models."""
    package, models, cls_module = probe(ROOT)
    assert package == ROOT / "dpjax" / "__init__.py"
    assert models == ROOT / "models" / "__init__.py"
    assert cls_module == "dpjax.models.gpt"
    assert "--model" in run(["-m", "dpjax.train", "--help"], ROOT)


@pytest.mark.slow
def test_a_regular_install_holds_models_inside_its_package(tmp_path):
    src = clone(tmp_path)
    python = venv(tmp_path)
    pip_install(python, str(src))
    away = tmp_path / "elsewhere"
    away.mkdir()
    package, models, cls_module = probe(away, python)
    site = pathlib.Path(run(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], away, python)
                        .strip()).resolve()
    assert package == site / "dpjax" / "__init__.py"
    assert models == site / "dpjax" / "models" / "__init__.py"
    assert (models.parent / "gpt.py").read_text() == (ROOT / "models" / "gpt.py").read_text()
    assert cls_module == "dpjax.models.gpt"


@pytest.mark.slow
def test_an_editable_install_finds_models_from_anywhere_and_from_the_clone(tmp_path):
    """The editable install from another folder, and with the clone's root on sys.path
    (the case that failed on the H200: a dpjax/ folder on sys.path hid the mapping)."""
    src = clone(tmp_path)
    python = venv(tmp_path)
    pip_install(python, "-e", str(src))
    away = tmp_path / "elsewhere"
    away.mkdir()
    for cwd in (away, src):
        package, models, cls_module = probe(cwd, python)
        assert package == src / "dpjax" / "__init__.py", cwd
        assert models == src / "models" / "__init__.py", cwd
        assert cls_module == "dpjax.models.gpt"


def test_pyproject_lists_every_package():
    """setuptools installs the packages pyproject names and no others: a package folder left
    off its list is missing from a regular install (dpjax.step when it became a package)."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "dpjax").rglob("__init__.py")}
    found |= {".".join(("dpjax",) + p.parent.relative_to(ROOT).parts) for p in (ROOT / "models").rglob("__init__.py")}
    assert listed == found, (sorted(found - listed), sorted(listed - found))
