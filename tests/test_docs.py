"""Every code block and local link of README.md and docs/*.md (see tests/docs_blocks.py for
how each kind of block is checked): python blocks run, quoted lines found in the examples
the tests run, signatures equal to Python's, shell commands parsed or planned
(`--dry-run`, in this process, milliseconds each), links resolved."""

import argparse
import contextlib
import importlib
import inspect
import os
import re
import tomllib
import warnings

import pytest

import dpjax
from docs_blocks import PAGES, ROOT, all_blocks, anchors, commands, links, unquoted

BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if b.lang == "python" and b.mark is None]
QUOTES = [b for b in BLOCKS if b.mark and b.mark[0] == "quote"]
SIGNATURES = [b for b in BLOCKS if b.mark and b.mark[0] == "signature"]
COMMANDS = [c for b in BLOCKS if b.lang in ("bash", "") for c in commands(b)]
RUN_PAGES = sorted({b.page for b in RUN})


def test_every_block_is_of_a_kind_the_tests_check():
    kinds = {"python", "bash", ""}
    odd = [b.id for b in BLOCKS if b.lang not in kinds or (b.mark and b.mark[0] not in ("quote", "signature"))]
    assert not odd, f"blocks no test checks: {odd}"
    assert len(RUN) >= 5 and len(QUOTES) >= 8 and len(COMMANDS) >= 40  # the mechanism still finds them


def test_no_link_leaves_the_clone():
    bad = [(p.name, t) for p in PAGES for _, t in links(p) if t.startswith("..") and "docs" not in t]
    assert not bad
    assert not [p.name for p in PAGES if "../shared" in p.read_text()]


def test_the_readme_is_a_front_page():
    """What it is, the two commands, a tour and links (issue 39: at most ~250 lines); the rest is in docs/."""
    assert len((ROOT / "README.md").read_text().split("\n")) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_named_exist(page):
    """Every file or folder of the clone a page names in backticks (`dpjax/step.py`) is there: a module that
    moves takes its mentions along."""
    named = re.findall(r"`((?:dpjax|models|experiments|examples|tests|docs|\.ci)/[\w/.\-]*)`", page.read_text())
    assert not [path for path in named if not (ROOT / path).exists()]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_resolve(page):
    """Every link to a file of the clone names one that exists, and its #anchor a heading there."""
    broken = []
    for text, target in links(page):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


SLOW_PAGES = {"parallelism.md"}  # compiles a GPT's init and train step: ~8 CPU-seconds


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_PAGES else p
                                  for p in RUN_PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page, tmp_path, monkeypatch):
    """The page's python blocks, in order, as one script (8 simulated CPU devices), in an
    empty folder (a block may write files)."""
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": f"docs_{page.stem}"}
    for block in [b for b in RUN if b.page == page]:
        exec(compile(block.code, block.id, "exec"), scope)


@pytest.mark.parametrize("block", QUOTES, ids=lambda b: b.id)
def test_quoted_lines_are_in_their_file(block):
    assert (ROOT / block.mark[1]).exists(), block.mark[1]
    assert not unquoted(block), f"{block.id}: not in {block.mark[1]}: {unquoted(block)}"


@pytest.mark.parametrize("block", SIGNATURES, ids=lambda b: b.id)
def test_signatures_are_pythons(block):
    module, _, name = block.mark[1].rpartition(".")
    fn = getattr(importlib.import_module(module), name)
    shown = re.sub(r"\s+", " ", block.code).strip()
    shown = re.sub(r"\(\s+", "(", shown)
    real = f"{block.mark[1]}{inspect.signature(fn)}".replace("PartitionSpec()", "P()")
    assert shown == real


class _Parsed(Exception):
    pass


