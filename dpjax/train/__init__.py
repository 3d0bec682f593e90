"""`python -m dpjax.train`: train a byte-level model on a mesh, with data parallelism
over the data axes (`data`, `node`), tensor parallelism over `model`, pipeline stages
over `stage`, and any update rule between workers.

    python -m dpjax.train --mesh 2x4 --steps 200 --metrics run.jsonl

parse (`cli.py`, generated from `dpjax.settings.Settings`) -> plan (`dpjax.plan`) ->
loop (`trainer.py`'s `Trainer`, `loop.py`'s `Loop`: data -> step -> hooks).

From research code: `dpjax.train.run(settings, hooks=[...])` trains as the command line
does, calling each `Hook` (`dpjax.train.hooks`: every step's metrics row, a stop) beside
the built-in ones.
"""

from dpjax.settings import Settings
from dpjax.train.cli import build_parser, main, parse_args, summary_line
from dpjax.train.hooks import Hook
from dpjax.train.trainer import Trainer, run

__all__ = ["Hook", "Settings", "Trainer", "build_parser", "main", "parse_args", "run", "summary_line"]
