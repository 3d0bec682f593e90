"""Every script under experiments/ runs its --smoke mode, as RESULTS.md runs it.

A removed or renamed dpjax API fails here instead of in a RESULTS.md command months
later. A script runs the way `python experiments/X.py --smoke` runs it (experiments/ first
on sys.path, this checkout's dpjax, the session's compile cache: conftest.py), but in this
process: its `main(["--smoke", *mode])` is called, with the jax configuration, environment
and working directory put back afterwards. A subprocess each would pay a JAX import and a
backend start-up (2-3 CPU-s) for nothing the test checks. What only a process shows (the
`__main__` guard, the exit status, the sibling imports from a script's own directory) is
checked by running one cheap script's smoke as a process (PROCESS_SMOKE); a script that
configures jax or XLA when it is imported (or whose main takes no argv) runs as a process
too. Helper modules (`_*.py`) are exercised through the scripts; a module without `main`
(imported by scripts, e.g. update_runs.py) is imported. A new script without a smoke mode fails: argparse rejects
`--smoke` with exit status 2. A smoke run writes its outputs into a temporary directory:
the test checks that experiments/ is left as it was.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "experiments")
SCRIPTS = [os.path.basename(p) for p in sorted(glob.glob(os.path.join(EXPERIMENTS, "*.py")))
           if not os.path.basename(p).startswith("_")]
# Scripts with several modes: each mode's smoke run (the first entry: no mode flag).
MODES = {
    "bench_collectives.py": [[], ["--all-to-all"], ["--processes", "2", "--collectives", "mpi"]],
    "bench_train.py": [[], ["--layouts", "8x1"], ["--pipeline", "stage=4,data=2"],
                       ["--pipeline", "stage=4,data=2", "--memory-sweep"]],
    "staleness.py": [[], ["--hybrid"]],
    "wan.py": [[], ["--gpt"]],
    "elastic.py": [[], ["--commit-cost"], ["--restart"]],
    "dtype_curves.py": [[], ["--dtypes", "bfloat16", "fp8"]],
    "gpu_yardstick.py": [[], ["--fp8"], ["--remats", "auto,none", "--hlo"]],
    "pack_throughput.py": [[], ["--no-speed"]],  # the efficiency part alone: numpy, no compile (fast)
    "moe_dropless.py": [[], ["--hf", "mixtral"]],  # in-process: 4 Mixtral steps compiled, 2 rounds
}
# The slowest smoke runs (20-60 s each on 2 shared cores: each compiles a dozen or more
# training steps); the fast set keeps one run of each script.
SLOW = {("bench_train.py", 1), ("bench_train.py", 2), ("staleness.py", 1), ("wan.py", 0), ("wan.py", 1),
        ("autotune_vs_grid.py", 0),
        ("adasum_large_batch.py", 0), ("elastic.py", 0), ("elastic.py", 1), ("elastic.py", 2),
        ("jax_recoverability.py", 0),
        # 35-45 s each; the fast set keeps a smoke of 11 of the 18 scripts. What they drive is
        # fast elsewhere: a layout's compiled memory (tests/test_memory.py), dpjax.train's
        # --metrics and --timeline on one device (tests/test_run_record.py, test_timeline.py)
        ("huge_layer.py", 0), ("gpu_yardstick.py", 0),
        # 60-150 s: real training processes; the fast set runs the combination both drive
        # (tests/test_cpu_runtime.py) and the sweep's row cover (tests/test_sweep.py)
        ("sweep.py", 0), ("cpu_collectives_repro.py", 0),
        # two training runs in subprocesses (about 60 s); tests/test_moe.py keeps a MoE step fast
        ("moe_vs_dense.py", 0),
        # two training runs in subprocesses (the capacity and the dropless form); tests/test_moe_dropless.py is fast
        ("moe_dropless.py", 0),
        # 60 s under load: three layouts compiled; the layouts themselves are tests/test_annotations.py's
        ("model_axes.py", 0),
        # three more training runs (30-60 s); tests/test_fp8.py keeps fp8's train step fast
        ("dtype_curves.py", 1), ("gpu_yardstick.py", 1), ("gpu_yardstick.py", 2),
        # two training processes (20-40 s); test_onebit_adam.py keeps the default's plan fast
        ("onebit_grid.py", 0),
        # two training runs in subprocesses (2 min under load); tests/test_commit.py runs auto in the loop
        ("commit_stall.py", 0),
        # two GPT steps compiled (45 s under load); tests/test_lean_step.py keeps what it found fast
        ("hlo_side_by_side.py", 0),
        # two 4-process jobs under two agents, one with faults (minutes); tests/test_chaos.py is slow too
        ("chaos.py", 0),
        # two Llama sft steps compiled (60 CPU-s); tests/test_pack_train.py keeps packed == unpacked fast
        ("pack_throughput.py", 0),
        # a DPO training process (60-90 s under load); tests/test_dpo.py keeps the task's arithmetic fast
        ("dpo_accuracy.py", 0),
        # a GRPO training process (60-120 s under load); tests/test_grpo.py keeps the loop's parts fast
        ("grpo_sum.py", 0)}


# The smoke that runs as `python experiments/X.py --smoke` whatever in_process says: a cheap
# one that imports _bench and update_runs from its own directory.
PROCESS_SMOKE = "large_batch.py"


def cases():
    for script in SCRIPTS:
        for i, mode in enumerate(MODES.get(script, [[]])):
            marks = [pytest.mark.slow] if (script, i) in SLOW else []
            yield pytest.param(script, mode, id=" ".join([script, *mode]), marks=marks)


def listing():
    """Every file under experiments/ with its size and mtime (a smoke run must change none)."""
    out = {}
    for dirpath, _, files in os.walk(EXPERIMENTS):
        if "__pycache__" in dirpath:
            continue
        for f in files:
            st = os.stat(os.path.join(dirpath, f))
            out[os.path.join(dirpath, f)] = (st.st_size, st.st_mtime_ns)
    return out


def source(script: str) -> str:
    with open(os.path.join(EXPERIMENTS, script)) as fh:
        return fh.read()


def has_main(script: str) -> bool:
    return "\ndef main(" in source(script)


def in_process(script: str) -> bool:
    """Whether `script` can run in this process: its main takes argv, nothing at its top
    level sets the environment (XLA_FLAGS is read once, when jax starts), and it changes no
    jax configuration (some settings are read once a process: compile_depth.py's
    compile cache off would not take here)."""
    text = source(script)
    tree = ast.parse(text)
    mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    if not mains or not mains[0].args.args or "config.update" in text:
        return False
    return not any("os.environ[" in ast.unparse(node) for node in tree.body
                   if not isinstance(node, (ast.FunctionDef, ast.ClassDef)))


def run(cmd, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def load(script: str, monkeypatch):
    """The script as a fresh module, with experiments/ first on sys.path (as for
    `python experiments/X.py`) until the test ends."""
    monkeypatch.syspath_prepend(EXPERIMENTS)
    name = f"smoke_{script[:-3]}"
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXPERIMENTS, script))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def call_main(script, mode, monkeypatch) -> int:
    """`main(["--smoke", *mode])` of the script, in the process's state as a fresh process
    would see it (cwd the checkout's root); the environment and jax's configuration as
    they were afterwards, whatever the script set."""
    import jax

    config, environ = dict(jax.config.values), dict(os.environ)
    monkeypatch.chdir(ROOT)
    try:
        return load(script, monkeypatch).main(["--smoke", *mode]) or 0
    except SystemExit as e:  # argparse's refusal, or a script's `raise SystemExit("error: ...")`
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        return e.code or 0
    finally:
        os.environ.clear()
        os.environ.update(environ)
        for key, value in config.items():
            if jax.config.values.get(key) != value:
                jax.config.update(key, value)


def test_scripts_found():
    # the glob must see the scripts RESULTS.md quotes (a moved directory would pass vacuously)
    assert {"bench_train.py", "bench_collectives.py", "staleness.py", "huge_layer.py", PROCESS_SMOKE} <= set(SCRIPTS)


@pytest.mark.parametrize("script,mode", list(cases()))
def test_smoke(script, mode, monkeypatch, capsys):
    before = listing()
    if has_main(script) and in_process(script) and script != PROCESS_SMOKE:
        rc = call_main(script, mode, monkeypatch)
        out = capsys.readouterr()
        assert rc == 0, f"{script} {' '.join(mode)} --smoke returned {rc}:\n{out.out[-3000:]}\n{out.err[-5000:]}"
    elif has_main(script):
        r = run([sys.executable, os.path.join("experiments", script), "--smoke", *mode], ROOT)
        assert r.returncode == 0, f"{script} {' '.join(mode)} --smoke exited {r.returncode}:\n{r.stdout[-3000:]}\n" \
                                  f"{r.stderr[-5000:]}"
    else:  # a module the scripts import
        load(script, monkeypatch)
    assert listing() == before, f"{script} --smoke wrote into experiments/"

