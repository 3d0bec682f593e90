"""A commit's file: what `dpjax.recovery.commit` writes and reads, its name
(`s<step>_w<world>.bin`) and its atomic write (`write_file`).

    MAGIC (5 bytes) | the header's length (uint64, little-endian) | the header (JSON) | the pieces' bytes
    | the trailer: a CRC-32 of each piece, of the header (uint32 each), the piece count (uint32), END

The header is the commit's meta (step, world, rank, the data cursor, losses) and, for
each leaf of the state, its global shape, its dtype and its pieces (each shard this
process wrote, as a [start, stop] per dimension); the pieces' bytes follow in that
order, each C-contiguous. A reader needs only the header to know where every piece's
bytes are (`read_header`), so a restore maps a file and reads the pieces it places.

The checksums are written after the data (the writer computes each piece's as it
writes it, so the device-to-host copies still overlap the writing), at the file's end:
a file cut short has no valid trailer, and every byte of a file is either covered by a
checksum or is one, so one flipped byte anywhere is caught by `check` (Orbax and TorchFT
verify restored data the same way). CRC-32 is the standard library's `zlib.crc32`,
about 2 GB/s on one core here, with the GIL released: no dependency.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import threading
import zlib

import ml_dtypes
import numpy as np

from dpjax.recovery import fault

from dpjax.errors import UserError

MAGIC = b"DPJC2"  # DPJC1 files (no checksums) are refused as not of this version
END = b"DPJE"


class CommitError(UserError):
    """Commits that cannot be used; the message says why."""


def raw(a: np.ndarray) -> memoryview:
    """An array's bytes without copying them (bfloat16 and 0-d arrays included)."""
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def header(meta: dict) -> bytes:
    head = json.dumps(meta).encode()
    return MAGIC + struct.pack("<Q", len(head)) + head


def trailer(head: bytes, crcs: list) -> bytes:
    """What follows the pieces: each piece's CRC-32 (`crc`, in order), the header's, the count."""
    return struct.pack(f"<{len(crcs) + 2}I", *crcs, crc(head), len(crcs)) + END


def trailer_size(pieces: int) -> int:
    return 4 * (pieces + 2) + len(END)


def crc(b) -> int:
    return zlib.crc32(b)


def encode(meta: dict, arrays: list) -> bytes:
    """A commit's bytes in one buffer (what the writer streams into a file piece by piece)."""
    head, views = header(meta), [raw(a) for a in arrays]
    return b"".join([head, *views, trailer(head, [crc(v) for v in views])])


def read_header(blob) -> tuple[dict, int]:
    """(meta, where the pieces' bytes start) of a commit's first bytes."""
    blob = memoryview(blob)
    if bytes(blob[:len(MAGIC)]) != MAGIC:
        raise CommitError("not a commit file of this version (bad magic)")
    if len(blob) < len(MAGIC) + 8:
        raise CommitError("cut short inside its header")
    n = struct.unpack("<Q", blob[len(MAGIC):len(MAGIC) + 8])[0]
    at = len(MAGIC) + 8
    try:
        meta = json.loads(bytes(blob[at:at + n]))
        sizes(meta)  # every leaf named, with a dtype and pieces
    except (ValueError, KeyError, TypeError) as e:  # a torn or flipped header: JSON, UTF-8 or its fields
        raise CommitError(f"its header cannot be read ({type(e).__name__}: {str(e)[:80]})") from None
    return meta, at + n


def header_size(prefix) -> int:
    """The length of a commit's header, from its first len(MAGIC) + 8 bytes."""
    return len(MAGIC) + 8 + struct.unpack("<Q", bytes(prefix[len(MAGIC):len(MAGIC) + 8]))[0]


def sizes(meta: dict) -> list:
    """(shape, dtype) of every piece, in the file's order."""
    out = []
    for leaf in meta["leaves"]:
        dtype = dtype_of(leaf["dtype"])
        out += [(tuple(stop - start for start, stop in index), dtype) for index in leaf["pieces"]]
    return out


def _expect(blob, meta, at) -> list:
    """Each piece's byte count, once the file's length is the header's sum plus the trailer."""
    counts = [int(np.prod(shape)) * dtype.itemsize for shape, dtype in sizes(meta)]
    want = at + sum(counts) + trailer_size(len(counts))
    if want != len(blob):
        raise CommitError(f"it holds {len(blob)} bytes, its header says {want} (cut short or corrupt)")
    return counts


