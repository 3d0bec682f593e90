"""One registry class for every "one file, one registration" list in dpjax.

The collective algorithms (`dpjax.collectives.registry`), the compression methods
(`dpjax.compression.registry`), the update rules (`dpjax.updates.registry`) and the
pipeline schedules (`dpjax.pipeline.SCHEDULES`) are each a `Registry`: a read-only
mapping from name to entry, in registration order, that a module adds itself to with
`register(entry)` and a test adds a toy to for a `with registered(entry):` block.

A flag names an entry with its number and options in one grammar, `name[:N][,key=VALUE]...`
(`--compression powersgd:4,start=100`, `--update sparse:8,outer=0.7`): `Spelling` cuts it
into its parts and checks the options' shape; each registry's own parser gives the parts
their meaning (`dpjax.compression.grammar`, `dpjax.updates.grammar`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Mapping, Generic[T]):
    """name -> entry (anything with a `name`). `kind` names the entries in messages
    ("collective algorithm"); `reserved` are names no entry may take (compression's
    "none"); `validate(entry)` raises for an entry that cannot be registered."""

    def __init__(self, kind: str, reserved: tuple = (), validate: Callable | None = None):
        self.kind, self.reserved, self._validate = kind, tuple(reserved), validate
        self._entries: dict[str, T] = {}

    def register(self, entry: T) -> T:
        """Adds `entry` under its name (a name is registered once: a second is a bug)."""
        if entry.name in self._entries or entry.name in self.reserved:
            raise ValueError(f"{self.kind} {entry.name!r} is registered already")
        if self._validate is not None:
            self._validate(entry)
        self._entries[entry.name] = entry
        return entry

    def unregister(self, name: str) -> T:
        """Removes the entry `name` and returns it."""
        return self._entries.pop(name)

    @contextlib.contextmanager
    def registered(self, entry: T):
        """`entry` registered for the duration of a `with` block (a test's toy)."""
        self.register(entry)
        try:
            yield entry
        finally:
            self.unregister(entry.name)

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"


@dataclass(frozen=True)
class Spelling:
    """`name[:N][,key=VALUE]...` in its parts: the entry's name, N as written (None when no
    ':' is written), and each option as (what was written, its key, its value; None when
    no '=' is)."""

    name: str
    number: str | None = None
    options: tuple[tuple[str, str, str | None], ...] = ()

    @classmethod
    def of(cls, text) -> "Spelling":
        head, *opts = [p.strip() for p in str(text).strip().split(",")]
        name, colon, number = head.partition(":")
        return cls(name, number if colon else None,
                   tuple((o, *((k.strip(), v.strip()) if eq else (o, None))) for o, (k, eq, v) in
                         ((o, o.partition("=")) for o in opts)))

    def given(self, keys, unknown: Callable, twice: Callable) -> dict[str, str]:
        """{key: value} of the options, each `key=VALUE` with a key in `keys`, once; else
        raises unknown(what was written) or twice(key), the parser's own one-line errors."""
        out: dict[str, str] = {}
        for written, key, value in self.options:
            if key not in keys or value is None:
                raise unknown(written)
            if key in out:
                raise twice(key)
            out[key] = value
        return out

    def __str__(self) -> str:
        head = self.name if self.number is None else f"{self.name}:{self.number}"
        return ",".join([head, *(w for w, _, _ in self.options)])
