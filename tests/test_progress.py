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


def test_log_lines_show_the_task_s_own_figures(capsys):
    """GRPO's loss sits near 0 whatever the rewards, so its line shows the mean reward (DPO's: accuracy and
    margin), as TRL's console does; a run without them (lm, sft) keeps the plain line."""
    p = Progress("log", 3, 0)
    p.update(0, 2.5, 1234.0, {"step": 1, "loss": 2.5, "cursor": 8})
    p.update(1, 2.3e-7, 1000.0, {"step": 2, "loss": 2.3e-7, "reward": 0.25, "kl": 5e-6, "clip_fraction": 0.0})
    p.update(2, 0.6931, 99.0, {"step": 3, "loss": 0.6931, "reward_chosen": 0.0125, "margin": -0.0125,
                               "accuracy": 0.375})
    assert capsys.readouterr().out.splitlines() == [
        "step 1/3  loss 2.5000  1,234 tok/s",
        "step 2/3  loss 0.0000  reward 0.2500  1,000 tok/s",
        "step 3/3  loss 0.6931  accuracy 0.3750  margin -0.0125  99 tok/s"]
