"""Update rules between workers: the algebra (`rules`) and the `--update` grammar (`grammar`).

How a rule becomes a jitted step over a mesh and a layout is `dpjax.step`'s business;
this package knows nothing of models, layouts or meshes beyond the worker axes.
"""

from dpjax.updates.grammar import HELP, UpdateSpec, parse_update
from dpjax.updates.rules import (
    AsyncState,
    DelayedState,
    LocalState,
    UpdateRule,
    delayed,
    delayed_gradients,
    make_rule,
    sparse,
    stale_async,
    staleness,
    staleness_schedule,
    sync,
)

__all__ = [
    "AsyncState", "DelayedState", "HELP", "LocalState", "UpdateRule", "UpdateSpec", "delayed",
    "delayed_gradients", "make_rule", "parse_update", "sparse", "stale_async", "staleness",
    "staleness_schedule", "sync",
]
