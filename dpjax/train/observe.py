"""What a run measures about itself beside the loss: the bytes a step sends (read from
the compiled program) and the `--timeline` of a few profiled steps."""

from __future__ import annotations

import os


class CommBytes:
    """What the busiest device sends per step, read once per compiled step
    (`cost.hlo_comm`; JAX's cached executable, so no compile)."""

    def __init__(self):
        self._sent = {}

    def __call__(self, step, args) -> int:
        if id(step) not in self._sent:
            from dpjax.collectives.cost import hlo_comm
            from dpjax.timeline import compiled_text

            self._sent[id(step)] = hlo_comm(compiled_text(step.train, *args)).max_bytes
        return self._sent[id(step)]


def shapes(args):
    """The abstract values (shape, dtype, sharding) of a step's arguments: what its
    compiled program is looked up by, kept once the arrays themselves are donated."""
    import jax

    from dpjax.timeline.program import _abstract

    return jax.tree.map(_abstract, args)


def write_timeline(recorder, path: str, step, args, write, steps, say) -> None:
    """The profiled steps' timeline to `path` (each process its own, named by rank); their
    comm_fraction to the metrics; one line saying where it went."""
    import jax

    from dpjax.timeline import summarize

    recorder.stop()
    if jax.process_count() > 1:  # each process profiles its own devices
        path = os.path.join(os.path.dirname(path), f"rank{jax.process_index()}-{os.path.basename(path)}")
    recorder.program(step.train, *args)
    summary = summarize(recorder.write(path))
    for row in summary.steps:
        write({"step": row["step"], "comm_fraction": round(row["comm_fraction"], 4)})
    share = sum(r["comm_fraction"] for r in summary.steps) / len(summary.steps)
    say(f"timeline: steps {steps.start}-{steps[-1]} in {path}, communication {100 * share:.0f}% of a step "
        f"(python -m dpjax.timeline {path})")
