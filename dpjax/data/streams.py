"""The streams a run reads its batches from: windows of seq_len+1 tokens at stride seq_len,
in an order shuffled once per epoch from the seed. The position in a stream (`cursor`, in
windows) is part of the training state: batch `cursor .. cursor+B` is a pure function of
(seed, cursor), so a resumed run reads exactly what an uninterrupted run would, and each
data-parallel rank (or process) can read only its own rows of a global batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpjax.data.corpus import DataError, load_corpus, tokenize_corpus
from dpjax.data.tokens import TOKEN_SUFFIX, check_vocab, open_tokens


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
        check_vocab(source if tokenizer is None else None, vocab_size)
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
