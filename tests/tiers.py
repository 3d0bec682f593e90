"""Which tests the README's 10-minute command leaves to CI: the `extended` tier.

The suite has three tiers:

- quick (`-m "not slow and not extended"`): the README's test command, <= 10 minutes on a 2-core
  machine. It keeps at least one test of every behaviour: each collective on the mesh sizes that
  exercise its cases (even, odd, a power of two, one rank), each layout's equality with the
  unsharded model, each user error as a process.
- extended (`-m "extended and not slow"`): the wider sweeps of the same checks (every mesh size,
  every variant, every layout pair) and the runs that start processes or train for many steps.
  `.ci/run` runs them after the quick tier; they are the pre-tier suite less the quick tier.
- slow (`-m slow`, decorated in place): long runs that neither the README nor CI runs.

A test is extended when its node id matches a pattern below (fnmatch, on the id pytest prints).
Each pattern says why: what the quick tier still runs of the same behaviour. A pattern that
matches no test of a collected file stops the session (a renamed test must not drift back into,
or out of, the quick tier unnoticed). Chosen from each test's CPU seconds, as
`DPJAX_TEST_COSTS=FILE` in conftest.py records them.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

# (pattern, what the quick tier keeps of the behaviour)
EXTENDED: list[tuple[str, str]] = [
]


def extended(nodeid: str) -> str | None:
    """The first pattern `nodeid` matches, or None (a quick test)."""
    return next((p for p, _ in EXTENDED if fnmatchcase(nodeid, p)), None)


def stale(nodeids: list[str]) -> list[str]:
    """Patterns whose file was collected but that match none of its tests."""
    files = {n.split("::", 1)[0] for n in nodeids}
    return [p for p, _ in EXTENDED
            if p.split("::", 1)[0] in files and not any(fnmatchcase(n, p) for n in nodeids)]
