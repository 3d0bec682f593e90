"""A corpus of text: the Python standard library's own source (every Python install has
it; `sysconfig` locates it; `site-packages` and test folders are skipped), a file or a
folder of text files; read as one uint8 array of bytes, or as a tokenizer's ids."""

from __future__ import annotations

import os
import sysconfig
from functools import lru_cache

import numpy as np

from dpjax.errors import UserError

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".cfg", ".ini", ".html", ".css", ".js")


class DataError(UserError):
    """A problem with the data a user asked for; the message says how to fix it."""


def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("site-packages", "dist-packages", "__pycache__")
                             and d not in ("test", "tests", "idle_test") and not d.startswith("test_"))
        out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return out


def _text_files(path: str) -> list[str]:
    if not os.path.exists(path):
        raise DataError(f"data path {path!r} does not exist; pass a text file, a folder of text files, "
                        "'stdlib' or 'synthetic'")
    if os.path.isfile(path):
        return [path]
    files = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(TEXT_SUFFIXES))
    if not files:
        raise DataError(f"data folder {path!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return files


@lru_cache(maxsize=4)
def load_corpus(source: str = "stdlib", max_bytes: int | None = None) -> np.ndarray:
    """The corpus as uint8 bytes: 'stdlib' (default), a file or a folder of text files."""
    files = corpus_files(source)
    chunks, total = [], 0
    for f in files:
        with open(f, "rb") as fh:
            b = fh.read()
        chunks.append(b)
        total += len(b)
        if max_bytes is not None and total >= max_bytes:
            break
    data = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    if data.size == 0:
        raise DataError(f"data source {source!r} is empty; pass a file or folder with some text in it")
    return data


def corpus_files(source: str) -> list[str]:
    """The text files of `source` ('stdlib', a file or a folder), in the order read."""
    return stdlib_files() if source == "stdlib" else _text_files(source)


def file_pieces(path: str, chunk_bytes: int | None = 1 << 20):
    """One file's text in pieces of about `chunk_bytes`, cut after a newline (None: whole)."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    while text:
        cut = len(text) if chunk_bytes is None else text.find("\n", chunk_bytes) + 1 or len(text)
        yield text[:cut]
        text = text[cut:]


def text_chunks(source: str, chunk_bytes: int = 1 << 20):
    """The corpus's text in pieces of about `chunk_bytes`, cut after a newline (each file
    its own pieces): what a tokenizer encodes as a batch, in parallel."""
    for f in corpus_files(source):
        yield from file_pieces(f, chunk_bytes)


def tokenize_file(path: str, tok) -> np.ndarray:
    """One text file's ids by `tok` (a `dpjax.data.tokenizer` tokenizer), uint32. The file is
    cut into pieces of `tok.piece_bytes` (None: encoded whole, for a tokenizer whose ids
    depend on where a text starts) and encoded as a batch where `tok` can."""
    chunks = list(file_pieces(path, getattr(tok, "piece_bytes", 1 << 20)))
    batch = getattr(tok, "encode_batch", None)
    ids = batch(chunks) if batch else [tok.encode(c) for c in chunks]
    return np.concatenate([np.asarray(piece, np.uint32) for piece in ids]) if ids else np.zeros(0, np.uint32)


def tokenize_corpus(source: str, tok) -> np.ndarray:
    """`source`'s text (as load_corpus finds it) as token ids of `tok` (a
    `dpjax.data.tokenizer` tokenizer), uint32, the files' ids joined in order."""
    data = np.concatenate([tokenize_file(f, tok) for f in corpus_files(source)])
    if data.size == 0:
        raise DataError(f"data source {source!r} is empty; pass a file or folder with some text in it")
    return data
