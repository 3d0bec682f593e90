"""Spare processes: the next round's processes of a `python -m MODULE ARGS` command,
started while the job trains, with Python started and MODULE's package imported (JAX and
dpjax: most of a restarted process's seconds before it joins), each waiting for its
rank's environment on stdin. A restart hands them their environment instead of starting
new interpreters (`dpjax.agent.workers.Workers`, the agent's --spares).

    python .../dpjax/agent/spare.py MODULE ARGS...   (what the agent starts; reads one JSON line)

(the file, not `-m`: importing the dpjax package is the command's package's to do, or not)

A spare does nothing else before it is told: no JAX backend, no device, no file; an empty
line (the agent ending) or the agent's death (PR_SET_PDEATHSIG) ends it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import runpy
import sys


def command_module(command) -> str | None:
    """MODULE of a `python -m MODULE ...` command (what a spare can stand in for), else None."""
    if len(command) >= 3 and command[1] == "-m" and os.path.basename(command[0]).startswith("python"):
        return command[2]
    return None


def package(module: str) -> str | None:
    """What a spare imports ahead for MODULE: MODULE itself when it is a package (`-m` runs its
    __main__), else its package (importing a module would run it), None for a top-level module."""
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations is not None:
        return module
    return module.rpartition(".")[0] or None


def main(argv=None) -> None:
    module, *args = sys.argv[1:] if argv is None else argv
    warm = package(module)
    if warm:
        importlib.import_module(warm)
    line = sys.stdin.readline()
    if not line.strip():
        return
    env = json.loads(line)
    os.environ.clear()
    os.environ.update(env)  # the round's: jax.distributed's settings, the rank, the restart's account
    restart = sys.modules.get("dpjax.train.restart")
    if restart is not None:  # the restart's breakdown from now, not from when the spare imported
        restart.stamp("handed")
        restart.stamp("start_import")
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as under `-m`: not this file's folder (dpjax/agent's modules are no top-level ones)
    main()
