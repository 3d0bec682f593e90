"""The update rules by name, each with its `--update` grammar: one registration per rule.

A rule's module ends with `register(Kind(...))`: its name, what its number means and
its lower bound, its options, its help text, when a spec of it is the sync program,
and `build(spec, inner, axis_name, seed=, exchange=) -> UpdateRule`. The grammar
(`grammar.parse_update`, `HELP`, `UpdateSpec.is_sync`, `make_rule`) reads them
from here, so no list of rule names is kept anywhere else. A rule that an optimizer
brings with it (1-bit Adam: `--optimizer onebit_adam` owns the exchange between
workers) registers the same way, marked `chosen_by_optimizer`: `make_rule` finds it by
the optimizer's name (`for_optimizer`), and `--update` does not name it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

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
    exchange) -> UpdateRule (exchange: the run's `dpjax.compression.exchange.Exchange`);
    chosen_by_optimizer: the rule of the `--optimizer` of its name, not an `--update`
    name (its build takes `optimizer=`, an `Optimizer`, too); period(spec): the steps between the workers' exchanges
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
    chosen_by_optimizer: bool = False

    @property
    def usage(self) -> str:
        """'sparse:P', 'sync': the spec without its options."""
        return self.name if self.number is None else f"{self.name}:{self.number.split()[-1]}"

    def option(self, key: str) -> Option | None:
        return next((o for o in self.options if o.key == key), None)


@dataclass(frozen=True)
class Optimizer:
    """What a rule chosen by its optimizer builds from: the optimizer's settings (a
    `dpjax.optim.OptimizerConfig`: its name, clipping, schedule, weight decay), the batch
    its schedule is for (micro-batches included), the parameters' specs its clipping
    reads, and Adam's b1, b2, eps (`dpjax.optim.ADAM_*`: optim is this package's
    neighbour, so the plan passes them)."""

    config: Any
    global_batch: int
    specs: Any
    b1: float
    b2: float
    eps: float

    @property
    def name(self) -> str:
        return self.config.name


_KINDS: Registry[Kind] = Registry("update rule")
_BY_OPTIMIZER: Registry[Kind] = Registry("optimizer's own rule")
unregister, registered = _KINDS.unregister, _KINDS.registered


def register(kind: Kind) -> Kind:
    """Adds a rule: an `--update` name, or the rule of the optimizer of its name."""
    return (_BY_OPTIMIZER if kind.chosen_by_optimizer else _KINDS).register(kind)


def for_optimizer(name) -> Kind | None:
    """The rule the optimizer `name` brings with it (1-bit Adam's), None for one that brings none."""
    return _BY_OPTIMIZER.get(name)


def get(name: str) -> Kind:
    """The rule `name`; KeyError if there is none."""
    return _KINDS[name]


def kinds() -> tuple[Kind, ...]:
    """Every registered rule, in registration order."""
    return tuple(_KINDS.values())
