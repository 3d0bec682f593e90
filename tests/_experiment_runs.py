"""What the tests of the post-training runs share (tests/test_dpo_cli.py, tests/test_grpo_train.py):
an experiments/ script loaded as a module, whose train_args are the runs these tests repeat, and
the rows of a `--metrics` file."""

import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXPERIMENTS = os.path.join(ROOT, "experiments")


def experiment(name: str):
    """experiments/NAME.py as a module, with experiments/ on sys.path while it loads (its _bench)."""
    sys.path.insert(0, EXPERIMENTS)
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(EXPERIMENTS, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


def rows(path, key: str = "step") -> list[dict]:
    """The rows of a `--metrics` file that carry `key`, in file order (the run record has no step)."""
    with open(path) as f:
        return [r for r in map(json.loads, f) if key in r]
