"""The reward of a GRPO run (--reward SPEC): a user's Python function of a completion.

    --reward mypackage.rewards:exact_match      a module on the Python path
    --reward path/to/rewards.py:exact_match     a file, imported as a module of its own

is called as `function(prompt, completion)`, or `function(prompt, completion, row)` when it
takes three arguments (`row`: the prompt's whole JSON row, e.g. an answer key in it), with
`prompt` the row's prompt as written (text or messages) and `completion` the sampled text up
to its end-of-turn token (not included). It returns a number. A spec that does not import, a
function that raises or returns something that is not a finite number: one line naming the
spec and the prompt's row, and the run stops (exit 2).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys

from dpjax.errors import UserError


class RewardError(UserError):
    """A reward that cannot be imported or called, or that returned no finite number."""


def load(spec: str):
    """(the function `spec` names, whether it takes the row as a third argument)."""
    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py") or os.sep in where:
            if not os.path.isfile(where):
                raise RewardError(f"--reward {spec}: no such file {where}")
            module_name = "dpjax_reward_" + os.path.splitext(os.path.basename(where))[0]
            found = importlib.util.spec_from_file_location(module_name, where)
            if found is None or found.loader is None:  # Python imports a .py file, not a .txt or a folder
                raise RewardError(f"--reward {spec}: {where} is not a Python file (path/to/rewards.py:function)")
            module = importlib.util.module_from_spec(found)
            sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except RewardError:
        raise
    except Exception as e:  # the user's module: whatever it raises while importing is theirs to fix
        raise RewardError(f"--reward {spec}: cannot import {where} ({type(e).__name__}: {e})") from None
    fn = vars(module).get(name)
    if not callable(fn):
        raise RewardError(f"--reward {spec}: {where} has no function {name!r}")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called with two arguments
        return fn, False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    with_row = len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise RewardError(f"--reward {spec}: {name} takes (prompt, completion[, row]); its signature is "
                          f"{inspect.signature(fn)}")
    return fn, with_row


class Reward:
    """--reward's function, called on each completion and checked."""

    def __init__(self, spec: str):
        self.spec = spec
        self.fn, self.with_row = load(spec)

    def __call__(self, prompt, completion: str, where: str) -> float:
        row = prompt.row
        args = (row["prompt"], completion, row) if self.with_row else (row["prompt"], completion)
        try:
            value = self.fn(*args)
        except Exception as e:  # the user's code: one line naming the row, not our traceback
            raise RewardError(f"--reward {self.spec} raised {type(e).__name__}: {e} on the prompt of {where} "
                              f"(completion {completion!r})") from None
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise RewardError(f"--reward {self.spec} returned {value!r}, not a number, on the prompt of {where}") \
                from None
        if not math.isfinite(value):
            raise RewardError(f"--reward {self.spec} returned {value} on the prompt of {where} (completion "
                              f"{completion!r}); a reward is a finite number")
        return value
