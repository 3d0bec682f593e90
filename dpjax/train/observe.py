"""What a run measures about itself beside the loss: the bytes a step sends (read from
the compiled program) and the `--timeline` of a few profiled steps."""

from __future__ import annotations

import os


class CommBytes:
    """What the busiest device sends per step, read once per compiled step
    (`cost.hlo_comm`; JAX's cached executable, so no compile). With a compression's
    start=S the program holds the exact and the compressed exchange: step i is charged
    the branch it runs (`compression.accounting.step_bytes`), not both."""

    def __init__(self, plan=None):
        self._sent, self.plan = {}, plan

    def __call__(self, step, args, step_i: int = 0) -> int:
        from dpjax.compression import accounting

        if id(step) not in self._sent:
            from dpjax.timeline import compiled_text

            self._sent[id(step)] = accounting.step_bytes(compiled_text(step.train, *args))
        compressed = self.plan is not None and accounting.compressed_at(self.plan, step_i)
        return self._sent[id(step)].at(compressed)


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
    say(f"timeline: steps {steps.start}-{steps[-1]} in {path}, communication {100 * share:.0f}% of a step "
        f"(python -m dpjax.timeline {path})")
