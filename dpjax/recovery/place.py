"""Putting a commit back onto devices: each device's block of each array cut from the
pieces of the old ranks' files that overlap it (`place`), the files read lazily.

A local file is mapped, not read (`LocalFile`); another host's comes over the commit
channel, its header first and its body only if one of its pieces is needed here
(`RemoteFile`). No global array is put together on the host. `dpjax.recovery.commit`'s restore
chooses the step and the files; this module only lays them out.
"""

from __future__ import annotations

import jax
import numpy as np

from dpjax.recovery.checkpoint import check_compatible
from dpjax.recovery.file_format import MAGIC, CommitError, decode, dtype_of, header_size, mapped, read_header


class LocalFile:
    """A commit on this host: its header read at once, its pieces' pages when placed."""

    def __init__(self, path: str):
        self.blob = mapped(path)
        self.meta, self._start = read_header(self.blob)

    def arrays(self) -> list:
        return decode(self.blob)[1]


class RemoteFile:
    """A commit another process holds: its header fetched at once, the whole file only
    when one of its pieces is placed here. fetch(n): the file's first n bytes (all: None)."""

    def __init__(self, fetch):
        self.fetch = fetch
        size = header_size(fetch(len(MAGIC) + 8))
        self.meta, self._start = read_header(fetch(size))
        self._arrays = None

    def arrays(self) -> list:
        if self._arrays is None:
            self._arrays = decode(self.fetch())[1]
        return self._arrays


def _boxes(meta: dict, i: int):
    return [tuple(tuple(b) for b in index) for index in meta["leaves"][i]["pieces"]]


def place(template, files, expect=None):
    """The committed state laid out like `template`'s arrays: each device's block is cut
    from the pieces that overlap it, so no global array is put together on the host and a file none of whose pieces this
    process's devices hold is not read. files: each old rank's `LocalFile` / `RemoteFile`."""
    leaves, treedef = jax.tree.flatten(template)
    meta0 = files[0].meta
    if expect is not None:
        check_compatible(meta0.get("record", {}), expect, f"the commit of step {meta0['step']}")
    if any(f.meta["treedef"] != str(treedef) or len(f.meta["leaves"]) != len(leaves) for f in files):
        raise CommitError(f"the commit of step {meta0['step']} holds another state structure than this run's")
    first = [0] * len(files)  # each file's index of its leaf's first piece among its arrays
    out = []
    for i, leaf in enumerate(leaves):
        info = meta0["leaves"][i]
        if tuple(info["shape"]) != leaf.shape or info["dtype"] != str(leaf.dtype):
            raise CommitError(f"commit leaf {i} is {info['dtype']}{info['shape']}, this run's is "
                              f"{leaf.dtype}{list(leaf.shape)}; restart with the same settings")
        covered = sum(int(np.prod([b - a for a, b in box])) for f in files for box in _boxes(f.meta, i))
        if covered != int(np.prod(leaf.shape)):  # replica-0 pieces tile each array exactly once
            raise CommitError(f"commit leaf {i}: the pieces cover {covered} of {int(np.prod(leaf.shape))} elements")
        dtype, blocks, made = dtype_of(info["dtype"]), [], {}
        for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
            box = tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, leaf.shape))
            if box not in made:  # devices that hold the same block (replicas) share its host copy
                made[box] = _block(box, dtype, files, first, i)
            blocks.append(jax.device_put(made[box], device))
        out.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, blocks))
        for d, f in enumerate(files):
            first[d] += len(f.meta["leaves"][i]["pieces"])
    return jax.tree.unflatten(treedef, out)


def _block(box, dtype, files, first, i) -> np.ndarray:
    """One device's block (global index `box`) of leaf i, in fresh host memory (a device
    array must never alias a commit file's pages: the file is overwritten later)."""
    out = np.empty(tuple(b - a for a, b in box), dtype)
    for d, f in enumerate(files):
        for k, piece in enumerate(_boxes(f.meta, i)):
            lo = [max(a, p) for (a, _), (p, _) in zip(box, piece)]
            hi = [min(b, q) for (_, b), (_, q) in zip(box, piece)]
            if all(l < h for l, h in zip(lo, hi)) or not box:
                src = f.arrays()[first[d] + k]
                out[tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, box))] = \
                    src[tuple(slice(l - p, h - p) for l, h, (p, _) in zip(lo, hi, piece))]
    return out
