"""The shape-letter table in `dpjax/__init__.py` holds: every name in dpjax and its models
that ends in a shape (`w1_DxFm`, `batch_MxBxT1`) uses only the table's letters, each
followed by digits and mesh-axis initials only, and each letter only where its concept
lives (HOMES below). A letter borrowed for another concept (V for virtual stages in the
pipeline, K for picked values in compression, H for the mlp's width) lands outside its
home and fails here. Names are read from the source (assignments, arguments, dict keys).
"""

from __future__ import annotations

import ast
import pathlib
import re

import dpjax

ROOT = pathlib.Path(__file__).resolve().parents[1]
AXIS_INITIALS = set("dmnsce")  # data, model, node, stage, context, expert
# a snake_case name whose last part holds a capital: the shape, dimensions joined by x
SHAPE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)*_"
                   r"((?=[A-Za-z0-9]*[A-Z])[A-Za-z][A-Za-z0-9]*(?:x[A-Za-z][A-Za-z0-9]*)*)$")
DIM = re.compile(r"^([A-Z])([0-9]*)([a-z]*)$")

# Where each letter's concept lives: path prefixes (relative to the repository). "*": anywhere.
MODEL_MATH = ("models/", "dpjax/compute/tensor_parallel.py", "dpjax/nn/", "dpjax/compute/attention.py",
              "dpjax/compute/stack.py", "dpjax/pipeline/", "dpjax/plan/pipeline_cost.py", "dpjax/step/",
              "dpjax/sharding.py", "dpjax/hf/", "dpjax/generate/", "dpjax/compute/fp8.py",
              "dpjax/compute/policy.py")  # fp8 and the policy: the projections
# hf: the Hub's names of the model's leaves
ATTENTION = ("dpjax/compute/context.py", "models/base.py", "models/gpt.py", "models/llama.py", "models/qwen.py",
             "models/gemma.py", "models/lora.py", "dpjax/compute/tensor_parallel.py", "dpjax/nn/",
             "dpjax/compute/attention.py",
             "dpjax/hf/",
             "dpjax/generate/")
HOMES = {
    "B": "*", "T": "*", "P": "*", "N": "*",
    "D": MODEL_MATH, "F": MODEL_MATH, "L": MODEL_MATH,
    "H": ATTENTION, "K": ATTENTION,
    "Y": ("dpjax/compute/context.py", "models/base.py", "models/llama.py", "models/qwen.py", "models/lora.py",
          "models/gemma.py", "dpjax/hf/", "dpjax/generate/"),
    "O": ("dpjax/generate/",),
    "V": ("models/", "dpjax/compute/tensor_parallel.py", "dpjax/nn/", "dpjax/hf/", "dpjax/generate/",
          "dpjax/tasks/"),  # tasks: a task's loss of the vocabulary-parallel logits
    "E": ("models/mlp.py",), "C": ("models/mlp.py",),
    "A": ("dpjax/step/", "dpjax/train/preference.py"),  # preference: the reference over micro-batches
    "M": ("dpjax/pipeline/", "dpjax/step/"),
    "S": ("dpjax/pipeline/", "dpjax/compute/stack.py", "dpjax/sharding.py", "dpjax/step/"),
    "G": ("dpjax/pipeline/",),
    "W": ("dpjax/updates/", "dpjax/step/"), "R": ("dpjax/updates/",),
    "I": ("dpjax/compression/", "dpjax/collectives/"), "J": ("dpjax/compression/",),
    "Q": ("dpjax/compression/",), "Z": ("dpjax/compression/",),
    "U": ("dpjax/wrap/replicas.py",),
    "X": ("models/moe.py", "models/moe_dropless.py", "models/gpt.py", "models/mixtral.py", "dpjax/hf/"),
}


def table() -> dict[str, str]:
    """letter -> meaning, from the package docstring's table (lines "    X  meaning")."""
    return dict(re.findall(r"^    ([A-Z])  (\S.*)$", dpjax.__doc__, re.M))


def shaped_names(rel: str, text: str):
    for node in ast.walk(ast.parse(text, rel)):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.arg):
            yield node.arg
        elif isinstance(node, (ast.FunctionDef, ast.Attribute)):
            yield node.name if isinstance(node, ast.FunctionDef) else node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            yield node.value


def problems(sources) -> list[str]:
    """What breaks the table in `sources`, (path relative to the repository, text) pairs."""
    letters, out = table(), []
    for rel, text in sources:
        for name in sorted(set(shaped_names(rel, text))):
            m = SHAPE.match(name)
            if not m:
                continue
            for dim in m.group(1).split("x"):
                if dim.isdigit():  # a fixed size (qkv_Dx3xHmxK: q, k and v)
                    continue
                d = DIM.match(dim)
                if d is None or not set(d.group(3)) <= AXIS_INITIALS:
                    out.append(f"{rel}: {name}: {dim!r} is not a letter, digits and axis initials")
                elif d.group(1) not in letters:
                    out.append(f"{rel}: {name}: {d.group(1)} is not in the table")
                elif HOMES[d.group(1)] != "*" and not rel.startswith(HOMES[d.group(1)]):
                    out.append(f"{rel}: {name}: {d.group(1)} ({letters[d.group(1)]}) outside its home")
    return out


def package_sources():
    files = sorted([*(ROOT / "dpjax").rglob("*.py"), *(ROOT / "models").rglob("*.py")])
    return [(f.relative_to(ROOT).as_posix(), f.read_text()) for f in files]


def test_the_table_and_the_homes_name_the_same_letters():
    assert sorted(table()) == sorted(HOMES)


def test_every_shape_letter_is_in_the_table_and_at_home():
    assert problems(package_sources()) == []


def test_a_borrowed_letter_fails():
    """The check itself: V for virtual stages in the pipeline, an unlisted b, a K for
    picked values in compression and an undeclared axis initial are all found."""
    found = problems([("dpjax/pipeline/probe.py", "def f(chunks_VxLz, batch_MxbxT1, x_BqxT):\n    return 0\n"),
                      ("dpjax/compression/probe.py", "idx_NxK = 0\n")])
    assert any("chunks_VxLz: V" in p and "outside its home" in p for p in found), found
    assert any("'Lz'" in p for p in found) and any("'b'" in p for p in found), found
    assert any("idx_NxK: K" in p for p in found) and any("'Bq'" in p for p in found), found
