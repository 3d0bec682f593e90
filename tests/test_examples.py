"""examples/: the plain loop and its dpjax twin train alike, and differ by a handful of lines."""

import difflib
import importlib.util
import pathlib

import numpy as np

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_distributed_example_trains_like_the_plain_one():
    plain = _load("plain").train(steps=40)
    dist = _load("distributed").train(steps=40)
    assert plain[-1] < 0.6 * plain[0]
    # same data, same init: only the order of the gradient sums differs (round-off)
    np.testing.assert_allclose(dist, plain, rtol=1e-5)


def test_the_diff_is_a_handful_of_lines():
    a = (EXAMPLES / "plain.py").read_text().split('"""', 2)[2].splitlines()
    b = (EXAMPLES / "distributed.py").read_text().split('"""', 2)[2].splitlines()
    added = [line for line in difflib.unified_diff(a, b, lineterm="", n=0)
             if line.startswith("+") and not line.startswith("+++") and line.strip("+ ")]
    assert len(added) <= 8, added
