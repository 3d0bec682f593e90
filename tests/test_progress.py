"""The progress bar: before the first step's row it says what it waits for (the first
step compiles), not "loss nan 0 tok/s"; then the step's loss and tokens/s."""

from __future__ import annotations

import io

from rich.console import Console

from dpjax.train.progress import Progress


def shown(p: Progress) -> str:
    out = io.StringIO()
    Console(file=out, width=160).print(p.bar.make_tasks_table(p.bar.tasks))
    return out.getvalue()


def test_bar_says_it_is_compiling_until_the_first_row():
    p = Progress("bar", 20, 0)
    try:
        before = shown(p)
        assert "compiling the step..." in before and "nan" not in before and "0/20" in before
        p.update(0, 2.5, 1234.0)
        after = shown(p)
        assert "compiling" not in after and "loss 2.5000" in after and "1,234 tok/s" in after and "1/20" in after
    finally:
        p.close()
