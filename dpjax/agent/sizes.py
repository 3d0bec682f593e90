"""Which size a restart runs at: the most processes the agents can form from the hosts
that are left whose devices can hold the run (its mesh and its global batch), checked
without starting a process (`dpjax.plan.fit_devices` is device-free).

Every live host takes part (its commits are restored from its folder) and runs the same
number of processes, K, K-1, ..., 1, so the sizes tried are hosts x k, largest first; a
size that cannot hold the run is skipped with a line saying why. The size the user's
mesh names is never second-guessed (its processes report their own errors), nor is a
command other than `python -m dpjax.train` (its settings are not known here): those run
with every process.
"""

from __future__ import annotations

from dpjax.errors import UserError


class NoSize(UserError):
    """No size the agents can form holds the run; the message lists why, size by size."""


def train_settings(command: list[str]):
    """The `dpjax.train` Settings of a command (`... -m dpjax.train FLAGS`), or None for
    another command or flags that do not parse (its processes will say what is wrong)."""
    for i, word in enumerate(command[:-1]):
        if word == "-m" and command[i + 1] in ("dpjax.train", "dpjax.train.cli"):
            from dpjax.train.cli import parse_args  # JAX: the agent imports it here, once its first round trains

            try:
                return parse_args(command[i + 2:])
            except (SystemExit, UserError):
                return None
    return None


def choose(settings, hosts: int, nproc: int, devices_per_process: int | None) -> tuple[int, list[str]]:
    """(processes per host, the sizes skipped with why) for a round of `hosts` hosts that
    can run up to `nproc` processes each. Raises NoSize when no size holds the run."""
    if settings is None or not devices_per_process:
        return nproc, []
    from dpjax.plan import fit_devices  # imported by train_settings already
    skipped = []
    for k in range(nproc, 0, -1):
        devices = hosts * k * devices_per_process
        try:
            fit_devices(settings, devices)
            return k, skipped
        except UserError as e:
            skipped.append(f"{hosts * k} processes ({devices} devices): {e}")
    raise NoSize("no size the agents can form holds the run: " + "; ".join(skipped))
