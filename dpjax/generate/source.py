"""What `python -m dpjax.generate` reads of the model it is given (hf:DIR or a dpjax
checkpoint): the model at the length a run needs, its context, its tokenizer (a
tokenizer.json) and its end-of-sequence ids.

The context is the longest prompt + continuation the model takes: a HuggingFace config's
`max_position_embeddings` (the folder's, or that of the folder a checkpoint descends
from), else the `seq_len` it was trained at. A model whose parameters hold a table of
positions (the GPT's learned `pos_TxD`) runs at the seq_len its checkpoint was saved with
(the table's rows; a shorter sequence reads the first rows); one whose parameters do not
depend on the length (rotary positions: the Llama) is rebuilt at the length the run needs,
so that its rope table is no longer than that.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax

from dpjax.data.tokenizer import Bytes, load
from dpjax.errors import UserError
from dpjax.hf import model_of
from dpjax.hf.identity import origin
from dpjax.hf.load import HF_PREFIX
from dpjax.models.lora import Lora

TOKENIZER_JSON, SENTENCEPIECE = "tokenizer.json", "tokenizer.model"
GENERATION_CONFIG = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class Source:
    spec: str  # as given: hf:DIR or a checkpoint folder
    model: object  # as saved (its own seq_len)
    hub: dict | None  # the HuggingFace config.json it is (or descends from), else None
    record: dict | None  # the dpjax checkpoint's record, else None
    folder: str | None  # the Hub folder (hf:DIR's, or the one a checkpoint was imported from), if still there

    @property
    def context(self) -> int:
        """The most positions a prompt and its continuation may take together."""
        hub_context = (self.hub or {}).get("max_position_embeddings")
        if isinstance(hub_context, int) and hub_context > 0 and _length_free(self.model):
            return hub_context
        return self.model.config.seq_len

    def model_for(self, length: int):
        """The model to run `length` positions (at most `context`): rebuilt at that seq_len
        where its parameters do not depend on it, else as saved."""
        if not _length_free(self.model) or length == self.model.config.seq_len:
            return self.model
        return model_of(self.spec, seq_len=length)[0]


def open_source(spec: str) -> Source:
    model, hub, record = model_of(spec)
    if spec.startswith(HF_PREFIX):
        return Source(spec, model, hub, None, spec[len(HF_PREFIX):])
    found = origin(spec, record)  # a checkpoint imported from the Hub, or trained from one: that model's config
    return Source(spec, model, hub or (found.config if found else None), record, found.folder if found else None)


def _length_free(model) -> bool:
    """True when the model's parameters have the same shapes at any seq_len (no table of
    positions): compared by shape only (`jax.eval_shape`), nothing computed. A LoRA model's
    adapters never depend on it: its base decides."""
    if isinstance(model, Lora):
        return _length_free(model.base)
    other = dataclasses.replace(model.config, seq_len=model.config.seq_len + 1)
    shapes = [jax.tree.map(lambda x: x.shape, jax.eval_shape(m.init, jax.random.key(0)))
              for m in (model, type(model)(other))]
    return shapes[0] == shapes[1]


def tokenizer_of(source: Source, given: str | None):
    """The tokenizer of the model's ids: --tokenizer, else the folder's tokenizer.json, else
    bytes for a 256-id model; None: ids only. A folder with a SentencePiece tokenizer.model
    and no tokenizer.json is refused: transformers reads that file with its class's settings
    (Gemma's no dummy prefix, the special tokens whole), which the raw `sentencepiece`
    package does not apply, so its ids would not be the model's
    (tests/fixtures/make_sentencepiece_tokenizer_fixtures.py shows them differ)."""
    if given:
        return load(given)
    if source.folder and os.path.isfile(os.path.join(source.folder, TOKENIZER_JSON)):
        return load(os.path.join(source.folder, TOKENIZER_JSON))
    if source.folder and os.path.isfile(os.path.join(source.folder, SENTENCEPIECE)):
        raise UserError(f"{source.folder} has a SentencePiece {SENTENCEPIECE} and no {TOKENIZER_JSON}: write one "
                        "with transformers (python -c \"from transformers import AutoTokenizer as T; "
                        f"T.from_pretrained('{source.folder}').save_pretrained('{source.folder}')\"), or give "
                        f"--tokenizer {os.path.join(source.folder, SENTENCEPIECE)} to encode with SentencePiece as "
                        "it is (ids may differ from transformers')")
    return Bytes() if source.model.config.vocab_size == 256 else None


def _ids(value) -> list[int]:
    """An `eos_token_id` as HuggingFace writes it: an int, a list of them, or null."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise UserError(f"eos_token_id {value!r}: expected an id or a list of ids")
    return values


def eos_ids(source: Source, tok) -> list[int]:
    """Every id that ends a sequence: config.json's `eos_token_id` and generation_config.json's
    (one id or a list: Llama 3 Instruct and Qwen list several, e.g. end of text and end of
    turn), else the tokenizer's end-of-text id; [] when none is known."""
    ids = _ids((source.hub or {}).get("eos_token_id"))
    path = os.path.join(source.folder, GENERATION_CONFIG) if source.folder else None
    if path and os.path.isfile(path):
        try:
            with open(path) as f:
                generation = json.load(f)
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: not readable as JSON ({e})") from None
        ids += [i for i in _ids(generation.get("eos_token_id")) if i not in ids]
    if not ids and tok is not None and tok.eos_id is not None:
        ids = [tok.eos_id]
    return ids
