"""Where a run's metrics rows go: one small writer interface, JSON lines always when
`--metrics FILE` is given, TensorBoard event files when `--tensorboard DIR` is (through
tensorboardX, as MaxText and Levanter write them; imported only then), a Weights & Biases
run when `--wandb PROJECT` is (the `wandb` package, imported only then; `WANDB_MODE=offline`
writes the run under `WANDB_DIR` with no network, for `wandb sync` later).

A row is a flat dict with a `step` (the run record, `{"record": {...}}`, has none); the
TensorBoard writer logs its numbers as scalars at that step, named by group
(`train/loss`, `eval/eval_loss`, `efficiency/mfu`, ...), and the run record as text.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Protocol

from dpjax.errors import UserError


class MetricsError(UserError):
    """A metrics file the filesystem refuses (read-only, full): one line, the rows before it kept."""


class MissingPackage(UserError):
    """An optional package a flag needs is not installed; the message says how to install it."""


# The TensorBoard group of each scalar a row may carry (others go under "train").
GROUPS = {"eval_loss": "eval", "tflops_per_device": "efficiency", "mfu": "efficiency",
          "hw_tflops_per_device": "efficiency", "hfu": "efficiency", "peak_memory_bytes": "efficiency",
          "comm_bytes": "comm", "comm_fraction": "comm", "compression_ratio": "comm",
          # a mixture of experts' (dpjax.models.moe): each step's own (under train) and the validation batches'
          "eval_dropped": "eval", "eval_router_balance": "eval", "eval_router_z": "eval"}


class JsonLines:
    """One JSON object per line, line-buffered: each row is on disk as soon as it is
    known (`tail -f` works); appended to on a resumed run.

    `resumed_at`: a resumed run's steps done at its restore. The rows of later steps,
    which the run before wrote after its last save or commit and died, are removed (this
    run writes them again), and a loss row for a step the file still holds is not written
    twice (a restart writes the rows of the steps its commit held in flight, which the
    lost run may have written): every step has one row, however often the run resumed."""

    def __init__(self, path: str, append: bool, resumed_at: int | None = None):
        self.path, self.fh = path, None
        self.loss_steps: set[int] = set()
        with self._refused("opened"):
            if append and resumed_at is not None and os.path.isfile(path):
                self._keep_until(path, resumed_at)
            self.fh = open(path, "a" if append else "w", buffering=1)

    @contextlib.contextmanager
    def _refused(self, doing: str):
        """A write the filesystem refuses as one line (the rows written before it stay)."""
        try:
            yield
        except OSError as e:
            if self.fh is not None:
                try:
                    self.fh.close()
                except OSError:  # the same refusal, flushing what was left
                    pass
                self.fh = None
            raise MetricsError(f"--metrics {self.path} cannot be {doing} ({e.strerror or e}); "
                               "the rows before this one are in it") from None

    def _keep_until(self, path: str, step: int) -> None:
        with open(path) as fh:
            lines = fh.readlines()
        if lines and not lines[-1].endswith("\n"):
            lines.pop()  # the row a killed run was writing: cut short, not JSON
        kept = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                kept.append(line)  # not ours to judge: kept as it was
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                kept.append(line)  # the run record, events without a step
            elif row["step"] <= step:
                kept.append(line)
                if "loss" in row:
                    self.loss_steps.add(row["step"])
        if len(kept) != len(lines):
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as fh:
                fh.writelines(kept)
            os.replace(tmp, path)  # all of the old rows or the kept ones, never half

    def write(self, row: dict) -> None:
        if "loss" in row and "step" in row:
            if row["step"] in self.loss_steps:
                return
            self.loss_steps.add(row["step"])
        if self.fh is None:  # refused before: said once
            return
        with self._refused("written"):
            self.fh.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self.fh is not None:
            with self._refused("written"):
                self.fh.close()


class TensorBoard:
    """Event files in `logdir`, one scalar per number of a row (tensorboardX)."""

    def __init__(self, logdir: str):
        try:  # an optional dependency (dpjax[tensorboard]): imported only for --tensorboard
            from tensorboardX import SummaryWriter
        except ImportError:
            raise MissingPackage("--tensorboard needs tensorboardX: pip install tensorboardX "
                                 "(or pip install 'dpjax[tensorboard]')") from None
        self.writer = SummaryWriter(logdir=logdir)

    def write(self, row: dict) -> None:
        if "record" in row:  # the run record: settings, plan, devices, versions, commit
            self.writer.add_text("run_record", "```\n" + json.dumps(row["record"], indent=1) + "\n```", 0)
            return
        step = row.get("step")
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{GROUPS.get(key, 'train')}/{key}", value, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A Weights & Biases run in `project`: the run record's settings as its config, each
    row's numbers logged at the row's step under the TensorBoard writer's group names."""

    def __init__(self, project: str):
        try:  # an optional dependency (dpjax[wandb]): imported only for --wandb
            import wandb
        except ImportError:
            raise MissingPackage("--wandb needs wandb: pip install wandb (or pip install 'dpjax[wandb]')") from None
        self.run = wandb.init(project=project)

    def write(self, row: dict) -> None:
        if "record" in row:
            record = row["record"]
            self.run.config.update({"settings": record.get("settings", {}), "plan": record.get("plan", {})},
                                   allow_val_change=True)
            return
        numbers = {f"{GROUPS.get(k, 'train')}/{k}": v for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers:
            self.run.log(numbers, step=row.get("step"))

    def close(self) -> None:
        self.run.finish()


class Writer(Protocol):
    """What a writer of rows has (JsonLines, TensorBoard, WandB)."""

    def write(self, row: dict) -> None: ...

    def close(self) -> None: ...


class Writers:
    """Every writer a run asked for, written to and closed together."""

    def __init__(self, writers: list[Writer]):
        self.writers = writers

    def write(self, row: dict) -> None:
        for w in self.writers:
            w.write(row)

    def close(self) -> None:
        for w in self.writers:
            w.close()

    def __bool__(self) -> bool:
        return bool(self.writers)


def open_writers(metrics: str | None, tensorboard: str | None, append: bool = False,
                 resumed_at: int | None = None, wandb: str | None = None) -> Writers:
    """The writers of `--metrics FILE`, `--tensorboard DIR` and `--wandb PROJECT` (any may be
    None); `resumed_at`: see `JsonLines`."""
    out: list[Writer] = []
    if tensorboard:
        out.append(TensorBoard(tensorboard))
    if wandb:
        out.append(WandB(wandb))
    if metrics:
        out.append(JsonLines(metrics, append, resumed_at))
    return Writers(out)
