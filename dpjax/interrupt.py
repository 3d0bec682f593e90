"""Ctrl-C in a `python -m dpjax.<tool>` process: one line and exit status 130, at any moment.

Two things stood in the way (issue 36):

- While XLA compiles, a Ctrl-C interrupts the Python call that waits for the compile, not
  the compile: it goes on in XLA's threads, and the interpreter's teardown under it ended
  the process with SIGSEGV (139) after the right message. Plain JAX does the same:
  `jax.jit(f)(x)` interrupted in its compile, the KeyboardInterrupt caught, then
  `sys.exit(130)`, segfaults on XLA:CPU (jax 0.10.2); with the compile left to finish first,
  it exits 130. So a process that was interrupted leaves with `os._exit` (`leave`), after
  flushing what it printed: nothing is left to tear down that matters (the run's files are
  closed by then, and a checkpoint save is waited for before).
- `python -m dpjax.train` imports the `dpjax` package before its `__main__` runs (about a
  second: JAX, optax, flax), outside any `try` of the tool's: a Ctrl-C there printed a
  traceback and ended the process by SIGINT, or was lost (an import that catches every
  exception took it, and the run trained on). `while_starting` (called first thing by
  `dpjax/__init__`) makes a Ctrl-C during that import end the process at once, one line
  and 130; `started` (called last) gives SIGINT back to Python, and a KeyboardInterrupt
  left uncaught before the tool's `__main__` runs is still one line.
"""

from __future__ import annotations

import os
import signal
import sys

STATUS = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C
# The line of a tool interrupted before it did anything (by the module `python -m` runs).
BEFORE = {"dpjax.train": "interrupted before training began: nothing was saved"}


# The SIGINTs a raising handler took and no caller has seen yet. Python prints and drops an
# exception raised inside a gc callback or a __del__ ("Exception ignored in: ..."), and a
# signal handler runs wherever the main thread is: a Ctrl-C during a compile landed in jax's
# `_xla_gc_callback` and the run trained on. `check()` raises it again from ordinary code.
# Process-wide, as signals are.
_ASKED: list = []


def raise_on_sigint(signum=None, frame=None):
    """Python's own SIGINT behaviour (a KeyboardInterrupt), remembered for `check()`."""
    _ASKED.append(signum)
    raise KeyboardInterrupt


def quiet_dropped() -> None:
    """Python's "Exception ignored in: ..." lines are left out for a KeyboardInterrupt that
    `check()` will raise again (the one line of a Ctrl-C stays one line). Once a process."""
    previous = sys.unraisablehook
    if getattr(previous, "dpjax_quiet", False):
        return

    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and _ASKED):
            previous(unraisable)

    hook.dpjax_quiet = True
    sys.unraisablehook = hook


def check() -> None:
    """Raises the KeyboardInterrupt of a SIGINT that `raise_on_sigint` took, if nothing has
    handled it yet (Python dropped it in a gc callback): call where a tool can stop."""
    if _ASKED:
        _ASKED.clear()
        raise KeyboardInterrupt


def leave(line: str | None = None, code: int = STATUS):
    """Prints `line` (to stderr), flushes both streams and ends the process now, without
    the interpreter's teardown (see the module docstring)."""
    if line:
        print(line, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def tool() -> str | None:
    """The module of `python -m MODULE` when it is one of dpjax's, else None."""
    argv = getattr(sys, "orig_argv", [])
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None
    return module if module and module.split(".")[0] == "dpjax" else None


def computes() -> bool:
    """Whether this process imports dpjax's API (and so JAX): every one but `python -m
    dpjax.agent`'s, which starts and watches processes and computes nothing (a lost host's
    restart starts a new agent, and JAX's import was 3-9 s of that restart at load)."""
    return tool() != "dpjax.agent"


def _starting() -> str | None:
    """The tool, while Python is still finding the `python -m dpjax.<tool>` this process
    runs (sys.argv[0] is "-m" until it is found: the imports of its packages), else None."""
    return tool() if sys.argv[:1] == ["-m"] else None


def _line(tool: str) -> str:
    return BEFORE.get(tool, f"interrupted: {tool} stopped before it began")


def _on_sigint_while_starting(signum, frame):
    leave(_line(tool() or "dpjax"))


def while_starting() -> None:
    """While `python -m dpjax.<tool>` imports its packages: a Ctrl-C ends the process at
    once (nothing has begun), and an uncaught KeyboardInterrupt is one line, status 130."""
    tool = _starting()
    if tool is None or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # e.g. started with SIGINT ignored (a background job of a script): left as it is
    signal.signal(signal.SIGINT, _on_sigint_while_starting)
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt) and _starting():  # not once the tool runs: its own
            leave(_line(tool))
        previous(kind, value, tb)

    sys.excepthook = hook


def started() -> None:
    """The package is imported: Ctrl-C raises KeyboardInterrupt again (the tool's own
    handling takes it from here)."""
    if signal.getsignal(signal.SIGINT) is _on_sigint_while_starting:
        signal.signal(signal.SIGINT, raise_on_sigint)
        quiet_dropped()