def decode(blob) -> tuple[dict, list]:
    """(meta, the arrays of its pieces: views into blob) of a commit's bytes (its length
    checked; its checksums are `check`'s)."""
    meta, at = read_header(blob)
    _expect(blob, meta, at)
    arrays = []
    for shape, dtype in sizes(meta):
        count = int(np.prod(shape))
        arrays.append(np.frombuffer(blob, dtype, count=count, offset=at).reshape(shape))
        at += count * dtype.itemsize
    return meta, arrays


def check(blob) -> dict:
    """The meta of a commit's bytes once every checksum matches; CommitError saying what
    does not (the first thing found)."""
    blob = memoryview(blob)
    meta, at = read_header(blob)
    counts = _expect(blob, meta, at)
    tail = blob[len(blob) - trailer_size(len(counts)):]
    if bytes(tail[-len(END):]) != END:
        raise CommitError("its trailer has no end mark (torn or corrupt)")
    *crcs, head_crc, n = struct.unpack(f"<{len(counts) + 2}I", tail[:-len(END)])
    if n != len(counts):
        raise CommitError(f"its trailer counts {n} pieces, its header {len(counts)}")
    if crc(blob[:at]) != head_crc:
        raise CommitError("its header does not match its checksum")
    for k, (count, want) in enumerate(zip(counts, crcs)):
        if crc(blob[at:at + count]) != want:
            raise CommitError(f"piece {k} does not match its checksum")
        at += count
    return meta


def dtype_of(name: str) -> np.dtype:
    """A dtype by its name, bfloat16 and float8 included (ml_dtypes': no JAX import)."""
    try:
        return np.dtype(name)
    except TypeError:
        if not hasattr(ml_dtypes, name):  # a module's names, not a model's: a flipped byte makes an unknown one
            raise ValueError(f"unknown dtype {name!r}") from None
        return np.dtype(getattr(ml_dtypes, name))


def read(path: str) -> bytearray:
    """A file's bytes, read into one buffer (no second copy)."""
    with open(path, "rb") as fh:
        out = bytearray(os.fstat(fh.fileno()).st_size)
        fh.readinto(out)
    return out


def mapped(path: str):
    """A file's bytes, mapped read-only: a restore reads the pages of the pieces it
    places and no others (on tmpfs the mapping is the file's own pages: no copy)."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:  # mmap refuses an empty file
            return memoryview(b"")
        return memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))


def check_file(path: str) -> dict:
    """`check` of the file at `path`."""
    return check(mapped(path))


def name(step: int, world: int) -> str:
    return f"s{step:09d}_w{world}.bin"


def parse_name(name: str):
    if not (name.startswith("s") and name.endswith(".bin") and "_w" in name):
        return None
    step, world = name[1:-4].split("_w")
    return int(step), int(world)


def write_file(folder: str, name: str, keep: int, fill) -> tuple[str, int]:
    """Writes `fill(file)` as `folder/name`, atomically (a temporary name, then a rename),
    keeping the newest `keep` commits there; the oldest one's file is reused when there
    are `keep` already (its pages are overwritten, not allocated again). (path, bytes)."""
    os.makedirs(folder, exist_ok=True)
    done = sorted((p, f) for f in os.listdir(folder) if (p := parse_name(f)) and f != name)
    tmp = os.path.join(folder, f".{name}.tmp{os.getpid()}.{threading.get_ident()}")
    if len(done) >= keep:
        os.replace(os.path.join(folder, done.pop(0)[1]), tmp)
    try:
        with open(tmp, "r+b" if os.path.exists(tmp) else "wb") as fh:
            fill(fh)
            fault.in_write(fh)  # an injected death in the write (DPJAX_FAULT_ARM): the rename never comes
            fh.truncate()
            size = fh.tell()
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk: the half-written file's pages back to the disk
            os.remove(tmp)
        raise
    path = os.path.join(folder, name)
    os.replace(tmp, path)  # atomic: all of a commit or none of it
    for _, f in done[:max(0, len(done) - (keep - 1))]:
        os.remove(os.path.join(folder, f))
    return path, size
