"""`python -m dpjax.train`: parse, plan, loop (nanodo's thin main).

The command line is generated from `dpjax.settings.Settings`; its choices and help read
the registries (algorithms, schedules, compressions, update rules, models). User errors
(`dpjax.errors.UserError`) are one line and exit 2; anything else is a bug of ours and
keeps its traceback (`DPJAX_DEBUG=1` shows the traceback of user errors too).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import sys
from typing import Callable

import jax

from dpjax import distributed
from dpjax.errors import UserError
from dpjax.plan import flag
from dpjax.settings import TOPICS, Settings
from dpjax.train.efficiency import describe
from dpjax.models import model_options, option_types
from dpjax.train.record import load_config
from dpjax.train.resume import interrupted
from dpjax.train.trl_names import dpjax_name
from dpjax.train.trainer import dry_run, run

DESCRIPTION = ("Train a byte-level GPT, a Llama-family model or an MLP on a device mesh, with data parallelism "
               "over the data axes (gradients averaged by dpjax's explicit collectives in fused buckets), "
               "Megatron-style tensor parallelism over the model axis (each device holds 1/n of every large layer), "
               "pipeline stages over a stage axis, "
               "and an update rule between workers (sync, delayed, sparse/local SGD/DiLoCo, async). On a CPU-only "
               "machine the devices the mesh needs are simulated.")

MODEL_OPTION_HELP = {"d_model": "model width", "n_layers": "transformer blocks", "n_heads": "attention heads",
                     "d_ff": "MLP width", "context": "bytes of context each position sees",
                     "d_embed": "byte embedding width", "d_hidden": "hidden units",
                     "n_kv_heads": "key/value heads (grouped-query attention)", "rope_theta": "rotary base",
                     "norm_eps": "RMSNorm epsilon", "tie_embeddings": "output head = embedding table (true/false)",
                     "moe": "a mixture's form: capacity (choices past --capacity-factor's slots dropped) or "
                            "dropless (none dropped: sorted rows, grouped matmul)"}


def _resolved(value):
    return value() if callable(value) else value


def _mib(text: str):
    """--fusion-mb: MiB, or 'auto'."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB or auto, got {text!r}") from None


def _switch(text: str) -> bool:
    """A model's yes/no option (--tie-embeddings true): bool('false') would be True."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class ArgumentError(UserError):
    """A command line argparse cannot read: printed as one line, like every user error."""


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line naming the closest flag or value (a typo is the
    usual cause), not the usage of 60 flags followed by the error."""

    def error(self, message: str):
        raise ArgumentError(self.explain(message))

    def explain(self, message: str) -> str:
        """argparse's message, with the nearest flag for an unknown one and the nearest
        choice for a value not among them."""
        if message.startswith("unrecognized arguments: "):
            words = message[len("unrecognized arguments: "):].split()
            flags = [w for w in words if w.startswith("-")]
            if not flags:
                return f"unexpected argument {words[0]!r} (every setting is a --flag; see --help)"
            wrong = flags[0].split("=")[0]
            known = [o for o in self._option_string_actions if o.startswith("--")]
            return f"unknown flag {wrong}" + (dpjax_name(wrong) or _did_you_mean(
                wrong, known, " (python -m dpjax.train --help lists them)"))
        choice = re.match(r"argument (\S+): invalid choice: (['\"]?)(.*?)\2 \(choose from", message)
        if choice:
            action = self._option_string_actions.get(choice.group(1).split("/")[0])
            known = [str(c) for c in (action.choices or ())] if action else []
            return (f"{choice.group(1)}: unknown value {choice.group(3)!r}; choose one of {', '.join(known)}"
                    + _did_you_mean(choice.group(3), known))
        return message.removeprefix("argument ")


def _did_you_mean(word: str, known, otherwise: str = "") -> str:
    close = difflib.get_close_matches(word, known, n=1)
    return f"; did you mean {close[0]}?" if close else otherwise


