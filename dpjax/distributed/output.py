"""What a launcher (`dpjax.launch`, `dpjax.agent`) shows of its processes' output.

Each line comes out prefixed with its rank. A launch of 8 processes printed 31 lines of
gloo's `[Gloo] Rank N is connected to M peer ranks` and, when a rank failed, about 90
lines of tracebacks (its own, and every survivor's transport error) above the one line
that said what happened. By default now the libraries' routine lines (`NOISE`) and the
bodies of tracebacks are left out: a traceback shows as its last line, the exception,
followed by where the whole of it is. Every line of a rank, shown or not, goes to its log
file (`log_dir()/rank<N>.log`); `--verbose` shows everything as before.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading

# What a healthy process's libraries print (gloo's connection report, glog INFO / WARNING
# lines): never the reason it died, so never shown by default, nor the line that blames it.
NOISE = re.compile(r"^\[Gloo\]|^[IW]\d{4} \d\d:\d\d:\d\d")
TRACEBACK = "Traceback (most recent call last):"
# the lines between two tracebacks of one chain ("During handling of the above exception ...")
CHAINED = re.compile(r"^(During handling of the above exception|The above exception was the direct cause)")


def log_dir(who: str, port) -> str:
    """Where a launch's rank logs go: the temporary folder's dpjax-<who>-<port> (one per
    launch or agent, as its coordinator or rendezvous port is)."""
    return os.path.join(tempfile.gettempdir(), f"dpjax-{who}-{port}-logs")


class RankOutput:
    """One stream of one rank: `line(text)` logs it and shows it (or not) on `out`."""
    def __init__(self, rank: int, out, lock: threading.Lock, log_dir: str, verbose: bool = False):
        self.rank, self.out, self.lock, self.verbose = rank, out, lock, verbose
        self.log_path = os.path.join(log_dir, f"rank{rank}.log")
        os.makedirs(log_dir, exist_ok=True)
        self.log = open(self.log_path, "a", buffering=1)
        self.in_traceback = False

    def shown(self, line: str) -> str | None:
        """What of `line` is shown (None: nothing): the exception that ends a traceback,
        with where the traceback is; no routine library line; nothing inside a traceback."""
        if self.verbose:
            return line
        text = line.rstrip("\n")
        if NOISE.match(text):
            return None
        if text.startswith(TRACEBACK) or CHAINED.match(text):
            self.in_traceback = True
            return None
        if self.in_traceback:
            if not text.strip() or text[:1].isspace():
                return None
            self.in_traceback = False  # the exception's line: what happened
            return f"{text} (its traceback: {self.log_path})\n"
        return line

    def line(self, line: str) -> None:
        self.log.write(line)
        show = self.shown(line)
        if show is not None:
            with self.lock:
                self.out.write(f"[{self.rank}] {show}")
                self.out.flush()

    def close(self) -> None:
        self.log.close()
