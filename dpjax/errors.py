"""The one kind of error a command line prints as one line: bad input from its user.

Everything a user can get wrong (a flag, a mesh spec, a data path, a checkpoint, a
model option) raises a subclass of `UserError`; the CLIs print those as one line
and exit 2. Any other exception is a bug of ours and keeps its traceback. `UserError`
is a `ValueError`, so library callers that catch ValueError keep working.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from a user; the message says what is wrong and what to do instead."""


def os_error_line(e: OSError, out: str) -> str:
    """A failed read or write (a read-only or missing folder, a full disk) as one line:
    which file, and why; the temporary files a command writes through are named by the
    output they stand for."""
    where = e.filename if e.filename is not None else out
    if str(where).startswith(out):
        return f"cannot write {out}: {e.strerror or e}"
    return f"{where}: {e.strerror or e}"
