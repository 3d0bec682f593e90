"""The emulator: while a step is traced, each collective notes what it sends over the
links; host callbacks compiled around it then hold its result until the wire is done
(see the package docstring, `dpjax.links`)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from dpjax.links.clock import Clock


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
                raise ValueError(f"link {link}: the mesh {dict(self.mesh.shape)} has no axis {link.axis!r}")
        self._frames: list[_Frame] = []
        self._pending: list = []  # (key, after) of the deferred() blocks open, innermost last
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
        if em._pending:  # inside deferred(): filed under its key, after the block's earlier transfers
            _issue(em, x, frame, site=len(em.traced), key=em._pending[-1][0], after=em._pending[-1][1])
            return y
        return wait(y, _issue(em, x, frame, site=len(em.traced)))

    return wrapper


def _device(mesh):
    return lax.axis_index(tuple(mesh.axis_names))


def _issue(em: Emulator, x, frame: _Frame, site: int, key=None, after=None):
    # The input as a dependency: the transfer starts when the input is ready (a deferred
    # one, on the emulated wire, once its block's earlier transfers, and the block `after`
    # names, have arrived: `Clock`).
    first = jnp.ravel(jax.tree.leaves(x)[0])[:1].astype(jnp.float32)
    keys = tuple(k for k in (key, after) if k is not None)

    def host(device, _, *k):
        k = list(k)
        key_, after_ = (k.pop(0) if key is not None else None), (k.pop(0) if after is not None else None)
        return np.int32(em.clock.issue(int(device), frame.latency, frame.wire, site,
                                       key=None if key_ is None else int(key_),
                                       after=None if after_ is None else int(after_)))

    return io_callback(host, jax.ShapeDtypeStruct((), jnp.int32), _device(em.mesh), first, *keys)


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
def deferred(key, after=None):
    """Collectives called inside do not wait for their emulated wire: their transfers are
    filed under `key` (a traced int the program will know again, e.g. the step number),
    and `wait_deferred(value, key)` waits for them where the value is used: a rule that
    consumes an exchange later than it issues it. Without links: nothing happens.

    The block's transfers run one after another, in issue order: each starts on the wire
    once the one before it in the block has arrived (`Clock.issue`'s `key`). The
    emulator cannot see which results a later collective's input was computed from (a
    chain such as PowerSGD's P then Q); serialising the block never charges a dependent
    chain less than its sum, and charges independent transfers of one block as one
    stream does (NCCL runs a stream's collectives in order). Blocks of different steps
    overlap as before, unless `after` names an earlier block's key: then this block
    starts once that one has arrived (an exchange with error feedback, whose input is
    computed from the previous exchange's result). Each transfer is filed as it is
    issued, so a collective inside a `lax.cond` in the block (a compression's start
    steps) files its own."""
    em = _ACTIVE.get()
    if em is None:
        yield
        return
    em._pending.append((key, after))
    try:
        yield
    finally:
        em._pending.pop()
