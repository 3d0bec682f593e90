"""Loud instead of silent: values declared replicated are checked to be replicated.

A `shard_map` built with `check_vma=False` (dpjax's steps need it, see
`dpjax.data_parallel`) trusts its `out_specs`: an output declared replicated (`P()`, or
a spec that leaves a mesh axis out) comes back as device 0's copy even where the
devices computed different values. Local gradients never averaged, BatchNorm statistics
never synchronised, the metrics of one shard: all come back looking fine.

The devices' copies are still there, though: a `jax.Array` keeps one buffer per device,
and the devices that hold the same block of the global array (the same index in its
sharding) must hold the same bits. `ReplicaCheck` compares them: small values on the
host (every copy fetched, no compile), large ones on the devices, where a small jitted
`shard_map` hashes each device's own block (two 32-bit multiply-add hashes of the bits,
plus the block's largest magnitude for the message) and only the devices x leaves
hashes travel. It raises `ReplicationError` naming the first leaf whose copies differ
and how far apart they are. The comparison is bitwise: replicas that drift apart by
round-off drift further every step (Horovod users met this as parameters that slowly
diverge), so they count too.

`dpjax.shard_step` runs the check on its first `FIRST_CALLS` calls and on every call
when the environment sets `DPJAX_CHECK=1` (which `python -m dpjax.train` honours too).
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.errors import UserError
from dpjax.mesh import spec_axes

FIRST_CALLS = 2  # calls of a wrapped step checked by default
ENV = "DPJAX_CHECK"  # "1": check every call


class ReplicationError(UserError):
    """A value declared replicated differs across the devices that should share it."""


def check_always() -> bool:
    # "reference" asks for the one-device comparison of the first call (`dpjax.wrap.reference`),
    # not for this check on every call
    return os.environ.get(ENV, "").strip() not in ("", "0", "reference")


def _bits_U(x):
    """The bits of x as a flat uint32 vector (narrow types widened exactly first)."""
    x = _raw(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.int32)
    if x.dtype.itemsize < 4:
        x = x.astype(jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32)
    return lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)


def _fingerprint(x):
    """(2 hashes, as uint32) and (largest |x|, as float32) of this device's block.
    Each hash is sum_i bits_i * odd_i mod 2^32: a change in any one element changes it."""
    b_U = _bits_U(x)
    i_U = jnp.arange(b_U.size, dtype=jnp.uint32)
    odd1 = i_U * jnp.uint32(2654435761) | jnp.uint32(1)
    odd2 = (i_U + jnp.uint32(0x9E3779B9)) * jnp.uint32(2246822519) | jnp.uint32(1)
    hashes = jnp.stack([jnp.sum(b_U * odd1), jnp.sum((b_U ^ (b_U >> 15)) * odd2)])
    numeric = not _is_key(x) and x.size
    scale = jnp.max(jnp.abs(x.astype(jnp.float32))) if numeric else jnp.zeros((), jnp.float32)
    return hashes, scale


class ReplicaCheck:
    """Checks that the copies of every jax.Array in a tree agree (see the module
    docstring). Holds its compiled hash programs, one per mesh and list of specs.

    host_bytes: below this many bytes in all (every device's copies counted), the
    copies are compared on the host directly, which costs a transfer but no compile
    (small models, tests); above it, on the devices."""

    def __init__(self, host_bytes: int = 32 << 20):
        self.host_bytes = host_bytes
        self._programs: dict = {}

    def _program(self, mesh, specs):
        key = (mesh, specs)
        if key not in self._programs:
            axes = mesh.axis_names

            def body(*blocks):
                prints = [_fingerprint(b) for b in blocks]
                return (jnp.stack([h for h, _ in prints])[None], jnp.stack([s for _, s in prints])[None])

            self._programs[key] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs,
                                                        out_specs=(P(axes), P(axes)), check_vma=False))
        return self._programs[key]

    def _on_devices(self, mesh, items) -> list:
        """Per leaf, {device position in the mesh: (its block's hashes, largest |value|)}."""
        hashes, scales = self._program(mesh, tuple(x.sharding.spec for _, x in items))(*[x for _, x in items])
        hashes, scales = _host(hashes), _host(scales)
        return [{d: (tuple(hashes[d, j]), float(scales[d, j])) for d in range(hashes.shape[0])}
                for j in range(len(items))]

    def _on_host(self, mesh, items) -> list:
        order = {d: i for i, d in enumerate(mesh.devices.flat)}
        out = []
        for _, x in items:
            prints = {}
            for shard in x.addressable_shards:
                block = np.asarray(_raw(shard.data))
                scale = float(np.max(np.abs(block))) if block.size and not _is_key(x) else 0.0
                prints[order[shard.device]] = (hashlib.blake2b(block.tobytes()).digest(), scale)
            out.append(prints)
        return out

    def __call__(self, named: dict, *, where: str = "", hint: Callable[[str, tuple], str] | None = None,
                 error: type = ReplicationError) -> None:
        """named: {leaf name: jax.Array}. Raises `error` (one line) naming the first
        leaf whose copies differ, with the number of leaves that differ in all;
        `hint(name, axes)` adds advice for that leaf, given the mesh axes its copies
        differ along."""
        by_mesh: dict = {}
        for name, x in named.items():
            if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.num_devices > 1:
                by_mesh.setdefault(x.sharding.mesh, []).append((name, x))
        bad = []
        for mesh, items in by_mesh.items():
            copies = sum(x.nbytes * x.sharding.num_devices for _, x in items)
            small = jax.process_count() == 1 and copies <= self.host_bytes
            prints = (self._on_host if small else self._on_devices)(mesh, items)
            order = {d: i for i, d in enumerate(mesh.devices.flat)}
            for (name, x), p in zip(items, prints):
                groups: dict = {}
                for d, index in x.sharding.devices_indices_map(x.shape).items():
                    groups.setdefault(tuple((s.start, s.stop) for s in index), []).append(order[d])
                for devs in groups.values():
                    devs = sorted(devs)
                    differ = [d for d in devs if p[d][0] != p[devs[0]][0]]
                    if differ:
                        bad.append((name, x, mesh, devs, differ, np.array([p[d][1] for d in devs]),
                                    _along(mesh, devs, {d: p[d][0] for d in devs})))
                        break
        if bad:
            raise error(_message(bad, where, hint))


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _raw(x):
    return jax.random.key_data(x) if _is_key(x) else x


def _host(x) -> np.ndarray:
    if jax.process_count() > 1:  # the hashes of every process's devices
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _along(mesh, devs, prints) -> tuple:
    """The mesh axes along which copies differ: those where two of `devs` (positions in
    the mesh) that differ in that coordinate alone hold different values."""
    at = {tuple(int(c) for c in np.unravel_index(d, mesh.devices.shape)): prints[d] for d in devs}
    return tuple(a for i, a in enumerate(mesh.axis_names)
                 if any(c[:i] + (k,) + c[i + 1:] in at and at[c[:i] + (k,) + c[i + 1:]] != v
                        for c, v in at.items() for k in range(mesh.shape[a])))


def _message(bad, where: str, hint) -> str:
    name, x, mesh, devs, differ, scales, along = bad[0]
    over = [a for a in mesh.axis_names if a not in spec_axes(x.sharding.spec) and mesh.shape[a] > 1]
    flat = list(mesh.devices.flat)
    held = {s.device: s.data for s in x.addressable_shards}
    ref = held.get(flat[devs[0]])
    gaps = [np.max(np.abs(np.asarray(held[flat[d]], np.float64) - np.asarray(ref, np.float64)))
            for d in differ if ref is not None and flat[d] in held
            and not _is_key(x) and x.size]
    size = (f"max |difference| {max(gaps):.3g} (largest |value| {float(scales.max()):.3g})" if gaps
            else f"largest |value| from {float(scales.min()):.3g} to {float(scales.max()):.3g}")
    others = ", ".join(b[0] for b in bad[1:4]) + (", ..." if len(bad) > 4 else "")
    more = f"; {len(bad) - 1} more {'differs' if len(bad) == 2 else 'differ'} ({others})" if len(bad) > 1 else ""
    tip = hint(name, along) if hint else ""
    return (f"{where}{name} {tuple(x.shape)} is declared replicated over {', '.join(over)} but its copies "
            f"differ: {len(differ)} of {len(devs)} devices hold other values than device {devs[0]}, {size}"
            f"{more}{'; ' + tip if tip else ''}")


def named_leaves(tree, names=None) -> dict:
    """{'params/w1': leaf, ...}: tree's leaves by path; names: one prefix per top-level item of a tuple."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        if names is not None and keys:
            keys[0] = names[int(keys[0])]
        out["/".join(keys) or "output"] = x
    return out


def checked(fn, names, where: str):
    """fn with its outputs checked on every call, for dpjax's own steps (`python -m dpjax.train`
    under DPJAX_CHECK=1): a divergence there is a bug of ours, so it is an AssertionError,
    with its traceback, rather than a user error."""
    check = ReplicaCheck()

    def call(*args):
        out = fn(*args)
        check(named_leaves(out, names), where=f"{where}: ", error=AssertionError)
        return out

    if hasattr(fn, "lower"):  # still a jitted step to what reads its program (comm_bytes, MFU, timeline)
        call.lower = fn.lower
    return call
