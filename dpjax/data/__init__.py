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

The rooms: corpus (text files, bytes, a tokenizer's ids), tokens (token files), streams
(the windows a run reads); chat, chat_template, packing, sft and pref for chat and
preference data; tokenizer; prepare (`python -m dpjax.data.prepare`).
"""

from dpjax.data.corpus import (TEXT_SUFFIXES, DataError, corpus_files, file_pieces, load_corpus, stdlib_files,
                               text_chunks, tokenize_corpus, tokenize_file)
from dpjax.data.streams import ByteStream, SyntheticStream, TokenStream, make_streams
from dpjax.data.tokens import LLMC_HEADER, LLMC_MAGIC, TOKEN_SUFFIX, open_tokens, token_dtype

__all__ = ["LLMC_HEADER", "LLMC_MAGIC", "TEXT_SUFFIXES", "TOKEN_SUFFIX", "ByteStream", "DataError", "SyntheticStream",
           "TokenStream", "corpus_files", "file_pieces", "load_corpus", "make_streams", "open_tokens", "stdlib_files",
           "text_chunks", "token_dtype", "tokenize_corpus", "tokenize_file"]
