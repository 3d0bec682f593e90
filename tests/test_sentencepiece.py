"""SentencePiece models (*.model) wherever dpjax takes a tokenizer: python -m dpjax.data.prepare
against the `sentencepiece` package's own encode (and its decode giving the text back),
a folder's tokenizer.model, generation's prompt, a training run on the token file, and
the one-line error. The model is trained here, in well under a second, on a few KB."""

import io
import json
import os

import numpy as np
import pytest
import sentencepiece as spm

from dpjax.data.prepare import main as prepare
from dpjax.data.tokenizer import for_model, load

LLAMA = os.path.join(os.path.dirname(__file__), "fixtures", "llama_tiny")
TEXTS = ["".join(f"line {i}: the quick brown fox jumps over the lazy dog, {i * i} times\n" for i in range(150)),
         "  Indented, trailing spaces  \n\nand a blank line; caf\u00e9 \u20ac 5\n" * 20]


def train_model(path, vocab_size):
    """A BPE SentencePiece model as Llama 2's is made: byte fallback, the text as it is
    (identity normalization, whitespace kept), so that any text decodes back to itself."""
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter("".join(TEXTS).splitlines()), model_writer=proto,
                                   vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    path.write_bytes(proto.getvalue())
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    model = train_model(d / "sp.model", 340)
    texts = []
    for i, text in enumerate(TEXTS):
        (d / f"{i}.txt").write_text(text)
        texts.append(str(d / f"{i}.txt"))
    return model, texts


def test_prepare_writes_sentencepieces_own_ids_and_they_decode_to_the_text(files, tmp_path, capsys):
    model, texts = files
    out = str(tmp_path / "t.bin")
    assert prepare([*texts, "--out", out, "--tokenizer", model, "--workers", "1"]) == 0
    assert "--vocab-size 340" in capsys.readouterr().out
    sp = spm.SentencePieceProcessor(model_file=model)
    per_file = [sp.encode(t) for t in TEXTS]  # each file one document, as the package encodes it
    ids = np.fromfile(out, np.uint16)
    np.testing.assert_array_equal(ids, np.concatenate(per_file))
    assert ids.size < len("".join(TEXTS)) / 2  # merges: fewer ids than characters
    tok = load(model)
    assert tok.vocab_size == 340 and tok.eos_id == sp.eos_id()
    cut = len(per_file[0])
    assert [tok.decode(ids[:cut]), tok.decode(ids[cut:])] == TEXTS


def test_a_folders_tokenizer_model_and_generation(files, tmp_path, capsys):
    """hf:DIR with a tokenizer.model and no tokenizer.json; generate's --tokenizer X.model
    encodes the prompt (after config.json's BOS) and decodes the new ids by it."""
    from dpjax.generate.__main__ import main as generate

    model = train_model(tmp_path / "tokenizer.model", 320)  # the fixture Llama's 320 ids
    assert isinstance(for_model(f"hf:{tmp_path}", None, 320), type(load(model)))
    sp = spm.SentencePieceProcessor(model_file=model)
    assert generate(["--init-from", f"hf:{LLAMA}", "--tokenizer", model, "--prompt", "line 7: the quick",
                     "--max-new-tokens", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["prompt_ids"] == [0] + sp.encode("line 7: the quick")
    assert got["text"] == sp.decode(got["new_ids"]) and len(got["new_ids"]) <= 4


def test_not_a_sentencepiece_model_is_one_line(files, tmp_path, capsys):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a protobuf")
    assert prepare([files[1][0], "--out", str(tmp_path / "t.bin"), "--tokenizer", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "not a SentencePiece model" in err


@pytest.mark.slow  # a training run's compile
def test_train_on_the_token_file_and_on_text(files, tmp_path, capsys):
    """prepare over a pool of 2 (the model pickled to each), then training on its ids,
    and on the text tokenized by the model on the fly (a sample printed at the end)."""
    from dpjax.train.cli import main as train

    model, texts = files
    out = str(tmp_path / "t.bin")
    assert prepare([*texts, "--out", out, "--tokenizer", model, "--workers", "2"]) == 0  # the model to the pool
    sp = spm.SentencePieceProcessor(model_file=model)
    np.testing.assert_array_equal(np.fromfile(out, np.uint16), np.concatenate([sp.encode(t) for t in TEXTS]))
    small = ["--mesh", "1x1", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--d-model", "16",
             "--n-heads", "2", "--n-layers", "1", "--d-ff", "32", "--eval-every", "0", "--progress", "log"]
    assert train([*small, "--data", out, "--vocab-size", "340"]) == 0
    assert "done: 2 steps" in capsys.readouterr().out.strip().splitlines()[-1]
    assert train([*small, "--data", texts[0], "--tokenizer", model, "--sample-tokens", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "done: 2 steps" in lines[-1] and any(x.startswith("sample: ") for x in lines)
