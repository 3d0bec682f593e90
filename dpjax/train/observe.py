"""What a run measures about itself beside the loss: the compression ratio of each step
and the `--timeline` of a few profiled steps (the bytes a step sends: `comm_bytes.py`)."""

from __future__ import annotations

import os


class CompressionRatio:
    """The compression ratio of each step (bytes uncompressed / bytes sent in the
    exchange, `compression.accounting`): 1.0 before a start step, the method's after."""

    def __init__(self, plan):
        from dpjax.compression import accounting

        self.plan, self.whole = plan, accounting.ratio(plan)

    def __call__(self, step_i: int) -> float:
        from dpjax.compression import accounting

        return accounting.ratio_at(self.plan, step_i, self.whole)


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
    say(f"timeline: steps {steps.start + 1}-{steps[-1] + 1} in {path}, communication {100 * share:.0f}% of a step "
        f"(python -m dpjax.timeline {path})")
    for note in summary.notes:  # e.g. a GPU's command buffers, whose ops the profile cannot name
        say(f"timeline: {note}")
