"""The host clock of emulated transfers: when each device's transfers finish.

Time comes from a time source (`now()`, `sleep_until(t)`): `RealTime` (the default)
reads `time.perf_counter` and sleeps; `VirtualTime` never sleeps, its time moves only
when someone waits for a transfer (or `advance`s it), so what a program would wait for
on the emulated network can be read off exactly, in no time.
"""

from __future__ import annotations

import itertools
import threading
import time


class RealTime:
    """Wall-clock time: `time.perf_counter`, and sleeping until a deadline."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep_until(self, deadline: float) -> None:
        time.sleep(max(0.0, deadline - time.perf_counter()))


class VirtualTime:
    """A clock that waiting moves forward: `sleep_until(t)` sets the time to t (if later)
    at once. Computation takes no virtual time, so after a program ran, `now()` is the
    time it spent waiting for the emulated wire. Shared safely by the device threads."""

    def __init__(self, start: float = 0.0):
        self._lock = threading.Lock()
        self._t = float(start)

    def now(self) -> float:
        with self._lock:
            return self._t

    def sleep_until(self, deadline: float) -> None:
        with self._lock:
            self._t = max(self._t, float(deadline))

    def advance(self, seconds: float) -> None:
        """Time passing while nobody waits (a device held up, computing)."""
        with self._lock:
            self._t += float(seconds)


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
    by a device belongs to the site's n-th call. source: the time source (`RealTime`
    by default, `VirtualTime` to account without sleeping).

    `key`: a deferred transfer (`dpjax.links.deferred`) is filed under (device, key), a
    key the program knows again later (a step number), and `wait((device, key))` waits
    for every transfer filed there. The transfers of one key run as one communication
    stream, in issue order (as NCCL runs the collectives of one stream): each starts once
    the one filed before it has arrived, so a transfer whose input is computed from an
    earlier one's result (PowerSGD's Q from P) is charged after it. `after`: another key
    whose transfers this one starts after (an exchange whose input is computed from the
    previous step's result: error feedback). Transfers of different keys (steps), and
    synchronous ones, are otherwise independent: their bytes share the device's wire,
    their latencies overlap."""

    def __init__(self, devices: int = 1, source=None):
        self.source = RealTime() if source is None else source  # now(), sleep_until(t)
        self._lock = threading.Lock()
        self._busy: dict[int, float] = {}
        self._done: dict[int, float] = {}
        self._ids = itertools.count(1)
        self._devices = devices
        self._calls: dict[tuple, int] = {}  # (site, device) -> calls issued
        self._first: dict[tuple, list] = {}  # (site, call) -> [first issue time, devices issued]

    def issue(self, device: int, latency: float, wire: float, site: int | None = None, key=None,
              after=None) -> int:
        now = self.source.now()
        with self._lock:
            if site is not None:
                n = self._calls.get((site, device), 0)
                self._calls[site, device] = n + 1
                first = self._first.setdefault((site, n), [now, 0])
                first[1] += 1
                if first[1] >= self._devices:
                    del self._first[site, n]
                now = first[0]
            stream = None if key is None else (int(device), int(key))
            start = max(now, self._busy.get(device, now), self._done.get(stream, now),
                        self._done.get((int(device), int(after)), now) if after is not None else now)
            self._busy[device] = start + wire
            ticket = next(self._ids) % (2**31 - 1) + 1
            self._done[ticket if stream is None else stream] = start + wire + latency
        return ticket

    def wait(self, ticket) -> None:
        """Sleeps until the transfer named by `ticket` (or (device, key)) is done; at once
        for one it does not know (e.g. one filed before a checkpoint was restored)."""
        with self._lock:
            done = self._done.pop(ticket, None)
        if done is not None:
            self.source.sleep_until(done)
