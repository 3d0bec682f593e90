"""The package's import graph against DESIGN.md's layer order ("Dependencies point one way,
package by package"): every `import` of a dpjax module, function-local ones included, read
from the source (no module is imported), must point to a lower layer or stay inside its own
unit, and no chain of imports may come back to where it started.

The units are the rooms DESIGN.md's layout draws: dpjax's packages (`dpjax.compute`,
`dpjax.wrap`, `dpjax.recovery`, ...) and the modules at its root, never a single file inside
a package. Drawn by unit the graph has no circle and no import back up, and the root holds at
most MAX_ROOT_MODULES modules; `python tests/test_imports.py` prints these figures.

A function-local import hides a circle from Python, not from this test: the import runs
later, but the modules still depend on each other both ways.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lowest first: dpjax's packages and root modules, no file inside a package. A module belongs
# to the unit its name starts with (a package's modules to the package); a module may import
# its own unit or a lower layer's, never a higher one, nor one of its own layer.
LAYERS = [
    ["dpjax.env", "dpjax.errors", "dpjax.interrupt", "dpjax.registry", "dpjax.fusion", "dpjax.hlo", "dpjax.scopes"],
    ["dpjax.mesh"],  # axis names and the axis helpers (spec_axes, bound) every layer above reads
    ["dpjax.links", "dpjax.distributed", "dpjax.data"],
    ["dpjax.collectives", "dpjax.wrap"],  # wrap: shard_step's room, on mesh and errors alone
    ["dpjax.compression", "dpjax.compute", "dpjax.timeline"],
    ["dpjax.data_parallel", "dpjax.models", "dpjax.nn", "dpjax.pipeline", "dpjax.recovery"],
    ["dpjax.sharding", "dpjax.horovod"],  # sharding beside the pipeline in DESIGN.md: it lays the stages out
    ["dpjax.sharding_rules", "dpjax.optim", "dpjax.updates", "dpjax.tasks",  # tasks: a model's loss on a task's batch
     "dpjax.hf"],  # HuggingFace import / export: a model, its layout, a checkpoint
    ["dpjax.generate", "dpjax.settings"],  # generate: weights from dpjax.hf; settings: the registries' choices
    ["dpjax.plan"],  # and the pipeline's cost model (plan.pipeline_cost compiles a layout)
    ["dpjax.step"],
    ["dpjax.train"],
    ["dpjax.agent"],  # the agent reads a train command's flags (dpjax.train.cli)
    ["dpjax.launch"],  # a plain launch, or the agent's
    ["dpjax"],  # the public face
]
MAX_ROOT_MODULES = 15  # issue #39: a newcomer finds the rooms; the root keeps what every room uses
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_files() -> dict[str, pathlib.Path]:
    out = {}
    for base, name in ((ROOT / "dpjax", "dpjax"), (ROOT / "models", "dpjax.models")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([name, *parts])] = path
    return out


def imports(module: str, path: pathlib.Path, known) -> set[str]:
    """The dpjax modules `module` imports anywhere in its source (top level, functions,
    branches): `from dpjax.x import y` counts as dpjax.x.y when that is a module, else dpjax.x."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != module:
                out.add(t)
    return out


def graph(files=None) -> dict[str, set[str]]:
    files = module_files() if files is None else files
    return {m: imports(m, p, files) for m, p in files.items()}


def unit(module: str) -> str:
    parts = module.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in LAYER:
            return ".".join(parts[:k])
    raise KeyError(module)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a circle."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b} ({unit(a)}: layer {LAYER[unit(a)]}, {unit(b)}: layer {LAYER[unit(b)]})"
                  for a, bs in edges.items() for b in bs
                  if unit(a) != unit(b) and LAYER[unit(b)] >= LAYER[unit(a)])


