"""The `--update` grammar: `name[:N][,key=VALUE]...` -> an `UpdateSpec` (what the rule
is, not how it runs), written as `--compression` is (`dpjax.registry.Spelling`). The
names, what N means, the options and the help text are the registered rules' own
(`registry.py`): 'sync', 'delayed:T', 'delayed-nocomp:T', 'sparse:P[,outer=LR]',
'async:TAU[,fetch=F][,push=Q]' as shipped."""

from __future__ import annotations

from dataclasses import dataclass

from dpjax.errors import UserError
from dpjax.registry import Spelling
from dpjax.updates import registry


@dataclass(frozen=True)
class UpdateSpec:
    """A parsed `--update` value. `n` is the rule's number: T (delayed), P (sparse) or
    TAU (async); the other fields are the options of the rules that have them."""

    kind: str = "sync"  # a registered rule's name
    n: int = 0
    outer_lr: float = 0.0  # sparse: 0 means a plain parameter average
    fetch: int = 1
    push: int = 1

    @property
    def is_sync(self) -> bool:
        """Whether this spec runs the sync program, bit for bit (delayed:0, sparse:1, ...)."""
        return _kind(self.kind).is_sync(self)

    def __str__(self) -> str:
        kind = _kind(self.kind)
        if kind.number is None:
            return kind.name
        defaults = UpdateSpec()
        opts = [f"{o.key}={getattr(self, o.field):g}" for o in kind.options
                if getattr(self, o.field) != getattr(defaults, o.field)]
        return ",".join([f"{kind.name}:{self.n}", *opts])


def _kind(name: str) -> registry.Kind:
    try:
        return registry.get(name)
    except KeyError:
        raise UserError(f"unknown update rule {name!r}; choose {_choices()}") from None


def _choices() -> str:
    usages = [k.usage for k in registry.kinds()]
    return ", ".join(usages[:-1]) + f" or {usages[-1]}" if len(usages) > 1 else "".join(usages)


def help_text() -> str:
    """The `--update` help: every registered rule's usage and what it does."""
    def usage(k):
        return k.usage + "".join(f"[,{o.key}={o.metavar}]" for o in k.options)

    return "how workers agree on an update: " + "; ".join(f"'{usage(k)}' ({k.help})" for k in registry.kinds())


def __getattr__(name: str):
    if name == "HELP":  # computed at each read, so it lists the rules registered by then
        return help_text()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_update(text: str) -> UpdateSpec:
    """'delayed:4' -> UpdateSpec('delayed', 4). Raises UserError (one line) for bad specs."""
    spelling = Spelling.of(text)
    name, num = spelling.name, spelling.number or ""

    def bad(why):
        return UserError(f"bad --update {text!r}: {why}")

    try:
        kind = registry.get(name)
    except KeyError:
        raise bad(f"choose {_choices()}") from None
    if kind.number is None:
        if num or spelling.options:
            raise bad(f"{name} takes no number and no options")
        return UpdateSpec(kind.name)
    try:
        n = int(num)
    except ValueError:
        n = kind.low - 1
    if n < kind.low:
        raise bad(f"{kind.number} must be an integer >= {kind.low}")
    fields = {}
    allowed = ", ".join(f"{o.key}=..." for o in kind.options) or "none"
    given = spelling.given({o.key for o in kind.options},
                           lambda opt: bad(f"unknown option {opt!r} (options of {name}: {allowed})"),
                           lambda key: bad(f"option {key!r} given twice"))
    for key, val in given.items():
        option = kind.option(key)
        try:
            value = option.convert(val)
        except ValueError:
            raise bad(f"option {option.key} needs a number, got {val!r}") from None
        if not option.valid(value):
            raise bad(f"option {option.key} must be {option.must}, got {val.strip()!r}")
        fields[option.field] = value
    return UpdateSpec(kind.name, n, **fields)


def make_rule(spec, inner, axis_name="data", *, seed: int = 0, optimizer=None, **exchange):
    """The rule a spec (an `UpdateSpec` or its text) names, wrapping the inner optimizer
    `inner`, between the workers that `axis_name` (one data axis or a tuple of them; ()
    for one worker) numbers, exchanging through `exchange=` (the run's `Exchange`) or the
    allreduce's keywords. optimizer: a `registry.Optimizer`; an optimizer that brings its
    own rule (`registry.for_optimizer`: 1-bit Adam) gets that rule whatever the spec (the
    plan lets only sync through). A rule that is not registered is a UserError."""
    s = parse_update(spec) if isinstance(spec, str) else spec
    own = registry.for_optimizer(optimizer.name) if optimizer is not None else None
    if own is not None:
        return own.build(s, inner, axis_name, seed=seed, optimizer=optimizer, **exchange)
    names = [k.name for k in registry.kinds()]
    if s.kind not in names:
        raise UserError(f"unknown update rule {s.kind!r}; choose one of {', '.join(names)}")
    return registry.get(s.kind).build(s, inner, axis_name, seed=seed, **exchange)