@contextlib.contextmanager
def _parse_only():
    """argparse parses as usual and then stops the command (nothing runs)."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, *a, **k):
        original(self, *a, **k)
        raise _Parsed
    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def _module_main(name):
    for mod in (f"{name}.cli", f"{name}.__main__", name):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError:
            continue
        if hasattr(m, "main"):
            return m.main
    raise AssertionError(f"python -m {name}: no such dpjax command")


def _vars(words, tmp):
    """The shell variables the blocks use: a model folder, scratch space, hosts."""
    values = {"M": str(ROOT / "tests/fixtures/llama_tiny"), "MIXTRAL": str(ROOT / "tests/fixtures/mixtral_tiny"),
              "SCRATCH": str(tmp), "HOME": str(tmp), "head": "host1",
              "SLURM_JOB_NODELIST": "host1"}
    return [re.sub(r"\$(\w+)", lambda m: values[m.group(1)], w) for w in words]


EXTERNAL = {"git", "cmake", "cd", "export", "scontrol", "head", "mkdocs", "apt-get", "etcd"}
LAUNCHERS = {"srun", "mpirun", "mpiexec"}  # other hosts and devices: the command is parsed, not planned


def check_command(words, tmp, plan=True, error=None):
    """A command of the docs, as far as this machine can check it without running it; `error`:
    the one line it is shown to fail with (then its exit status is 2)."""
    prog = words[0]
    if prog in EXTERNAL or re.match(r"\w+=", prog):
        return
    if prog in LAUNCHERS:
        at = words.index("python")
        return check_command(words[at:], tmp, plan=False)
    if prog == "pip":
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for word in words:
            for extra in re.findall(r"\.\[([\w,]+)\]", word):
                assert set(extra.split(",")) <= set(extras), word
        return
    if prog == "diff":
        assert all((ROOT / w).exists() for w in words[1:]), words
        return
    assert prog == "python", f"a command of a kind no test checks: {words}"
    if words[1] != "-m":
        assert (ROOT / words[1]).exists(), words[1]
        return
    module, args = words[2], words[3:]
    if module == "pytest":
        return
    if module == "dpjax.train":
        from dpjax.train.cli import main, parse_args
        if not plan:
            parse_args(args)
            return
        if "cudnn" in args and "--device-memory" not in args:  # a GPU's kernel: planned for a GPU's devices
            args = args + ["--device-memory", "80GiB"]
        if error:  # refused before any step: the command as shown
            assert main(args) == 2, words
            return
        assert main(args + ["--dry-run"]) == 0, words
        return
    inner = args[args.index("--") + 1:] if "--" in args else []
    with _parse_only(), pytest.raises(_Parsed):
        _module_main(module)(args[:len(args) - len(inner) - 1] if inner else args)
    if inner:
        check_command(inner, tmp, plan=plan and module == "dpjax.launch" and "--nnodes" not in args)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.id)
def test_commands_parse_and_plan(command, tmp_path, monkeypatch, capsys):
    """Each command line of the docs: dpjax's own parsed by their parsers; a training run
    (alone or under dpjax.launch) planned with --dry-run on the 8 devices here, exit 0; one
    for other hosts (srun, mpirun, mpiexec, the agent) parsed; files and extras exist."""
    monkeypatch.chdir(tmp_path)
    for name in ("tokens.u32.bin", "tokens.bin", "corpus.txt"):  # the files earlier commands of a block make
        (tmp_path / name).write_bytes(bytes(range(256)) * 64)
    (tmp_path / "my_texts").mkdir()
    (tmp_path / "my_texts/a.txt").write_text("hello world\n" * 100)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "2+3="}\n')  # docs/preferences.md's GRPO
    monkeypatch.setenv("DPJAX_XLA_FLAGS", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_command(_vars(command.words, tmp_path), tmp_path, error=command.error)
    if command.error:  # the line the docs show is the line it prints
        assert command.error in capsys.readouterr().err.split("\n")


def test_the_docs_extra_and_ci_build_the_site():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("mkdocs-material") for d in extras["docs"])
    assert any(d.startswith("mkdocs-material") for d in extras["dev"])
    assert "mkdocs build --strict" in (ROOT / ".ci/run").read_text()
    nav = (ROOT / "mkdocs.yml").read_text()
    # rglob: the pages under docs/ and its folders (docs/models/: a card a family)
    assert sorted(p.name for p in (ROOT / "docs").rglob("*.md")) == sorted(set(re.findall(r"(\w[\w-]*\.md)", nav)))


assert os.environ.get("XLA_FLAGS") and dpjax  # conftest: 8 simulated devices before JAX