def unit_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph drawn by unit: an edge from one package (or root module) to another for
    every import between their modules."""
    out = {unit(m): set() for m in edges}
    for a, bs in edges.items():
        for b in bs:
            if unit(a) != unit(b):
                out[unit(a)].add(unit(b))
    return out


def root_modules(files=None) -> list[str]:
    files = module_files() if files is None else files
    return sorted(m for m, p in files.items() if m.count(".") == 1 and p.name != "__init__.py")


def figures() -> dict[str, int]:
    """The figures issue #39 asks for: modules at the root (besides __init__.py), packages,
    and, drawn by unit, the circles and the imports back up (unit edges against LAYERS)."""
    files = module_files()
    edges = unit_graph(graph(files))
    return {"root modules": len(root_modules(files)),
            "packages": sum(1 for m, p in files.items() if m.count(".") == 1 and p.name == "__init__.py"),
            "circles by package": len(cycles(edges)),
            "imports back up by package": sum(1 for a, bs in edges.items() for b in bs if LAYER[b] >= LAYER[a])}


def test_the_root_keeps_few_modules_and_the_rooms_draw_a_clean_graph():
    found = figures()
    assert found["root modules"] <= MAX_ROOT_MODULES, (root_modules(), "move some into their rooms")
    assert found["circles by package"] == 0 and found["imports back up by package"] == 0, found


def test_layers_list_packages_and_root_modules_only():
    files = module_files()
    units = {m for m in files if m.count(".") <= 1}
    assert set(LAYER) <= units, sorted(set(LAYER) - units)


def test_every_module_has_a_layer():
    missing = []
    for m in module_files():
        try:
            unit(m)
        except KeyError:
            missing.append(m)
    assert not missing, f"place these in LAYERS (and in DESIGN.md's picture): {missing}"


def test_no_import_circle_even_through_function_local_imports():
    assert cycles(graph()) == []


def test_no_import_from_a_lower_layer_to_a_higher_one():
    assert upward(graph()) == []


def test_the_walk_sees_function_local_imports_and_circles(tmp_path):
    """The checks themselves: a function-local import that closes a circle, and one that
    points upward, are both found (the test is only as good as its walk)."""
    pkg = tmp_path / "dpjax"
    (pkg / "collectives").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "collectives" / "__init__.py").write_text("from dpjax.collectives import ring\n")
    (pkg / "collectives" / "ring.py").write_text("def f():\n    from dpjax.collectives import ring2\n")
    (pkg / "collectives" / "ring2.py").write_text("from . import ring\n"
                                                  "def g():\n    from dpjax.step import build\n")
    (pkg / "step.py").write_text("")
    files = {"dpjax": pkg / "__init__.py", "dpjax.collectives": pkg / "collectives" / "__init__.py",
             "dpjax.collectives.ring": pkg / "collectives" / "ring.py",
             "dpjax.collectives.ring2": pkg / "collectives" / "ring2.py", "dpjax.step": pkg / "step.py"}
    edges = graph(files)
    assert cycles(edges) == [["dpjax.collectives.ring", "dpjax.collectives.ring2"]]
    assert [line.split(" (")[0] for line in upward(edges)] == ["dpjax.collectives.ring2 -> dpjax.step"]


def test_the_layers_keep_design_md_chains():
    """DESIGN.md's chains, in its order: mesh <- collectives <- compression <- data_parallel
    <- updates <- step <- train; mesh <- compute <- models; compute <- sharding <- step;
    plan above sharding / updates / links, below step; recovery below train."""
    chains = [["dpjax.mesh", "dpjax.collectives", "dpjax.compression", "dpjax.data_parallel", "dpjax.updates",
               "dpjax.step", "dpjax.train"],
              ["dpjax.mesh", "dpjax.compute", "dpjax.models"],
              ["dpjax.compute", "dpjax.sharding", "dpjax.step"],
              ["dpjax.sharding", "dpjax.plan", "dpjax.step"], ["dpjax.updates", "dpjax.plan"],
              ["dpjax.links", "dpjax.collectives"], ["dpjax.links", "dpjax.plan"], ["dpjax.recovery", "dpjax.train"]]
    for chain in chains:
        layers = [LAYER[u] for u in chain]
        assert layers == sorted(layers) and len(set(layers)) == len(layers), chain


if __name__ == "__main__":
    for name, value in figures().items():
        print(f"{name}: {value}")
