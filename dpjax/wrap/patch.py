"""One attribute of JAX's replaced while a dpjax trace runs, JAX's own put back after it.

`dpjax.wrap.constraints` (`jax.lax.with_sharding_constraint`) and `dpjax.wrap.draws`
(`jax.random.bernoulli`) read a user's call by the attribute it looks up at each call. A
`Patch` holds JAX's function (`original`), the replacement, and a context variable that says
what the trace running in *this* thread asked for (`active`; its default outside any trace,
where the replacement must call `original` unchanged). The attribute stays replaced while at
least one trace in any thread is inside `on` (a count under a lock), so that two threads
tracing at once do not put JAX's own back under each other.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any, Callable


class Patch:
    def __init__(self, owner, name: str, replacement: Callable, default: Any = None):
        self.owner, self.name, self.replacement = owner, name, replacement
        self.original = getattr(owner, name)
        self.active: contextvars.ContextVar = contextvars.ContextVar(f"dpjax_{name}", default=default)
        self._lock, self._depth = threading.Lock(), 0

    @contextlib.contextmanager
    def on(self, value):
        """While the block runs, `owner.name` is the replacement and `active` reads `value`."""
        token = self.active.set(value)
        with self._lock:
            self._depth += 1
            setattr(self.owner, self.name, self.replacement)
        try:
            yield
        finally:
            self.active.reset(token)
            with self._lock:
                self._depth -= 1
                if not self._depth:
                    setattr(self.owner, self.name, self.original)
