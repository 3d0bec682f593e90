"""What a token file holds, written beside it: `tokens.bin.json` next to `tokens.bin`.

A flat file of ids does not say their width; guessing it from the name went wrong
(`prepare --out tokens.u32.bin` wrote uint16 ids for a small vocabulary and training read
them as uint32). `python -m dpjax.data.prepare` now writes this small JSON beside the
file (the ids' dtype, their count, the vocabulary and the tokenizer) and the reader
trusts it over the name; files without one (nanoGPT's, llm.c's, earlier ones) are read as
before. The writer never replaces an existing file unless asked, and writes into a
temporary file renamed into place, so a failure leaves what was there.
"""

from __future__ import annotations

import json
import os

import numpy as np

from dpjax.errors import UserError

FORMAT = "dpjax token file"
DTYPES = ("uint16", "uint32")


class TokenFileError(UserError):
    """A token file, or what is written beside it, that cannot be used; one line."""


def sidecar(path: str) -> str:
    return path + ".json"


def read_meta(path: str) -> dict | None:
    """The description written beside token file `path`, or None when there is none."""
    side = sidecar(path)
    if not os.path.isfile(side):
        return None
    try:
        with open(side) as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as e:
        raise TokenFileError(f"{side} (what {path} holds) cannot be read: {e}; prepare the file again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("dtype") not in DTYPES:
        raise TokenFileError(f"{side} is not the description of a token file dpjax writes (format {FORMAT!r}, "
                             f"dtype one of {', '.join(DTYPES)}); move it away or prepare the file again")
    return meta


def check_fits(path: str, meta: dict, size: int, given: str) -> None:
    """The file's size is the described count of ids, and a --token-dtype given agrees."""
    if given not in ("auto", meta["dtype"]):
        raise TokenFileError(f"--token-dtype {given}, but {sidecar(path)} says {path} holds {meta['dtype']} ids; "
                             "drop --token-dtype")
    want = int(meta["tokens"]) * np.dtype(meta["dtype"]).itemsize
    if size != want:
        raise TokenFileError(f"{path} holds {size} bytes, {sidecar(path)} says {meta['tokens']} {meta['dtype']} ids "
                             f"({want} bytes): they were not written together; prepare the file again")


def refuse_existing(paths: list[str], overwrite: bool) -> None:
    """One line, before anything is written, when a file to write exists already."""
    there = [p for p in paths if os.path.lexists(p)]
    if there and not overwrite:
        raise TokenFileError(f"{there[0]} exists; pass --overwrite to replace it (nothing was written)")


def write(out: str, pieces, dtype: str, meta: dict) -> int:
    """Writes the ids of `pieces` (arrays, in order) to `out` as `dtype`, then the
    description beside it; each into a temporary file renamed into place. Returns the
    count (0: nothing is written)."""
    tmp = out + ".tmp"
    n = 0
    try:
        with open(tmp, "wb") as fh:
            for ids in pieces:
                ids.astype(dtype).tofile(fh)
                n += ids.size
        if n == 0:
            os.remove(tmp)
            return 0
        side = {"format": FORMAT, "dtype": dtype, "tokens": n, **meta}
        with open(sidecar(tmp), "w") as fh:
            json.dump(side, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, out)
        os.replace(sidecar(tmp), sidecar(out))
    except BaseException:
        for p in (tmp, sidecar(tmp)):
            if os.path.exists(p):
                os.remove(p)
        raise
    return n
