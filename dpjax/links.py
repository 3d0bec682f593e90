"""Emulated slow links on a mesh axis: real training, with the wire's time made up.

`--link node=183ms,23mbit` says that every message crossing the `node` axis (between
two ranks whose `node` coordinates differ) travels over a link with that latency and
bandwidth. On one machine every link is fast, so the program runs as it always does
and computes exactly the same values; only time changes. Every dpjax collective is a
sequence of point-to-point steps (`collectives._common.permute`); while a step is traced
this module notes, for each step whose pairs cross a linked axis, the latency and the
bytes the busiest device sends over it (Hockney's alpha-beta model, as
`collectives.cost` computes for whole algorithms). When the collective has been traced,
two host callbacks are compiled around it:

    issue  when its input is ready: the host clock computes when it would finish,
           t + sum of latencies + bytes / bandwidth (t: when the first device issued
           this call; see `Clock`), where the bytes wait behind the
           transfers this device already has in flight on the wire (one queue per
           device: its bandwidth is shared, its latencies overlap);
    wait   where its result is consumed: sleep until that time (no sleep if it is past).

A synchronous collective waits at once, so the step blocks as it would on that network.
An update rule that consumes a result later (delayed:T reads step i's average at step
i+T) opens `deferred()` around the exchange, stores the ticket with the value and calls
`wait` where it reads it: meanwhile the transfer is in flight while later steps
compute, as on a real network with communication on its own stream. Without links no
callback is compiled in, and the step is the step it always was.

What is emulated: the wire (latency, bandwidth, queueing on a device's link). What is
real: everything else (the computation, the collectives' own cost on this machine, the
Python loop, checkpoints).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import re
import threading
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from dpjax.errors import UserError

_LATENCY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_BANDWIDTH_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
                    "bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8,
                    "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z/]+)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class AxisLink:
    """The link every message crossing mesh axis `axis` travels over."""

    axis: str
    latency: float  # seconds per message
    bandwidth: float  # bytes per second

    def __str__(self) -> str:
        return f"{self.axis}={self.latency * 1e3:g}ms,{self.bandwidth * 8 / 1e6:g}mbit"


def parse_link(text: str) -> AxisLink:
    """'node=183ms,23mbit' -> AxisLink('node', 0.183, 2.875e6). Latency in s, ms or us;
    bandwidth in bit, kbit, mbit, gbit (or bps ... gbps: bits per second) or B/s ... GB/s.
    Raises UserError (one line) for anything else."""
    def bad(why):
        return UserError(f"bad --link {text!r}: {why}; write e.g. node=183ms,23mbit")

    axis, eq, rest = str(text).partition("=")
    parts = [p.strip() for p in rest.split(",")]
    if not eq or not axis.strip() or len(parts) != 2:
        raise bad("expected AXIS=LATENCY,BANDWIDTH")

    def value(part, units, what):
        m = _NUMBER_UNIT.match(part)
        if not m or m.group(2).lower() not in units:
            raise bad(f"{what} {part!r} needs a number and a unit ({', '.join(units)})")
        return float(m.group(1)) * units[m.group(2).lower()]

    latency = value(parts[0], _LATENCY_UNITS, "latency")
    bandwidth = value(parts[1], _BANDWIDTH_UNITS, "bandwidth")
    if bandwidth <= 0:
        raise bad("the bandwidth must be positive")
    return AxisLink(axis.strip(), latency, bandwidth)


class Clock:
    """When each device's emulated transfers finish (host side, one per emulator).

    A device's wire is a queue: a transfer's bytes start when the bytes before them have
    left (`busy`) and take bytes / bandwidth; its latencies then add (they overlap with
    other transfers'). Tickets are small ints that name a finish time.

    One call of a collective is issued by every device (`devices` of them), each when
    its own input is ready. The call's transfers start when the first device issues it:
    on this machine the devices are threads that take turns on a few cores, and a device
    whose thread is held up (e.g. behind the other devices' sleeping waits; the runtime
    has a bounded pool) would otherwise start its transfer, and so the step's end, one
    whole transfer late. `site` names the call in the program; the n-th issue of a site
    by a device belongs to the site's n-th call."""

    def __init__(self, devices: int = 1):
        self._lock = threading.Lock()
        self._busy: dict[int, float] = {}
        self._done: dict[int, float] = {}
        self._ids = itertools.count(1)
        self._devices = devices
        self._calls: dict[tuple, int] = {}  # (site, device) -> calls issued
        self._first: dict[tuple, list] = {}  # (site, call) -> [first issue time, devices issued]

    def issue(self, device: int, latency: float, wire: float, site: int | None = None) -> int:
        now = time.perf_counter()
        with self._lock:
            if site is not None:
                n = self._calls.get((site, device), 0)
                self._calls[site, device] = n + 1
                first = self._first.setdefault((site, n), [now, 0])
                first[1] += 1
                if first[1] >= self._devices:
                    del self._first[site, n]
                now = first[0]
            start = max(now, self._busy.get(device, now))
            self._busy[device] = start + wire
            ticket = next(self._ids) % (2**31 - 1) + 1
            self._done[ticket] = start + wire + latency
        return ticket

    def join(self, device: int, key: int, tickets) -> None:
        """Files the latest of several transfers under (device, key): a key the program
        knows again later (a step number), unlike the tickets."""
        with self._lock:
            done = max((self._done.pop(int(t), 0.0) for t in tickets), default=0.0)
            self._done[(int(device), int(key))] = done

    def wait(self, ticket) -> None:
        """Sleeps until the transfer named by `ticket` (or (device, key)) is done; at once
        for one it does not know (e.g. one filed before a checkpoint was restored)."""
        with self._lock:
            done = self._done.pop(ticket, None)
        if done is not None:
            time.sleep(max(0.0, done - time.perf_counter()))


@dataclass
class _Frame:
    """What one collective sends over the links, accumulated while it is traced."""

    latency: float = 0.0
    wire: float = 0.0


@dataclass
class Emulator:
    """Links on a mesh, and the host clock of their transfers. Activate it (`active()`)
    around the tracing of a step; dpjax's collectives then time themselves."""

    mesh: object
    links: tuple
    clock: Clock | None = None

    def __post_init__(self):
        if self.clock is None:
            self.clock = Clock(self.mesh.size)
        for link in self.links:
            if link.axis not in self.mesh.axis_names:
                raise UserError(f"--link {link}: the mesh {dict(self.mesh.shape)} has no axis {link.axis!r}")
        self._frames: list[_Frame] = []
        self._pending: list[list] = []
        self.traced: list[tuple[str, float, float]] = []  # (collective, latency s, wire s) as traced

    @contextlib.contextmanager
    def active(self):
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def step_cost(self, axis_name, pairs, nbytes: int) -> tuple[float, float]:
        """(latency, wire seconds) of one point-to-point step along `axis_name` (a mesh
        axis or a tuple of them, ranks numbered in mesh order): the slowest linked axis
        that some pair crosses sets it, every pair sending `nbytes`."""
        axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
        ordered = [a for a in self.mesh.axis_names if a in axes]
        sizes = [self.mesh.shape[a] for a in ordered]
        cost = (0.0, 0.0)
        for link in self.links:
            if link.axis not in ordered:
                continue
            i = ordered.index(link.axis)
            stride = int(np.prod(sizes[i + 1:], dtype=np.int64))
            coord = lambda r: (r // stride) % sizes[i]  # noqa: E731
            if any(coord(s) != coord(t) for s, t in pairs):
                cost = max(cost, (link.latency, nbytes / link.bandwidth), key=sum)
        return cost


_ACTIVE: contextvars.ContextVar[Emulator | None] = contextvars.ContextVar("dpjax_links", default=None)


def account(axis_name, pairs, nbytes: int) -> None:
    """Called by every point-to-point step at trace time: adds its cost to the collective
    being traced, if links are emulated."""
    em = _ACTIVE.get()
    if em is not None and em._frames:
        latency, wire = em.step_cost(axis_name, pairs, nbytes)
        em._frames[-1].latency += latency
        em._frames[-1].wire += wire


def account_xla(axis_name, nbytes: int) -> None:
    """An XLA collective (the `psum` baselines) at trace time: one step (a latency on
    every linked axis it spans) and `nbytes` from the busiest device, as `cost.schedule`
    charges it; its real schedule is XLA's."""
    em = _ACTIVE.get()
    if em is None or not em._frames:
        return
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    crossed = [link for link in em.links if link.axis in axes and em.mesh.shape[link.axis] > 1]
    if crossed:
        slowest = max(crossed, key=lambda link: link.latency + nbytes / link.bandwidth)
        em._frames[-1].latency += slowest.latency
        em._frames[-1].wire += nbytes / slowest.bandwidth


def timed(collective):
    """Decorator for a public collective `f(x, axis_name, ...)`: under an active emulator
    its result waits for the emulated wire (or, inside `deferred()`, carries a ticket)."""
    import functools

    @functools.wraps(collective)
    def wrapper(x, *args, **kwargs):
        em = _ACTIVE.get()
        if em is None or em._frames:  # no links, or nested inside a collective being timed
            return collective(x, *args, **kwargs)
        em._frames.append(_Frame())
        try:
            y = collective(x, *args, **kwargs)
        finally:
            frame = em._frames.pop()
        if frame.latency == 0.0 and frame.wire == 0.0:
            return y
        em.traced.append((collective.__name__, frame.latency, frame.wire))
        ticket = _issue(em, x, frame, site=len(em.traced))
        if em._pending:
            em._pending[-1].append(ticket)
            return y
        return wait(y, ticket)

    return wrapper


def _device(mesh):
    return lax.axis_index(tuple(mesh.axis_names))


def _issue(em: Emulator, x, frame: _Frame, site: int):
    # The input as a dependency: the transfer starts when the input is ready.
    first = jnp.ravel(jax.tree.leaves(x)[0])[:1].astype(jnp.float32)

    def host(device, _):
        return np.int32(em.clock.issue(int(device), frame.latency, frame.wire, site))

    return io_callback(host, jax.ShapeDtypeStruct((), jnp.int32), _device(em.mesh), first)


def wait(value, ticket):
    """`value`, available only once the transfer `ticket` names is done (emulated)."""
    em = _ACTIVE.get()

    def host(t):
        em.clock.wait(int(t))
        return np.int32(0)

    return _after(value, io_callback(host, jax.ShapeDtypeStruct((), jnp.int32), ticket))


def wait_deferred(value, key):
    """`value`, once the transfers filed under `key` by `deferred(key)` are done. Without
    links: `value`, and nothing is compiled in."""
    em = _ACTIVE.get()
    if em is None:
        return value

    def host(device, k):
        em.clock.wait((int(device), int(k)))
        return np.int32(0)

    return _after(value, io_callback(host, jax.ShapeDtypeStruct((), jnp.int32), _device(em.mesh), key))


def _after(value, token):
    """`value` held back until `token` exists (an optimization barrier ties them)."""
    value, _ = lax.optimization_barrier((value, token))
    return value


@contextlib.contextmanager
def deferred(key):
    """Collectives called inside do not wait for their emulated wire: their transfers are
    filed under `key` (a traced int the program will know again, e.g. the step number),
    and `wait_deferred(value, key)` waits for them where the value is used: a rule that
    consumes an exchange later than it issues it. Without links: nothing happens."""
    em = _ACTIVE.get()
    if em is None:
        yield
        return
    tickets: list = []
    em._pending.append(tickets)
    try:
        yield
    finally:
        em._pending.pop()
    if tickets:
        def host(device, k, *ts):
            em.clock.join(int(device), int(k), ts)
            return np.int32(0)

        io_callback(host, jax.ShapeDtypeStruct((), jnp.int32), _device(em.mesh), key, *tickets)
