"""What a person watching a run sees: a rich bar on a terminal, log lines otherwise.

Until the first step's row comes the bar says what it waits for (the first step compiles,
for seconds to minutes) instead of a NaN loss at 0 tokens/s."""

from __future__ import annotations

import sys


WAITING = "compiling the step..."  # what the bar says before the first step's row


def figures(loss: float, tps: float) -> str:
    return f"loss {loss:.4f}  {tps:,.0f} tok/s"


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

    def update(self, step: int, loss: float, tps: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step + 1, figures=figures(loss, tps))
        elif self.mode == "log" and ((step + 1) % self.every == 0 or step + 1 == self.total):
            print(f"step {step + 1}/{self.total}  loss {loss:.4f}  {tps:,.0f} tok/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
