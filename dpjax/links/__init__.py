"""Emulated slow links on a mesh axis: real training, with the wire's time made up.

`--link node=183ms,23mbit` says that every message crossing the `node` axis (between
two ranks whose `node` coordinates differ) travels over a link with that latency and
bandwidth. On one machine every link is fast, so the program runs as it always does
and computes exactly the same values; only time changes. Every dpjax collective (and
every pipeline send, `collectives.p2p.send`) is a sequence of point-to-point steps
(`collectives.ranks.permute`); while a step is traced the emulator notes, for each
step whose pairs cross a linked axis, the latency and the
bytes the busiest device sends over it (Hockney's alpha-beta model, as
`collectives.cost` computes for whole algorithms). When the collective has been traced,
two host callbacks are compiled around it:

    issue  when its input is ready: the host clock computes when it would finish,
           t + sum of latencies + bytes / bandwidth (t: when the first device issued
           this call; see `Clock`), where the bytes wait behind the
           transfers this device already has in flight on the wire (one queue per
           device: its bandwidth is shared, its latencies overlap);
    wait   where its result is consumed: sleep until that time (no sleep if it is past;
           on a `VirtualTime` clock no sleep at all, the clock moves to that time).

A synchronous collective waits at once, so the step blocks as it would on that network.
An update rule that consumes a result later (delayed:T reads step i's average at step
i+T) opens `deferred()` around the exchange and calls `wait_deferred` where it reads
the value: meanwhile the transfer is in flight while later steps
compute, as on a real network with communication on its own stream. Without links no
callback is compiled in, and the step is the step it always was.

What is emulated: the wire (latency, bandwidth, queueing on a device's link). What is
real: everything else (the computation, the collectives' own cost on this machine, the
Python loop, checkpoints). XLA's own collectives (`lax.psum`) are charged only where a
dpjax collective calls them (`account_xla`, the `psum` algorithm).

    grammar    `parse_link`, `AxisLink`: the `--link` flag
    clock      `Clock`: each device's wire as a queue; a time source (`RealTime`, or
               `VirtualTime` to account without sleeping)
    emulator   `Emulator`, `timed`, `account`, `account_xla`, `deferred`, `wait_deferred`:
               the trace-time accounting and the host callbacks
"""

from dpjax.links.clock import Clock, RealTime, VirtualTime
from dpjax.links.emulator import Emulator, account, account_xla, deferred, timed, wait, wait_deferred
from dpjax.links.grammar import AxisLink, parse_link

__all__ = ["AxisLink", "Clock", "Emulator", "RealTime", "VirtualTime", "account", "account_xla", "deferred",
           "parse_link", "timed", "wait", "wait_deferred"]
