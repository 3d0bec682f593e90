"""How a `shard_step` call's arguments are bound, as `jax.jit` binds them: static arguments
(`static_argnums` / `static_argnames`), keyword arguments, donated arguments (`donate_argnums`
/ `donate_argnames`).

A step's program takes arrays only, by position. So each call is bound once against `fn`'s
signature (`Signature.bind`): a keyword argument for a positional parameter takes that
parameter's position (so `batch_argnums`, `in_specs` and `donate_argnums` name it either way,
as in `jax.jit`), a keyword-only one keeps its name, and static arguments leave the list:
their values are closed over by the function the program calls (`Bound.fn`) and are part of
the program's key, so another static value compiles another program, as `jax.jit` does. The
rest, the dynamic arguments, are what `dpjax.wrap.arguments` reads, in order; `Bound.names`
names each for messages and `Bound.dynamic` maps an argnums tuple to their positions.

As in `jax.jit`, `static_argnums` and `static_argnames` (and the donate pair) complete each
other through the signature: naming a positional parameter either way makes it static
however it is passed.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from dpjax.errors import UserError

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _names(x) -> tuple:
    return (x,) if isinstance(x, str) else tuple(x)


def _nums(x) -> tuple:
    return (x,) if isinstance(x, int) else tuple(x)


class Signature:
    """`fn`'s parameters and which of them are static or donated (both as jax.jit reads them)."""

    def __init__(self, fn, static_argnums=(), static_argnames=(), donate_argnums=(), donate_argnames=()):
        try:
            self.sig = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin or a callable without one: positions and names as given
            self.sig = None
        params = list(self.sig.parameters.values()) if self.sig else []
        self.positional = [p.name for p in params if p.kind in _POSITIONAL]
        self.static_nums, self.static_names = self._complete(_nums(static_argnums), _names(static_argnames))
        self.donate_nums, self.donate_names = self._complete(_nums(donate_argnums), _names(donate_argnames))

    def _complete(self, nums: tuple, names: tuple) -> tuple[set, set]:
        """(positions, names), each completed by the other through the signature."""
        nums = {n if n >= 0 else len(self.positional) + n for n in nums}
        names = set(names)
        names |= {self.positional[n] for n in nums if n < len(self.positional)}
        nums |= {self.positional.index(n) for n in names if n in self.positional}
        return nums, names

    def argname(self, i: int) -> str:
        return self.positional[i] if i < len(self.positional) else f"arg{i}"

    def bind(self, step: str, args: tuple, kwargs: dict) -> Bound:
        """One call's arguments bound (see the module docstring)."""
        if self.sig is not None:
            try:
                bound = self.sig.bind(*args, **kwargs)
            except TypeError as e:  # a missing or unexpected argument: Python's own words
                raise UserError(f"{step}: {e}") from None
            args, kwargs = bound.args, bound.kwargs
        slots = [(i, self.argname(i), x) for i, x in enumerate(args)]
        slots += [(self.positional.index(k) if k in self.positional else None, k, x) for k, x in kwargs.items()]
        static, dynamic = [], []
        for pos, name, x in slots:
            (static if pos in self.static_nums or name in self.static_names else dynamic).append((pos, name, x))
        for pos, name, x in static:
            try:
                hash(x)
            except TypeError:
                raise UserError(f"{step}: the static argument {name} is a {type(x).__name__}, which is not "
                                "hashable; a static argument keys the compiled program (as in jax.jit): pass a "
                                "hashable value (a tuple, a frozen dataclass) or make it a dynamic argument") from None
        npos = len(args)
        where = tuple((pos, name, pos is not None and pos < npos) for pos, name, _ in dynamic)
        statics = tuple((pos, name, pos is not None and pos < npos, x) for pos, name, x in static)
        donated = tuple(j for j, (pos, name, _) in enumerate(dynamic)
                        if pos in self.donate_nums or name in self.donate_names)
        return Bound(tuple(x for _, _, x in dynamic), where, statics, donated)


@dataclass(frozen=True)
class Bound:
    """A call bound: `args`, the dynamic arguments in order; `where`, for each, (its parameter's
    position or None, its name, passed by position); `statics`, the same for each static one
    with its value; `donated`, the positions in `args` of the donated ones."""

    args: tuple
    where: tuple
    statics: tuple
    donated: tuple

    @property
    def key(self) -> Any:
        """What besides the arrays decides the program: the call's form and its static values."""
        return self.where, self.statics

    def name(self, j: int) -> str:
        return self.where[j][1]

    def dynamic(self, argnums) -> tuple:
        """argnums (the parameters' positions, as the user gives them) as positions in `args`."""
        return tuple(j for j, (pos, _, _) in enumerate(self.where) if pos is not None and pos in argnums)

    def fn(self, fn: Callable) -> Callable:
        """`fn` called on the dynamic arguments alone: the static ones put back where they were
        passed, each argument by position or by name as the caller passed it."""
        slots = [(pos, name, by_pos, None, j) for j, (pos, name, by_pos) in enumerate(self.where)]
        slots += [(pos, name, by_pos, x, None) for pos, name, by_pos, x in self.statics]
        ordered = sorted((s for s in slots if s[2]), key=lambda s: s[0])
        named = [s for s in slots if not s[2]]

        def call(*dyn):
            value = lambda s: dyn[s[4]] if s[4] is not None else s[3]  # noqa: E731
            return fn(*[value(s) for s in ordered], **{s[1]: value(s) for s in named})

        return call
