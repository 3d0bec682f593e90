"""Token files: a flat file of ids (`.bin`: uint16 or uint32, as nanoGPT's and llm.c's
prepare scripts write them; `python -m dpjax.data.prepare` writes one from text, with a
description beside it, `dpjax.data.token_file`), memory-mapped, its ids' type and
vocabulary checked before a batch reads them."""

from __future__ import annotations

import os

import numpy as np

from dpjax.data.corpus import DataError
from dpjax.data.token_file import check_fits, read_meta, sidecar

TOKEN_SUFFIX = ".bin"  # a file of token ids, not text
LLMC_MAGIC, LLMC_HEADER = 20240520, 256  # llm.c's .bin: 256 int32 (magic, version, count), then uint16 ids


def token_dtype(path: str, given: str = "auto") -> str:
    """The ids' type of token file `path`: what `python -m dpjax.data.prepare` wrote
    beside it (`dpjax.data.token_file`), else `given`, else, for a file without that
    (nanoGPT's, llm.c's, older ones), uint32 if the name says so ('u32' / 'uint32' in
    it), else uint16 (nanoGPT's and llm.c's GPT-2 files)."""
    meta = read_meta(path)
    if meta is not None:
        return meta["dtype"]
    if given != "auto":
        return given
    name = os.path.basename(path).lower()
    return "uint32" if "u32" in name or "uint32" in name else "uint16"


def open_tokens(path: str, dtype: str = "auto") -> np.ndarray:
    """A flat file of token ids, memory-mapped (nothing is read until a batch asks for
    its rows). The description written beside it is trusted over the name and checked
    against the file's size. An llm.c header (its magic number first) is skipped."""
    if not os.path.isfile(path):
        raise DataError(f"token file {path!r} does not exist")
    meta = read_meta(path)
    if meta is not None:
        check_fits(path, meta, os.path.getsize(path), dtype)
    dtype = np.dtype(token_dtype(path, dtype))
    offset = 0
    if os.path.getsize(path) >= 4 * LLMC_HEADER:
        head = np.fromfile(path, dtype=np.int32, count=3)
        if head[0] == LLMC_MAGIC:
            offset, dtype = 4 * LLMC_HEADER, np.dtype(np.uint16)
    size = os.path.getsize(path) - offset
    if size % dtype.itemsize or size == 0:
        raise DataError(f"token file {path!r} holds {size} bytes, not a whole number of {dtype} ids; "
                        "check --token-dtype")
    return np.memmap(path, dtype=dtype, mode="r", offset=offset)


def check_vocab(path: str | None, vocab_size: int | None) -> None:
    """A token file whose tokenizer has more ids than the model reads is refused at once
    (not at the first batch that holds one of them)."""
    meta = read_meta(path) if path else None
    if meta and vocab_size and meta.get("vocab_size") and meta["vocab_size"] > vocab_size:
        raise DataError(f"{path} was tokenized with {meta['vocab_size']} ids ({sidecar(path)}), more than the "
                        f"model's {vocab_size}; give --vocab-size {meta['vocab_size']} or the model's tokenizer")
