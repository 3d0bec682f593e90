"""One registry class for every "one file, one registration" list in dpjax.

The collective algorithms (`dpjax.collectives.registry`), the compression methods
(`dpjax.compression.registry`), the update rules (`dpjax.updates.registry`) and the
pipeline schedules (`dpjax.pipeline.SCHEDULES`) are each a `Registry`: a read-only
mapping from name to entry, in registration order, that a module adds itself to with
`register(entry)` and a test adds a toy to for a `with registered(entry):` block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
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
