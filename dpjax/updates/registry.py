"""The update rules by name, each with its `--update` grammar: one registration per rule.

A rule's module ends with `register(Kind(...))`: its name, what its number means and
its lower bound, its options, its help text, when a spec of it is the sync program,
and `build(spec, inner, axis_name, seed=, **allreduce) -> UpdateRule`. The grammar
(`grammar.parse_update`, `HELP`, `UpdateSpec.is_sync`, `make_rule`) reads them
from here, so no list of rule names is kept anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from dpjax.registry import Registry


@dataclass(frozen=True)
class Option:
    """An option `key=VALUE` of a rule, stored in the `UpdateSpec` field `field`."""

    key: str
    field: str
    metavar: str
    convert: Callable  # str -> value (ValueError for a bad one)
    valid: Callable  # value -> bool
    must: str  # what a valid value is, for the error ("positive")


@dataclass(frozen=True)
class Kind:
    """One rule as `--update` names it: `name[:N][,key=VALUE]...`.

    number: what N means ("the delay T"; its last word is N's letter in the help), None
    for a rule that takes no number (sync); low: N's lower bound; help: what the rule
    does, in a few words; is_sync(spec): whether the spec runs the sync program, bit for
    bit (the factories return `sync(...)` then); build(spec, inner, axis_name, *, seed,
    **allreduce) -> UpdateRule; period(spec): the steps between the workers' exchanges
    (1: every step; what a compression's start=S counts in, for the metrics' comm_bytes).
    """

    name: str
    help: str
    build: Callable
    is_sync: Callable
    number: str | None = None
    low: int = 0
    options: tuple[Option, ...] = field(default_factory=tuple)
    period: Callable = lambda spec: 1

    @property
    def usage(self) -> str:
        """'sparse:P', 'sync': the spec without its options."""
        return self.name if self.number is None else f"{self.name}:{self.number.split()[-1]}"

    def option(self, key: str) -> Option | None:
        return next((o for o in self.options if o.key == key), None)


_KINDS: Registry[Kind] = Registry("update rule")
register, unregister, registered = _KINDS.register, _KINDS.unregister, _KINDS.registered


def get(name: str) -> Kind:
    """The rule `name`; KeyError if there is none."""
    return _KINDS[name]


def kinds() -> tuple[Kind, ...]:
    """Every registered rule, in registration order."""
    return tuple(_KINDS.values())
