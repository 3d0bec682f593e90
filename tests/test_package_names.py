"""No package binds a name that one of its submodules also has.

`import dpjax.train.run` (the module) used to replace `dpjax.train.run` (the function the
package exports) the first time anything imported the module, so that a second
`dpjax.train.run(settings)` raised "'module' object is not callable". Python binds a
submodule on its package as an attribute when it is imported: a package's own name for
something else is overwritten at a moment that depends on import order. Each package is
imported in a fresh process (so that nothing imported its submodules first) and its
namespace read right after."""

import json
import subprocess
import sys


from conftest import tiny_gpt

SCRIPT = r"""
import importlib, json, pkgutil, sys, types
import dpjax

packages = ["dpjax"] + [m.name for m in pkgutil.walk_packages(dpjax.__path__, "dpjax.") if m.ispkg]
clashes = []
for name in packages:
    pkg = importlib.import_module(name)
    for sub in pkgutil.iter_modules(pkg.__path__):
        bound = vars(pkg).get(sub.name)
        if bound is not None and not (isinstance(bound, types.ModuleType) and bound.__name__ == f"{name}.{sub.name}"):
            clashes.append(f"{name}.{sub.name}")
print(json.dumps(clashes))
"""


def test_no_package_binds_the_name_of_one_of_its_submodules():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_train_run_trains_each_time_it_is_called(corpus, tmp_path):
    """`dpjax.train.run(settings)` as the docs write it, three times in one process: the
    first call imports the loop's modules, which must leave the function in place."""
    import dpjax.train

    losses = []
    for i in range(3):
        path = tmp_path / f"m{i}.jsonl"
        settings = dpjax.train.parse_args(tiny_gpt(corpus, "--mesh", "1x1", "--steps", "2", "--metrics", str(path)))
        summary = dpjax.train.run(settings)
        assert summary["steps"] == 2
        losses.append([json.loads(line)["loss"] for line in open(path) if '"loss"' in line])
    assert losses[0] == losses[1] == losses[2] and len(losses[0]) == 2  # the same seed, the same steps
