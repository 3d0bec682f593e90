"""What a person watching a run sees: a rich bar on a terminal, log lines otherwise.

Until the first step's row comes the bar says what it waits for (the first step compiles,
for seconds to minutes) instead of a NaN loss at 0 tokens/s."""

from __future__ import annotations

import sys


WAITING = "compiling the step..."  # what the bar says before the first step's row
# A task's own figures in a step's row that tell whether it learns (TRL's console shows them beside the
# loss): GRPO's mean reward (its loss sits near 0 whatever the rewards), DPO's accuracy and margin.
WATCHED = ("reward", "accuracy", "margin")


def figures(loss: float, tps: float, row: dict | None = None) -> str:
    own = "".join(f"  {k} {row[k]:.4f}" for k in WATCHED if row is not None and k in row)
    return f"loss {loss:.4f}{own}  {tps:,.0f} tok/s"


class Progress:
    """A rich bar on a terminal; otherwise a log line every ~10% of the run."""

    def __init__(self, mode: str, total: int, start: int):
        self.mode = ("bar" if sys.stdout.isatty() else "log") if mode == "auto" else mode
        self.total, self.every = total, max(1, (total - start) // 10)
        self.bar = None
        if self.mode == "bar":
            # imported here: rich.progress costs every start ~0.1-0.4 s, and only a terminal's bar uses it
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                                       TimeRemainingColumn)

            self.bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[figures]}"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total, completed=start, figures=WAITING)
            self.bar.start()

    def update(self, step: int, loss: float, tps: float, row: dict | None = None) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step + 1, figures=figures(loss, tps, row))
        elif self.mode == "log" and ((step + 1) % self.every == 0 or step + 1 == self.total):
            print(f"step {step + 1}/{self.total}  {figures(loss, tps, row)}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
