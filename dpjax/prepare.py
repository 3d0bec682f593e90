"""Text -> a token file for `python -m dpjax.train --data FILE.bin --vocab-size N`:

    python -m dpjax.prepare corpus.txt tokens.bin                # bytes: --vocab-size 256
    python -m dpjax.prepare docs/ tokens.u32.bin --dtype uint32

The tokenizer is the byte one dpjax trains on (each byte of the UTF-8 text one id, 256
ids), so the token-file path is tested end to end without a tokenizer package; a file
written by nanoGPT's or llm.c's prepare scripts (GPT-2's BPE, uint16) is read the same
way. The ids are written flat, native-endian, as numpy's `tofile` writes them.
"""

from __future__ import annotations

import argparse
import sys

from dpjax.data import TOKEN_SUFFIX, DataError, load_corpus

BYTE_VOCAB = 256


def prepare(source: str, out: str, dtype: str = "uint16") -> int:
    """Writes `source`'s (a text file or folder, or 'stdlib') byte tokens to `out`;
    returns how many."""
    if not out.endswith(TOKEN_SUFFIX):
        raise DataError(f"{out}: a token file's name ends in {TOKEN_SUFFIX} (that is how --data tells it from text)")
    ids = load_corpus(source).astype(dtype)  # bytes: every id < 256 fits either type
    ids.tofile(out)
    return int(ids.size)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpjax.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a text file, a folder of text files, or 'stdlib'")
    p.add_argument("out", help=f"the token file to write (ends in {TOKEN_SUFFIX})")
    p.add_argument("--dtype", choices=("uint16", "uint32"), default="uint16")
    args = p.parse_args(argv)
    try:
        n = prepare(args.source, args.out, args.dtype)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {n:,} tokens ({args.dtype}); train with --data {args.out} --vocab-size {BYTE_VOCAB}"
          + (" --token-dtype uint32" if args.dtype == "uint32" and "32" not in args.out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
