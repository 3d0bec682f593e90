"""The per-step hooks of the training loop: the protocol every part of a run beside the
step itself follows (metrics, progress, evaluation, checkpoints, commits, the NaN stop,
Ctrl-C, the autotune, the timeline: `builtin.py`), and that a researcher's own hook
follows too.

    loop:  for each step:  hooks.before -> data -> step.train -> hooks.dispatched
                           -> (the oldest step's loss known) hooks.step(row) -> hooks.after
           at the end:     hooks.end (not after a Ctrl-C);  always: hooks.close

A hook passes itself in with `dpjax.train.run(settings, hooks=[MyHook()])` (or
`Trainer(settings).run(hooks=...)`); the built-in hooks run first, in the order of
`builtin.parts`, a run's own after them (before the evaluation, the checkpoint and the
timeline, so that a stop it asks for in `after` still saves this step).

    class EarlyStop(dpjax.train.Hook):
        def step(self, loop, row):         # every step's metrics row, in step order
            if row["loss"] < 1.0:
                loop.stop()                # this step finishes and is saved; the run ends "done"

What a hook may use of `loop` (`dpjax.train.loop.Loop`), and nothing else:

    loop.trainer        the `Trainer`: cfg, plan, mesh, model, layout, params, opt_state,
                        state(), start, cursor, step (the step's programs), step_for(setting),
                        batch(), say(line) -- the state, the plan and the streams
    loop.write(row)     a row to the metrics file (process 0; nothing without --metrics)
    loop.stop()         ends the run after the step under way (it finishes and is saved)
    loop.drain()        waits for the steps in flight, writing their rows
    loop.isolate(program=None, **tags)
                        from `before`: this step runs alone to its end (with `program`
                        instead of the trainer's step; `tags` into its row)
    loop.tag(**fields)  from `before`: fields into this step's metrics row
    loop.phase(name)    a host phase on the timeline (a context manager)
    loop.reset_clock()  what the hook just spent is not the next step's step_time
    loop.done           steps dispatched so far;  loop.stopping, loop.interrupted
    loop.in_flight      the steps dispatched whose rows are not written yet (`Flight`s)
    loop.args, loop.began   the arguments and start time of the step just dispatched
    loop.writers        the metrics writers (None: this process writes no rows)
    loop.eval_loss, loop.tokens_per_s   the last evaluation, the median speed
    loop.outcome        fields a hook adds to the run's summary (the checkpoints: `saved`)
"""

from __future__ import annotations


class Hook:
    """One part of a run, called at fixed points of each step; every method is optional
    (these do nothing). Steps are counted from 1, as the metrics rows count them. A hook
    stops the run with `loop.stop()`; an exception it raises ends the run (a
    `dpjax.errors.UserError` as one line, exit 2), every hook's `close` still called."""

    def start(self, loop) -> None:
        """Once, before the first step (the run record is the metrics file's first row)."""

    def before(self, loop, step: int) -> None:
        """Before step `step` reads its batch."""

    def dispatched(self, loop, flight) -> None:
        """Step `flight.step_i + 1` is dispatched and may still run on the devices:
        `flight.loss` is its loss as a device array, `flight.extra` the fields its metrics
        row will carry beside step, loss, step_time, tokens_per_s and lr."""

    def step(self, loop, row: dict) -> None:
        """A step's metrics row, once its loss is known: every step's, once, in step
        order (whether or not --metrics writes them)."""

    def after(self, loop, step: int) -> None:
        """Step `step`'s iteration is over (its row may be written later: a step or so
        stays in flight)."""

    def end(self, loop) -> None:
        """The run reached its last step (not after a Ctrl-C): every step's row is written."""

    def close(self, loop) -> None:
        """Always, last, in the reverse order of the hooks (also on an error's way out)."""


EVENTS = ("start", "before", "dispatched", "step", "after", "end")


class Hooks:
    """The hooks of a run, called in order: `hooks.step(loop, row)` calls every hook's
    `step`. `close` is not among the events: the loop registers each hook's close when the
    hook has started (`contextlib.ExitStack`: reversed, and every one called)."""

    def __init__(self, hooks):
        self.hooks = list(hooks)
        for h in self.hooks:
            if not isinstance(h, Hook):
                raise TypeError(f"a hook of dpjax.train is a dpjax.train.Hook subclass; got {type(h).__name__}")

    def __iter__(self):
        return iter(self.hooks)

    def __getattr__(self, event: str):
        if event not in EVENTS:
            raise AttributeError(event)

        def call(loop, *args):
            for h in self.hooks:
                getattr(h, event)(loop, *args)

        return call
