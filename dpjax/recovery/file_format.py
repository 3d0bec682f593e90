"""A commit's file: what `dpjax.recovery.commit` writes and reads.

    MAGIC (5 bytes) | the header's length (uint64, little-endian) | the header (JSON) | the pieces' bytes

The header is the commit's meta (step, world, rank, the data cursor, losses) and, for
each leaf of the state, its global shape, its dtype and its pieces (each shard this
process wrote, as a [start, stop] per dimension); the pieces' bytes follow in that
order, each C-contiguous. A reader needs only the header to know where every piece's
bytes are (`read_header`), so a restore maps a file and reads the pieces it places.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

from dpjax.errors import UserError

MAGIC = b"DPJC1"


class CommitError(UserError):
    """Commits that cannot be used; the message says why."""


def raw(a: np.ndarray) -> memoryview:
    """An array's bytes without copying them (bfloat16 and 0-d arrays included)."""
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def header(meta: dict) -> bytes:
    head = json.dumps(meta).encode()
    return MAGIC + struct.pack("<Q", len(head)) + head


def encode(meta: dict, arrays: list) -> bytes:
    """A commit's bytes in one buffer (what the writer streams into a file piece by piece)."""
    return b"".join([header(meta), *(raw(a) for a in arrays)])


def read_header(blob) -> tuple[dict, int]:
    """(meta, where the pieces' bytes start) of a commit's first bytes."""
    blob = memoryview(blob)
    if bytes(blob[:len(MAGIC)]) != MAGIC:
        raise CommitError("a commit file is not one (bad magic)")
    n = struct.unpack("<Q", blob[len(MAGIC):len(MAGIC) + 8])[0]
    at = len(MAGIC) + 8
    return json.loads(bytes(blob[at:at + n])), at + n


def header_size(prefix) -> int:
    """The length of a commit's header, from its first len(MAGIC) + 8 bytes."""
    return len(MAGIC) + 8 + struct.unpack("<Q", bytes(prefix[len(MAGIC):len(MAGIC) + 8]))[0]


def decode(blob) -> tuple[dict, list]:
    """(meta, the arrays of its pieces: views into blob) of a commit's bytes."""
    meta, at = read_header(blob)
    arrays = []
    for leaf in meta["leaves"]:
        dtype = dtype_of(leaf["dtype"])
        for index in leaf["pieces"]:
            shape = tuple(stop - start for start, stop in index)
            count = int(np.prod(shape))
            arrays.append(np.frombuffer(blob, dtype, count=count, offset=at).reshape(shape))
            at += count * dtype.itemsize
    if at != len(blob):
        raise CommitError(f"a commit file holds {len(blob)} bytes, its header says {at} (cut short or corrupt)")
    return meta, arrays


def dtype_of(name: str) -> np.dtype:
    import jax.numpy as jnp

    return np.dtype(jnp.dtype(name))


def read(path: str) -> bytearray:
    """A file's bytes, read into one buffer (no second copy)."""
    with open(path, "rb") as fh:
        out = bytearray(os.fstat(fh.fileno()).st_size)
        fh.readinto(out)
    return out


def mapped(path: str):
    """A file's bytes, mapped read-only: a restore reads the pages of the pieces it
    places and no others (on tmpfs the mapping is the file's own pages: no copy)."""
    import mmap

    with open(path, "rb") as fh:
        return memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
