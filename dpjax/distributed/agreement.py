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


    client = jax_distributed.global_state.client
    if jax.process_count() == 1 or client is None:
        return
    timeout_s = float(os.environ.get("DPJAX_COLLECTIVE_TIMEOUT", 300)) if timeout_s is None else timeout_s
    me = jax.process_index()
    seq = client.key_value_increment(f"dpjax/agree/count/{me}", 1)
    client.key_value_set(f"dpjax/agree/{seq}/{me}", fingerprint)
    deadline = time.monotonic() + timeout_s
    for other in range(jax.process_count()):
        if other == me:
            continue
        wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            theirs = client.blocking_key_value_get(f"dpjax/agree/{seq}/{other}", wait_ms)
        except Exception:  # the client reports a deadline as an XlaRuntimeError
            raise TimeoutError(
                f"{what} (collective call #{seq} of process {me}): process {other} did not reach it within "
                f"{timeout_s:g} s; it is stuck, gone, or making other calls (DPJAX_COLLECTIVE_TIMEOUT)") from None
        if theirs != fingerprint:
            raise ValueError(
                f"processes disagree on collective call #{seq}: process {me} has {fingerprint} but process "
                f"{other} has {theirs}; every process must make the same calls with the same shapes, dtypes "
                f"and arguments")
