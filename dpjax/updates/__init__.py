"""Update rules between workers: one module per rule, each registering itself with its
`--update` grammar (`registry.py`); the grammar (`grammar.py`) and `make_rule` read the
registry. The rules' shared parts are in `base.py`.

    sync.py          every step, the gradient average
    delayed.py       delayed:T, delayed-nocomp:T (DTAW)
    sparse.py        sparse:P[,outer=LR] (local SGD, DiLoCo)
    stale_async.py   async:TAU[,fetch=F][,push=Q] (a parameter server, stale workers)
    onebit_adam.py   1-bit Adam, the rule `--optimizer onebit_adam` brings (`registry.for_optimizer`)

How a rule becomes a jitted step over a mesh and a layout is `dpjax.step`'s business;
this package knows nothing of models, layouts or meshes beyond the worker axes.
"""

from dpjax.updates.base import UpdateRule
from dpjax.updates.grammar import UpdateSpec, help_text, parse_update
from dpjax.updates.grammar import make_rule

# Each rule registers itself when imported; this order is the order of HELP and the errors.
from dpjax.updates import sync as _sync, delayed as _delayed, sparse as _sparse, stale_async as _async  # noqa: E401
from dpjax.updates import onebit_adam as _onebit_adam
# The rules' constructors keep their modules' names (`dpjax.updates.delayed.delayed`): a package
# that bound `delayed` to the function would see it replaced by the module the first time anything
# imported `dpjax.updates.delayed` (tests/test_package_names.py).
from dpjax.updates.delayed import DelayedState, delayed_gradients
from dpjax.updates.sparse import LocalState
from dpjax.updates.stale_async import AsyncState, staleness, staleness_schedule

REGISTERED_BY = (_sync, _delayed, _sparse, _async, _onebit_adam)

__all__ = [
    "AsyncState", "DelayedState", "HELP", "LocalState", "UpdateRule", "UpdateSpec",
    "delayed_gradients", "help_text", "make_rule", "parse_update", "staleness", "staleness_schedule",
]


def __getattr__(name: str):
    if name == "HELP":  # read at each use, so it lists every rule registered by then
        return help_text()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
