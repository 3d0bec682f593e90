"""Every process about to make the same collective call: checked through the
`jax.distributed` key-value store while a collective is traced."""

from __future__ import annotations

import os
import time

import jax
from jax._src import distributed as jax_distributed


def agree(what: str, fingerprint: str, timeout_s: float | None = None) -> None:
    """Checks that every process is about to make the same collective call.
    Called by every dpjax collective while it is traced (the first call of each
    compiled program), with a one-line description of what it will exchange (shape,
    dtype, axis, algorithm, op, root, groups, sizes). Processes that trace different
    calls would otherwise exchange garbage or wait on each other forever (a root one
    process does not know it is); here every process publishes its description in the
    `jax.distributed` key-value store under its next sequence number (a counter kept in
    that store, so the n-th call of each process pairs with the n-th of every other)
    and reads everyone else's: any difference is one ValueError on every process, and
    a process that never arrives is a TimeoutError naming the call after `timeout_s`
    (DPJAX_COLLECTIVE_TIMEOUT, default 300 s). One process: nothing to check.
    """
    seq, theirs = _exchange("agree", fingerprint, timeout_s,
                            lambda seq: f"{what} (collective call #{seq} of process {jax.process_index()})")
    for other, value in theirs.items():
        if value != fingerprint:
            raise ValueError(
                f"processes disagree on collective call #{seq}: process {jax.process_index()} has {fingerprint} but "
                f"process {other} has {value}; every process must make the same calls with the same shapes, dtypes "
                f"and arguments")


def every(what: str, mine: bool, timeout_s: float | None = None) -> bool:
    """Whether `mine` is true on every process (one process: `mine`): the n-th call of each process
    pairs with the n-th of every other, as `agree`'s. A choice that decides whether a process
    traces collectives (a compiled program loaded from disk rather than traced,
    `dpjax.recovery.programs`) is taken so by all processes alike, or `agree` would wait for
    processes that never trace."""
    _, theirs = _exchange("every", "1" if mine else "0", timeout_s, lambda seq: f"{what} (question #{seq})")
    return mine and all(v == "1" for v in theirs.values())


def _exchange(kind: str, value: str, timeout_s: float | None, naming) -> tuple[int, dict[int, str]]:
    """(this process's sequence number for `kind`, every other process's value under it), through
    the `jax.distributed` key-value store; {} for one process. A process that does not publish
    its value within `timeout_s` (DPJAX_COLLECTIVE_TIMEOUT, default 300 s) is a TimeoutError
    naming the call (`naming(seq)`)."""
    client = jax_distributed.global_state.client
    if jax.process_count() == 1 or client is None:
        return 0, {}
    timeout_s = float(os.environ.get("DPJAX_COLLECTIVE_TIMEOUT", 300)) if timeout_s is None else timeout_s
    me = jax.process_index()
    seq = client.key_value_increment(f"dpjax/{kind}/count/{me}", 1)
    client.key_value_set(f"dpjax/{kind}/{seq}/{me}", value)
    deadline, theirs = time.monotonic() + timeout_s, {}
    for other in range(jax.process_count()):
        if other == me:
            continue
        wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            theirs[other] = client.blocking_key_value_get(f"dpjax/{kind}/{seq}/{other}", wait_ms)
        except Exception:  # the client reports a deadline as an XlaRuntimeError
            raise TimeoutError(
                f"{naming(seq)}: process {other} did not reach it within {timeout_s:g} s; it is stuck, gone, or "
                "making other calls (DPJAX_COLLECTIVE_TIMEOUT)") from None
    return seq, theirs
