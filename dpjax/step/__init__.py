"""THE step builder: a plan (`dpjax.plan`) -> jitted steps, and what a run needs around them.

Every training step dpjax runs is built from one `Plan` by `build` (`dpjax.step.builder`,
the programs and what each device holds inside them; `dpjax.step.gradient`, the worker's
gradient they run). `entry` is where callers come in: the steps for a plan or a
model (`for_plan`, `for_model`), for research code's own loss and rule
(`make_update_step`), a step's programs kept across restarts (`kept`), and the values
the programs take, placed in their shardings by `placement` without a device ever holding the whole
(`init_params`, `put_batch`, `replicated`).

The rooms change for different reasons: a new entry point (`entry`), a new placement
(`placement`), a new program or layout (`builder`), a new way to reduce a gradient
(`gradient`). This face re-exports their public names.
"""

from dpjax.plan import Plan
from dpjax.step.builder import TrainStep, build
from dpjax.step.entry import for_model, for_plan, kept, make_update_step
from dpjax.step.placement import init_params, num_bytes, put_batch, replicated

__all__ = ["Plan", "TrainStep", "build", "for_model", "for_plan", "init_params", "kept",
           "make_update_step", "num_bytes", "put_batch", "replicated"]
