"""Checksums of orbax checkpoints: a manifest per step, written after orbax finalises it.

Orbax writes a step into a temporary folder and renames it into place (a reader never
sees half a step), but nothing in the step says whether its bytes are still the ones
written: a flipped byte in an array's data file restores silently wrong, a truncated
file as a traceback. So once a step is final, `seal` writes `<dir>/checksums/<step>.json`
(written then renamed): the size and CRC-32 (`zlib.crc32`, the standard library's) of
every file under `<dir>/<step>/`, data, metadata and orbax's index alike. `problem` says
what is wrong with a step, if anything: a file missing, added, of another size or
checksum, or a manifest that is not one; a step without a manifest (the run stopped
before writing it, or checkpoints from before dpjax kept them) is `UNSEALED`: used by a
restore, said in one line, and passed over if orbax cannot read it.
"""

from __future__ import annotations

import json
import os
import zlib

FOLDER = "checksums"
UNSEALED = "no checksums (made before dpjax kept them, or the run stopped before writing them)"
CHUNK = 8 << 20


def _crc(path: str) -> int:
    out = 0
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            out = zlib.crc32(block, out)
    return out


def _files(step_dir: str) -> dict:
    """{path relative to the step folder: [size, CRC-32]} of every file under it."""
    out = {}
    for base, _, names in os.walk(step_dir):
        for name in names:
            path = os.path.join(base, name)
            out[os.path.relpath(path, step_dir)] = [os.path.getsize(path), _crc(path)]
    return out


def manifest(directory: str, step: int) -> str:
    return os.path.join(directory, FOLDER, f"{step}.json")


def seal(directory: str, step: int) -> None:
    """Writes step's manifest (atomically: a temporary name, then a rename)."""
    path = manifest(directory, step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    body = json.dumps({"step": step, "files": _files(os.path.join(directory, str(step)))}, sort_keys=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(body)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def sealed(directory: str, step: int) -> bool:
    return os.path.exists(manifest(directory, step))


def prune(directory: str, steps) -> None:
    """Removes the manifests of steps no longer there (orbax keeps the newest few)."""
    folder = os.path.join(directory, FOLDER)
    keep = {f"{s}.json" for s in steps}
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name.endswith(".json") and name not in keep:
            os.remove(os.path.join(folder, name))


def problem(directory: str, step: int) -> str | None:
    """None when every file of the step matches its manifest; else what does not (the
    first thing found), or UNSEALED."""
    path = manifest(directory, step)
    if not os.path.exists(path):
        return UNSEALED
    try:
        with open(path) as fh:
            saved = json.load(fh)
        files, said = saved["files"], saved["step"]
        if said != step or not isinstance(files, dict):
            raise ValueError(f"it names step {said!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest {path} cannot be read ({type(e).__name__}: {str(e)[:80]})"
    step_dir = os.path.join(directory, str(step))
    try:
        now = {rel: os.path.getsize(os.path.join(step_dir, rel)) for rel in _walk(step_dir)}
    except OSError as e:
        return f"its files cannot be listed ({e})"
    for rel in sorted(set(files) | set(now)):
        if rel not in now:
            return f"{rel} is missing"
        if rel not in files:
            return f"{rel} is not in its manifest"
        size, want = files[rel]
        if now[rel] != size:
            return f"{rel} holds {now[rel]} bytes, its manifest says {size} (cut short or corrupt)"
        try:
            if _crc(os.path.join(step_dir, rel)) != want:
                return f"{rel} does not match its checksum"
        except OSError as e:
            return f"{rel} cannot be read ({e})"
    return None


def _walk(step_dir: str) -> list:
    if not os.path.isdir(step_dir):
        raise OSError(f"{step_dir} is not a folder")
    return [os.path.relpath(os.path.join(b, n), step_dir) for b, _, names in os.walk(step_dir) for n in names]
