"""The update rules' old module, kept only so that `from dpjax.updates.rules import ...`
keeps working until its last caller (`dpjax.step`) imports from `dpjax.updates`. The
rules are one module each now (`sync.py`, `delayed.py`, `sparse.py`, `stale_async.py`)."""

from dpjax.updates import (
    AsyncState,
    DelayedState,
    LocalState,
    UpdateRule,
    as_axes,
    axis_arg,
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
    "AsyncState", "DelayedState", "LocalState", "UpdateRule", "as_axes", "axis_arg", "delayed", "delayed_gradients",
    "make_rule", "sparse", "stale_async", "staleness", "staleness_schedule", "sync",
]
