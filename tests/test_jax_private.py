"""The private JAX names (`jax._src`) dpjax relies on: found in its source, equal to the list
below, each there in the installed jax. JAX may change any of them in any release, so
pyproject.toml bounds jax from above (`<0.12`: 0.10.2 here, 0.11.2 on the GPU machine) and a
new version is admitted once this test passes on it. What the source names is read from its
AST (no module is imported): every `from jax._src... import X [as Y]`, every attribute chain
on such a name (the method a call ends in left off), and `getattr`/`hasattr` with a constant
name; `getattr` with a computed name is allowed once, over `cpu_runtime.CHANNEL_PRIMITIVES`.
Beside them, ON_COMPILED: the private attributes read on a compiled program (jax.stages'
public `Compiled`), walked on one."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import tomllib

import jax
import pytest

from dpjax.collectives import cpu_runtime

ROOT = pathlib.Path(__file__).resolve().parents[1]

# name -> why dpjax needs it (the module that uses it)
RELIED_ON = {
    # collectives/cpu_runtime.py: a channel id per collective on XLA:CPU (re-registers the CPU lowering)
    "jax._src.interpreters.mlir": "the lowering rules' registry",
    "jax._src.interpreters.mlir._lowerings": "a collective's default lowering rule",
    "jax._src.interpreters.mlir._platform_specific_lowerings": "a collective's CPU lowering rule, if it has one",
    "jax._src.interpreters.mlir.register_lowering": "registers the wrapped rule for the CPU platform",
    "jax._src.lax.parallel": "the collective primitives (CHANNEL_PRIMITIVES, below)",
    "jax._src.mesh": "dpjax.jit: the mesh a legacy `with mesh:` set, which jax.sharding.get_mesh does not return",
    "jax._src.mesh.thread_resources.env.physical_mesh": "dpjax.jit: that mesh itself",
    "jax._src.lib.mlir.ir": "walks the operations a lowering rule made",
    "jax._src.lib.mlir.ir.Block": "a block argument ends the walk",
    "jax._src.lib.mlir.ir.OpView": "an operation's typed view",
    "jax._src.lib.mlir.ir.Operation": "an operation",
    "jax._src.lib.mlir.ir.Value": "an operation's results and operands",
    "jax._src.lib.mlir.dialects.hlo": "the StableHLO dialect's attributes",
    "jax._src.lib.mlir.dialects.hlo.ChannelHandle": "reads and sets an operation's channel id",
    # distributed/: jax.distributed's state, its cluster detection, MPI collectives
    "jax._src.distributed": "jax.distributed's process-wide state",
    "jax._src.distributed.global_state": "whether this process joined, and with how many",
    "jax._src.distributed.global_state.client": "the coordination service's key-value store (agreement, commits)",
    "jax._src.distributed.global_state.coordinator_address": "where the coordinator is (commits)",
    "jax._src.distributed.shutdown": "leaves before MPI_Finalize (transport.py)",
    "jax._src.clusters": "JAX's own cluster detection",
    "jax._src.clusters.ClusterEnv._cluster_types": "the clusters JAX recognises beside dpjax's launchers",
    "jax._src.lib._jax": "jaxlib's extension",
    "jax._src.lib._jax.make_mpi_collectives": "MPI collectives for --collectives mpi (transport.py)",
    **{f"jax._src.lax.parallel.{n}": "a collective whose CPU lowering gets its own channel id"
       for n in cpu_runtime.CHANNEL_PRIMITIVES},
}

# Used through an object the names above hand out (so not named in an import or chain): the
# text that uses each, checked to be in the source, and the name checked to exist.
THROUGH_OBJECTS = {
    "jax._src.interpreters.mlir.ModuleContext.new_channel": ("collectives/cpu_runtime.py",
                                                             "module_context.new_channel()"),
    "jax._src.interpreters.mlir.LoweringRuleEntry.rule": ("collectives/cpu_runtime.py", "current.rule"),
    "jax._src.interpreters.mlir.LoweringRuleEntry.inline": ("collectives/cpu_runtime.py", "current.inline"),
    "jax._src.distributed.global_state.num_processes": ("distributed/processes.py", "joined.num_processes"),
    "jax._src.clusters.ClusterEnv.is_env_present": ("distributed/join.py", "env.is_env_present()"),
    "jax._src.clusters.ClusterEnv.opt_in_only_method": ("distributed/join.py", "env.opt_in_only_method"),
}

# Private attributes of what jax.jit(...).lower(...).compile() returns (a public object, so
# not named through jax._src): the chain each module reads, checked to be in its source and
# walked on a compiled program of the installed jax.
ON_COMPILED = {
    "_executable._unloaded_executable.device_list": ("recovery/programs.py", "the devices a kept program runs on, "
                                                     "in its device assignment's order"),
}


def private_names(source: str) -> tuple[set[str], set[str]]:
    """(the jax._src names a module's source uses, the ones it getattr's with a computed name)."""
    tree = ast.parse(source)
    alias, found, computed = {}, set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
                found.add(f"{node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("jax._src"):
                    alias[a.asname or "jax"] = a.name if a.asname else "jax"
                    found.add(a.name)
    parents = {child: p for p in ast.walk(tree) for child in ast.iter_child_nodes(p)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(parents.get(node), ast.Attribute):
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in alias and alias[base.id] != "jax":
                called = isinstance(parents.get(node), ast.Call) and parents[node].func is node
                found.add(".".join([alias[base.id], *(chain[:-1] if called and len(chain) > 1 else chain)]))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and isinstance(node.args[0], ast.Name) and node.args[0].id in alias):
            if isinstance(node.args[1], ast.Constant):
                found.add(f"{alias[node.args[0].id]}.{node.args[1].value}")
            else:
                computed.add(alias[node.args[0].id])
    return found, computed


def in_the_source() -> tuple[set[str], dict[str, set[str]]]:
    found, computed = set(), {}
    for path in [*(ROOT / "dpjax").rglob("*.py"), *(ROOT / "models").rglob("*.py")]:
        text = path.read_text()
        if "_src" not in text:  # no file names a private module without these four letters
            continue
        names, dyn = private_names(text)
        found |= names
        if dyn:
            computed[str(path.relative_to(ROOT))] = dyn
    return found, computed


def resolve(name: str):
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def test_the_private_names_in_the_source_are_the_listed_ones():
    found, computed = in_the_source()
    assert computed == {"dpjax/collectives/cpu_runtime.py": {"jax._src.lax.parallel"}}, computed
    found |= {f"jax._src.lax.parallel.{n}" for n in cpu_runtime.CHANNEL_PRIMITIVES}
    assert found == set(RELIED_ON), ("new: " + str(sorted(found - set(RELIED_ON)))
                                     + "; gone: " + str(sorted(set(RELIED_ON) - found)))
    for name, (path, text) in THROUGH_OBJECTS.items():
        assert text in (ROOT / "dpjax" / path).read_text(), (name, path, text)


def test_the_compiled_programs_private_attributes_exist():
    compiled = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((2,), "float32")).compile()
    for chain, (path, _) in ON_COMPILED.items():
        assert f"compiled.{chain}" in (ROOT / "dpjax" / path).read_text(), (chain, path)
        obj = compiled
        for attr in chain.split("."):
            obj = getattr(obj, attr)
        assert [d.id for d in obj] == [jax.devices()[0].id]  # a plain jit runs on the default device


@pytest.mark.parametrize("name", [*RELIED_ON, *THROUGH_OBJECTS])
def test_each_exists_in_the_installed_jax(name):
    owner, _, attr = name.rpartition(".")
    if name in THROUGH_OBJECTS and owner.endswith("LoweringRuleEntry"):  # a dataclass's fields
        assert attr in resolve(owner).__dataclass_fields__
    else:
        resolve(name)


def test_the_scan_sees_aliases_chains_and_getattr():
    src = ("from jax._src import distributed as d\nfrom jax._src.lib import _jax\n"
           "def f(n):\n    d.global_state.client.key_value_set('k', 'v')\n    d.shutdown()\n"
           "    hasattr(_jax, 'x')\n    getattr(_jax, n)\n")
    found, computed = private_names(src)
    assert found == {"jax._src.distributed", "jax._src.distributed.global_state.client",
                     "jax._src.distributed.shutdown", "jax._src.lib._jax", "jax._src.lib._jax.x"}
    assert computed == {"jax._src.lib._jax"}


def test_pyproject_bounds_jax_from_above_and_the_installed_one_fits():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for package in ("jax", "jaxlib"):
        spec = next(d for d in deps if re.match(rf"{package}\b(?![\w-])", d))
        below = re.search(r"<\s*([\d.]+)", spec)
        assert below, f"{spec}: dpjax uses jax._src, so the version needs an upper bound"
        have = tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:3])
        assert have < tuple(int(x) for x in below.group(1).split(".")), (jax.__version__, spec)
