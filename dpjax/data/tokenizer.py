"""Tokenizers: text <-> ids for --tokenizer, python -m dpjax.data.prepare and dpjax.generate.

    bytes             the byte-level default dpjax trains on: each UTF-8 byte one id (256)
    PATH              a HuggingFace tokenizer.json (the `tokenizers` package, the hf extra):
                      what a Hub model ships, Llama 3's 128k BPE among them
    PATH.model        a SentencePiece model (the `sentencepiece` package, the hf extra):
                      what Llama 2, Mistral, Gemma and T5 ship as tokenizer.model
    bpe:N             a byte-level BPE of N ids trained here on the corpus (`train_bpe`), for
                      a corpus that comes without a tokenizer

`tokenizers` and `sentencepiece` are imported only when a file of theirs (or a BPE) is
asked for; without them the error says how to install them.
"""

from __future__ import annotations

import os

from dpjax.errors import UserError

BYTES = "bytes"


class TokenizerError(UserError):
    """A tokenizer that cannot be loaded or trained; the message says why."""


class BosFirst:
    """A tokenizer with no rule of its own for special tokens: a prompt starts with the model's BOS."""

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def prompt_ids(self, text: str, bos: int | None, specials: bool = True) -> list[int]:
        """A prompt's ids as generation starts from them: after the model's `bos` (config.json's
        bos_token_id) unless `specials` is off. A tokenizer that carries its own rule (`HF`) follows it."""
        return ([bos] if specials and bos is not None else []) + self.encode(text)


class Bytes(BosFirst):
    """Each UTF-8 byte one id."""

    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HF:
    """A `tokenizers.Tokenizer` (from a tokenizer.json or trained here)."""

    def __init__(self, tok, name: str):
        self.tok, self.name = tok, name
        self.vocab_size = tok.get_vocab_size()
        self.eos_id = next((tok.token_to_id(t) for t in ("<|end_of_text|>", "<|end|>", "</s>", "<|endoftext|>")
                            if tok.token_to_id(t) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def prompt_ids(self, text: str, bos: int | None, specials: bool = True) -> list[int]:
        """The special tokens this tokenizer.json's post-processor adds (Llama 3's and Gemma's a BOS,
        Qwen's none), as transformers' `tokenizer(text)` adds them, whatever config.json's `bos`."""
        return self.tok.encode(text, add_special_tokens=specials).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once: `tokenizers` splits the batch over its threads (Rust)."""
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str) -> None:
        self.tok.save(path)


class SentencePiece(BosFirst):
    """A `sentencepiece.SentencePieceProcessor` (a *.model file), no BOS/EOS added (a prompt
    starts with the model's BOS, as transformers' Llama tokenizer's add_bos_token puts it).

    SentencePiece puts a dummy prefix (a '▁' space) before every text it encodes, so
    a text cut in pieces would gain a space at each cut: a file is encoded whole
    (`piece_bytes` None), as the package encodes one document."""

    piece_bytes = None

    def __init__(self, sp, name: str):
        self.sp, self.name = sp, name
        self.vocab_size = sp.get_piece_size()
        self.eos_id = sp.eos_id() if sp.eos_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


def _sentencepiece(spec: str, path: str) -> SentencePiece:
    try:  # an optional dependency (the [hf] extra), imported when a SentencePiece model is read
        import sentencepiece
    except ImportError:
        raise TokenizerError("a SentencePiece model needs the sentencepiece package: pip install 'dpjax[hf]' "
                             "(or pip install sentencepiece)") from None
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.load(path)
    except (OSError, RuntimeError) as e:
        raise TokenizerError(f"--tokenizer {spec}: not a SentencePiece model ({str(e).splitlines()[0][:200]})") \
            from None
    return SentencePiece(sp, path)


def _package():
    try:  # an optional dependency (the [hf] extra), imported when a tokenizer.json is read
        import tokenizers
    except ImportError:
        raise TokenizerError("a tokenizer.json or bpe:N needs HuggingFace's tokenizers: pip install 'dpjax[hf]' "
                             "(or pip install tokenizers)") from None
    return tokenizers


def _in_folder(folder: str) -> str | None:
    """A Hub folder's tokenizer: tokenizer.json, else a SentencePiece tokenizer.model."""
    return next((os.path.join(folder, f) for f in ("tokenizer.json", "tokenizer.model")
                 if os.path.isfile(os.path.join(folder, f))), None)


def load(spec: str | None):
    """The tokenizer `spec` names: None or 'bytes', a tokenizer.json path, a SentencePiece
    *.model (a folder holding either will do). bpe:N is trained by `train_bpe`, on a corpus."""
    if spec in (None, BYTES):
        return Bytes()
    if spec.startswith("bpe:"):
        raise TokenizerError(f"--tokenizer {spec} trains on a corpus: python -m dpjax.data.prepare --tokenizer {spec} "
                             "TEXT... --out tokens.bin trains it and saves its tokenizer.json beside the tokens")
    path = (_in_folder(spec) or os.path.join(spec, "tokenizer.json")) if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise TokenizerError(f"--tokenizer {spec}: no such file (a tokenizer.json, a SentencePiece .model, bytes, "
                             "or bpe:N)")
    if path.endswith(".model"):
        return _sentencepiece(spec, path)
    try:
        return HF(_package().Tokenizer.from_file(path), path)
    except Exception as e:  # tokenizers raises its own Exception type for a bad file
        if isinstance(e, UserError):
            raise
        raise TokenizerError(f"--tokenizer {spec}: not a tokenizer.json ({str(e).splitlines()[0][:200]})") from None


def bpe_size(spec: str) -> int | None:
    """N of 'bpe:N', None for anything else; a bad N is an error."""
    if not spec.startswith("bpe:"):
        return None
    n = spec[4:]
    if not n.isdigit() or not 257 <= int(n) <= 2**32:
        raise TokenizerError(f"--tokenizer {spec}: bpe:N takes N > 256 ids (the 256 bytes and merges), e.g. bpe:8192")
    return int(n)


def train_bpe(texts, vocab_size: int) -> HF:
    """A byte-level BPE (GPT-2's scheme: bytes first, then merges) of `vocab_size` ids
    trained on `texts` (an iterable of strings), with <|endoftext|> as its last-added id."""
    t = _package()
    tok = t.Tokenizer(t.models.BPE())
    tok.pre_tokenizer = t.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = t.decoders.ByteLevel()
    trainer = t.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                    initial_alphabet=t.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return HF(tok, f"bpe:{vocab_size}")


def for_model(source: str | None, given: str | None, vocab_size: int, text: bool = True):
    """The tokenizer of a model's ids: `given` (--tokenizer), else the tokenizer.json (or
    tokenizer.model) of an hf:DIR source, else bytes for a 256-id model fed text (`text`); None when none
    is known (the ids are then shown as they are)."""
    if given:
        return load(given)
    found = _in_folder(source[3:]) if source and source.startswith("hf:") else None
    if found:
        return load(found)
    return Bytes() if vocab_size == 256 and text else None


def vocab_of(spec: str) -> int:
    """The vocabulary `spec` gives (bpe:N: N; a file: its size) without training anything."""
    n = bpe_size(spec)
    return n if n is not None else load(spec).vocab_size


def for_corpus(spec: str, chunks):
    """`spec`'s tokenizer; bpe:N trained on `chunks` (an iterable of text) here."""
    n = bpe_size(spec)
    return train_bpe(chunks, n) if n is not None else load(spec)