class HelpFormatter(argparse.HelpFormatter):
    """Each default said once: "(default: X)" is added only where the help does not say
    its default already and there is one to say (not None, not a switch that is off)."""

    def _get_help_string(self, action):
        help_ = action.help or ""
        if "default" in help_.lower() or action.default in (None, False, [], argparse.SUPPRESS):
            return help_
        return help_ + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m dpjax.train", description=DESCRIPTION, formatter_class=HelpFormatter)
    p.add_argument("--config", metavar="FILE", help="settings from a TOML or JSON file (Settings fields by name; a "
                   "run's record, run.json or its metrics file, repeats that run); flags given as well override it")
    groups = {topic: p.add_argument_group(topic) for topic in TOPICS}
    for f in dataclasses.fields(Settings):
        if f.name == "model_options":
            continue
        g, help_ = groups[f.metadata["topic"]], _resolved(f.metadata["help"])
        if f.type in ("bool", bool):
            g.add_argument(flag(f.name), action="store_true", help=help_)
        elif f.metadata.get("action") == "append":
            g.add_argument(flag(f.name), action="append", default=f.default, help=help_, metavar="AXIS=LAT,BW")
        else:
            kinds: dict[str, Callable[[str], object]] = {"int": int, "int | None": int, "float": float,
                                                         "float | None": float, "mib": _mib}
            kind = kinds.get(f.metadata.get("type") or str(f.type), str)
            g.add_argument(flag(f.name), type=kind, default=f.default, help=help_,
                           choices=_resolved(f.metadata.get("choices")))
    g = p.add_argument_group("model options (each belongs to one model; an option the chosen --model does "
                             "not have is an error)")
    types = option_types()  # each option parses as its config field's type
    owners: dict[str, dict[str, object]] = {}
    for model, opts in model_options().items():
        for name, default in opts.items():  # an option two models share is one flag
            owners.setdefault(name, {})[model] = default
    taken = {f.name for f in dataclasses.fields(Settings)}
    for name, defaults in owners.items():
        if name in taken:  # argparse would stop every command line with a conflict traceback
            raise UserError(f"model {', '.join(defaults)}: its config field {name!r} has the name of the run's "
                            f"setting {flag(name)}; rename the field")
        same = len(set(map(str, defaults.values()))) == 1
        default = next(iter(defaults.values())) if same else ", ".join(f"{m} {d}" for m, d in defaults.items())
        g.add_argument(flag(name), type=_switch if types[name] is bool else types[name], default=argparse.SUPPRESS,
                       dest=f"model_{name}", metavar="B" if types[name] is bool else "N",
                       help=f"{', '.join(defaults)}: {MODEL_OPTION_HELP.get(name, name)} (default: {default})")
    return p


def parse_args(argv=None) -> Settings:
    """The settings of a command line: the defaults, then a --config file's values, then
    the flags given. Raises ConfigError (one line) for a config file it cannot use."""
    parser = build_parser()
    config = parser.parse_known_args(argv)[0].config
    if config:
        values = load_config(config)
        opts = values.pop("model_options")
        parser.set_defaults(**values, **{f"model_{k}": v for k, v in opts.items()})
    ns = vars(parser.parse_args(argv))
    ns.pop("config")
    opts = {k[len("model_"):]: ns.pop(k) for k in list(ns) if k.startswith("model_")}
    return Settings(**ns, model_options=opts)


def summary_line(s: dict) -> str:
    ev = "n/a" if s["eval_loss"] is None else f"{s['eval_loss']:.4f}"
    positional = tuple(s["mesh"]) in (("data", "model"), ("node", "data", "model"))
    mesh = ("x" if positional else ",").join(str(v) if positional else f"{k}={v}" for k, v in s["mesh"].items())
    head = "interrupted" if s["interrupted"] else "done"
    eff = describe(s.get("efficiency") or {})
    return (f"{head}: {s['steps']} steps on mesh {mesh}, train loss {s['loss']:.4f}, eval loss {ev}, "
            f"{s['tokens_per_s']:,.0f} tokens/s, " + (f"{eff}, " if eff else "") + f"{s['seconds']:.1f} s")


def main(argv=None) -> int:
    """The command line's exit status: 0 done, 2 a user error (one line), 130 interrupted
    by Ctrl-C in the loop. A Ctrl-C before the loop (starting, compiling) raises
    KeyboardInterrupt: `python -m dpjax.train` (`__main__`) makes it one line and 130."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        settings = parse_args(argv)
        if settings.dry_run:
            return dry_run(settings)
        summary = run(settings)
    except UserError as e:  # usage, data, checkpoint, mesh, model options, a NaN loss: one line
        if os.environ.get("DPJAX_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return distributed.leave_now(2)  # one process of several: not via the shutdown barrier
    if jax.process_index() == 0:  # one job, one summary (every process has the same)
        line = summary_line(summary)
        if summary["interrupted"]:  # where it saved and how to go on: the last thing the user reads
            line += "; " + interrupted(settings, summary["saved"], argv)
        print(line, flush=True)
    return distributed.leave_now(130) if summary["interrupted"] else 0  # mpi ends a process with 0 at exit
