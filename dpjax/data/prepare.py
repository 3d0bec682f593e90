"""Text -> a token file for `python -m dpjax.train --data FILE.bin --vocab-size N`:

    python -m dpjax.data.prepare corpus.txt tokens.bin                          # bytes: --vocab-size 256
    python -m dpjax.data.prepare docs/ notes.txt --out tokens.bin --tokenizer tokenizer.json
    python -m dpjax.data.prepare docs/ --out tokens.bin --tokenizer tokenizer.model  # SentencePiece
    python -m dpjax.data.prepare stdlib --out tokens.bin --tokenizer bpe:8192  # trains a BPE here

The default tokenizer is the byte one dpjax trains on (each byte of the UTF-8 text one
id, 256 ids). --tokenizer takes a HuggingFace tokenizer.json (the `tokenizers` package:
a file is cut into pieces at line ends and encoded as a batch, on its threads), a
SentencePiece *.model (each file encoded whole), or bpe:N, a byte-level BPE of N ids
trained on these texts and saved beside the tokens (tokens.tokenizer.json). Several
files are tokenized by a pool of --workers processes (default: one a core), their ids
written in the files' order. The ids are written flat, native-endian, as numpy's `tofile`
writes them: uint16 when the vocabulary fits and the name does not say u32, else uint32;
beside them `tokens.bin.json` says which (and the count, the vocabulary, the tokenizer),
and training trusts it over the name (`dpjax.data.token_file`). A file written by
nanoGPT's or llm.c's prepare scripts (GPT-2's BPE, uint16) is read as before. An existing
token file is not replaced unless --overwrite; nothing is half-written (a temporary file
is renamed into place).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys

import numpy as np

from dpjax.data import TOKEN_SUFFIX, DataError, corpus_files, load_corpus, text_chunks, token_file, tokenize_file
from dpjax.data.tokenizer import for_corpus
from dpjax.errors import UserError, os_error_line

BYTE_VOCAB = 256


def _check_out(out: str, overwrite: bool, also=()) -> None:
    if not out.endswith(TOKEN_SUFFIX):
        raise DataError(f"{out}: a token file's name ends in {TOKEN_SUFFIX} (that is how --data tells it from text)")
    token_file.refuse_existing([out, token_file.sidecar(out), *also], overwrite)


def named_wide(out: str) -> bool:
    """The name promises 32-bit ids (tokens.u32.bin): other readers go by it, so auto keeps it."""
    name = os.path.basename(out).lower()
    return "u32" in name or "uint32" in name


def prepare(source: str, out: str, dtype: str = "uint16", overwrite: bool = False) -> int:
    """Writes `source`'s (a text file or folder, or 'stdlib') byte tokens to `out`, and
    what it holds beside it; returns how many."""
    _check_out(out, overwrite)
    ids = load_corpus(source)  # bytes: every id < 256 fits either type
    return token_file.write(out, [ids], dtype, {"vocab_size": BYTE_VOCAB, "tokenizer": "bytes"})


_worker_tok = None


def _start_worker(tok, threads: int) -> None:
    """A pool process: its tokenizer, and `tokenizers`' thread pool sized to its share of
    the cores (before its first batch starts the pool), so P processes do not each run
    a thread a core."""
    global _worker_tok
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    _worker_tok = tok


def _tokenize(path: str) -> np.ndarray:
    return tokenize_file(path, _worker_tok)


def token_pieces(files: list[str], tok, workers: int):
    """Each of `files`' ids (uint32) by `tok`, in the files' order: in this process when
    `workers` is 1 (or there is one file), else by a pool of `workers` processes. The
    pool is spawned, not forked: this process may hold JAX's and `tokenizers`' threads."""
    workers = max(1, min(workers, len(files)))
    if workers == 1:
        yield from (tokenize_file(f, tok) for f in files)
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    with multiprocessing.get_context("spawn").Pool(workers, _start_worker, (tok, threads)) as pool:
        yield from pool.imap(_tokenize, files)


def default_workers() -> int:
    return len(os.sched_getaffinity(0))


def prepare_tokens(sources: list[str], out: str, tokenizer: str, dtype: str = "auto",
                   workers: int | None = None, overwrite: bool = False) -> tuple[int, int, str, str]:
    """Writes the tokens of `sources` (texts, folders, 'stdlib'; in order) by `tokenizer`
    (a tokenizer.json, a SentencePiece .model, or bpe:N, trained on them and saved beside
    `out`) to `out`, `workers` processes (default: one a core) tokenizing the files.
    Returns (tokens, vocabulary, dtype, the tokenizer's file)."""
    bpe = out[:-len(TOKEN_SUFFIX)] + ".tokenizer.json" if tokenizer.startswith("bpe:") else None
    _check_out(out, overwrite, [bpe] if bpe else [])
    tok = for_corpus(tokenizer, (c for s in sources for c in text_chunks(s)))
    saved = getattr(tok, "name", tokenizer)
    if dtype == "auto":
        dtype = "uint16" if tok.vocab_size <= 2**16 and not named_wide(out) else "uint32"
    elif dtype == "uint16" and tok.vocab_size > 2**16:
        raise UserError(f"--dtype uint16 cannot hold {tok.vocab_size} ids; use uint32")
    if bpe:
        tok.save(bpe)
        saved = bpe
    files = [f for s in sources for f in corpus_files(s)]
    n = token_file.write(out, token_pieces(files, tok, workers or default_workers()), dtype,
                         {"vocab_size": tok.vocab_size, "tokenizer": os.path.abspath(saved)})
    if n == 0:
        raise DataError(f"{' '.join(sources)}: no text to tokenize; pass files or folders with some text in them")
    return n, tok.vocab_size, dtype, saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpjax.data.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+", help="text files, folders of text files, or 'stdlib' (without --out, the "
                                              "last one is the token file to write)")
    p.add_argument("--out", help=f"the token file to write (ends in {TOKEN_SUFFIX})")
    p.add_argument("--tokenizer", default="bytes", help="bytes (default), a tokenizer.json, a SentencePiece .model, "
                                                        "or bpe:N")
    p.add_argument("--workers", type=int, default=None, help="processes tokenizing the files (default: one a core; "
                                                             "1: in this process)")
    p.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto",
                   help="the ids' type (auto: uint16 when the vocabulary fits and the name does not say u32); "
                        "written beside the file (FILE.bin.json), which training trusts")
    p.add_argument("--overwrite", action="store_true", help="replace an existing token file (default: refuse)")
    args = p.parse_args(argv)
    sources, out = (args.sources, args.out) if args.out else (args.sources[:-1], args.sources[-1])
    try:
        if not sources:
            raise DataError("no text to prepare: give TEXT... --out FILE.bin")
        if args.tokenizer == "bytes":
            dtype = ("uint32" if named_wide(out) else "uint16") if args.dtype == "auto" else args.dtype
            if len(sources) > 1:
                raise DataError("the byte tokenizer prepares one source (a file or a folder); give a folder")
            n, vocab, saved = prepare(sources[0], out, dtype, args.overwrite), BYTE_VOCAB, None
        else:
            if args.workers is not None and args.workers < 1:
                raise UserError("--workers must be at least 1")
            n, vocab, dtype, saved = prepare_tokens(sources, out, args.tokenizer, args.dtype, args.workers,
                                                    args.overwrite)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a read-only or missing folder, a full disk: what was there is kept
        print(f"error: {os_error_line(e, out)}", file=sys.stderr)
        return 2
    print(f"{out}: {n:,} tokens ({dtype}" + (f", tokenizer {saved}" if saved else "") +
          f"); train with --data {out} --vocab-size {vocab}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
