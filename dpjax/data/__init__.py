"""Byte-level text data or a file of token ids: a deterministic train/validation split,
and batches.

The default corpus is the Python standard library's own source (every Python install
has it; `sysconfig` locates it; `site-packages` and test folders are skipped). A
corpus is one uint8 array; the last `val_fraction` of it is the validation split. A
token file (`.bin`: uint16 or uint32 ids, as nanoGPT's and llm.c's prepare scripts write
them; `python -m dpjax.data.prepare` writes one from text) is memory-mapped and split alike.

Training reads windows of seq_len+1 bytes at stride seq_len, in an order shuffled
once per epoch from the seed. The position in that stream (`cursor`, in windows) is
part of the training state: batch `cursor .. cursor+B` is a pure function of
(seed, cursor), so a resumed run reads exactly what an uninterrupted run would. Each
data-parallel rank (or process) can read only its own rows of a global batch.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
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


@dataclass
class ByteStream:
    """Windows of seq_len+1 tokens from `data`, read in a seeded order, epoch after epoch."""

    data: np.ndarray
    seq_len: int
    seed: int = 0

    def __post_init__(self):
        self.num_windows = (self.data.size - 1) // self.seq_len
        if self.num_windows < 1:
            raise DataError(
                f"the corpus split has {self.data.size} bytes, too few for one sequence of "
                f"{self.seq_len}+1 tokens; use a shorter --seq-len or more data")
        self._epoch, self._order = -1, None

    def _window_ids(self, positions: np.ndarray) -> np.ndarray:
        out = np.empty_like(positions)
        epochs = positions // self.num_windows
        for epoch in np.unique(epochs):
            if epoch != self._epoch:
                self._epoch = int(epoch)
                self._order = np.random.default_rng((self.seed, self._epoch)).permutation(self.num_windows)
            sel = epochs == epoch
            out[sel] = self._order[positions[sel] % self.num_windows]
        return out

    def batch(self, cursor: int, batch_size: int, rows: slice = slice(None)) -> np.ndarray:
        """Rows `rows` of the global batch that starts at window `cursor`: int32 (b, seq_len+1)."""
        positions = np.arange(cursor, cursor + batch_size, dtype=np.int64)[rows]
        starts = self._window_ids(positions) * self.seq_len
        idx = starts[:, None] + np.arange(self.seq_len + 1)
        return self.data[idx].astype(np.int32)


@dataclass
class SyntheticStream:
    """Uniformly random tokens, a pure function of (seed, position): for benchmarks."""

    seq_len: int
    seed: int = 0
    vocab_size: int = 256

    def batch(self, cursor: int, batch_size: int, rows: slice = slice(None)) -> np.ndarray:
        positions = np.arange(cursor, cursor + batch_size, dtype=np.int64)[rows]
        return np.stack([
            np.random.default_rng((self.seed, int(p))).integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int32)
            for p in positions
        ]) if positions.size else np.zeros((0, self.seq_len + 1), np.int32)


TOKEN_SUFFIX = ".bin"  # a file of token ids, not text
LLMC_MAGIC, LLMC_HEADER = 20240520, 256  # llm.c's .bin: 256 int32 (magic, version, count), then uint16 ids


def token_dtype(path: str, given: str = "auto") -> str:
    """The ids' type of token file `path`: what `python -m dpjax.data.prepare` wrote
    beside it (`dpjax.data.token_file`), else `given`, else, for a file without that
    (nanoGPT's, llm.c's, older ones), uint32 if the name says so ('u32' / 'uint32' in
    it), else uint16 (nanoGPT's and llm.c's GPT-2 files)."""
    from dpjax.data.token_file import read_meta

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
    from dpjax.data.token_file import check_fits, read_meta

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


@dataclass
class TokenStream(ByteStream):
    """ByteStream's windows over token ids < vocab_size (a memory-mapped token file):
    a batch reads only its rows' windows from the file."""

    vocab_size: int = 256

    def batch(self, cursor: int, batch_size: int, rows: slice = slice(None)) -> np.ndarray:
        out = super().batch(cursor, batch_size, rows)
        if out.size and out.max() >= self.vocab_size:
            raise DataError(f"the token file holds id {int(out.max())}, not below --vocab-size {self.vocab_size}; "
                            "give the tokenizer's vocabulary size (or check --token-dtype)")
        return out


def _check_vocab(path: str | None, vocab_size: int | None) -> None:
    """A token file whose tokenizer has more ids than the model reads is refused at once
    (not at the first batch that holds one of them)."""
    from dpjax.data.token_file import read_meta, sidecar

    meta = read_meta(path) if path else None
    if meta and vocab_size and meta.get("vocab_size") and meta["vocab_size"] > vocab_size:
        raise DataError(f"{path} was tokenized with {meta['vocab_size']} ids ({sidecar(path)}), more than the "
                        f"model's {vocab_size}; give --vocab-size {meta['vocab_size']} or the model's tokenizer")


def make_streams(source: str, seq_len: int, seed: int, val_fraction: float = 0.05,
                 max_bytes: int | None = None, vocab_size: int | None = None, token_dtype: str = "auto",
                 tokenizer=None):
    """(train stream, validation stream) for 'stdlib', 'synthetic', a text file or
    folder, or a token file (a path ending in .bin: ids below `vocab_size`). tokenizer:
    text is tokenized by it (a `dpjax.data.tokenizer` tokenizer) instead of read as bytes."""
    if seq_len < 1:
        raise DataError(f"sequence length must be positive, got {seq_len}")
    if source == "synthetic":
        v = vocab_size or 256
        return SyntheticStream(seq_len, seed, v), SyntheticStream(seq_len, seed + 1_000_003, v)
    if source.endswith(TOKEN_SUFFIX) or tokenizer is not None:
        data = open_tokens(source, token_dtype) if tokenizer is None else tokenize_corpus(source, tokenizer)
        _check_vocab(source if tokenizer is None else None, vocab_size)
        n_val = max(seq_len + 1, int(data.size * val_fraction))
        if data.size - n_val < seq_len + 1:
            raise DataError(f"the tokens of {source!r} number {data.size}, too few for a train and a "
                            f"validation split of sequences of {seq_len}+1 tokens")
        return (TokenStream(data[:-n_val], seq_len, seed, vocab_size),
                TokenStream(data[-n_val:], seq_len, seed, vocab_size))
    data = load_corpus(source, max_bytes)
    n_val = max(seq_len + 1, int(data.size * val_fraction))
    if data.size - n_val < seq_len + 1:
        raise DataError(
            f"the corpus {source!r} has {data.size} bytes, too few for a train and a validation "
            f"split of sequences of {seq_len}+1 tokens; use a shorter --seq-len (at most "
            f"{max(1, data.size // 2 - 1)}) or more data")
    return ByteStream(data[:-n_val], seq_len, seed), ByteStream(data[-n_val:], seq_len, seed)
