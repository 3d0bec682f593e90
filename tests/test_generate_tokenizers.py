"""The tokenizer.json files that transformers' Gemma and Mistral (Llama 2) fast tokenizers
write from a SentencePiece model (tests/fixtures/make_sentencepiece_tokenizer_fixtures.py):
dpjax encodes texts to transformers' ids and decodes them back; a folder with only the
tokenizer.model is refused by `python -m dpjax.generate` in one line that says how to
convert it (raw SentencePiece gives other ids: the fixture records both)."""

import json
import os
import shutil

import pytest

from dpjax.data.tokenizer import load
from dpjax.generate.__main__ import main

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.mark.parametrize("family", ["gemma", "mistral"])
def test_fast_tokenizer_files_encode_as_transformers(family):
    folder = os.path.join(FIXTURES, "sp_tokenizers", family)
    expected = json.load(open(os.path.join(folder, "expected.json")))
    tok = load(os.path.join(folder, "tokenizer.json"))
    assert [tok.encode(t) for t in expected["texts"]] == expected["ids"]
    assert [tok.decode(i) for i in expected["ids"]] == expected["decoded"]
    assert expected["ids"] != expected["sentencepiece_ids"]  # what the refusal below avoids


def test_a_sentencepiece_only_folder_is_one_line(tmp_path, capsys):
    shutil.copy(os.path.join(FIXTURES, "llama_tiny", "config.json"), tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"a SentencePiece model")
    assert main(["--init-from", f"hf:{tmp_path}", "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no tokenizer.json" in err and "save_pretrained" in err


def test_a_prompt_starts_with_the_special_tokens_transformers_adds():
    """generate --prompt's ids are transformers' tokenizer(text).input_ids (tests/fixtures/prompt_ids.json):
    the BOS where the tokenizer.json's post-processor puts one (llama_tiny, as Llama 3's), none where it
    puts none (chat_tiny/chatml, as Qwen's), whatever bos_token_id config.json names; --no-bos: none."""
    expected = json.load(open(os.path.join(FIXTURES, "prompt_ids.json")))
    for folder, ids in expected["ids"].items():
        tok = load(os.path.join(FIXTURES, folder, "tokenizer.json"))
        assert [tok.prompt_ids(t, bos=0) for t in expected["texts"]] == ids, folder
        assert [tok.prompt_ids(t, bos=0, specials=False) for t in expected["texts"]] == [
            tok.encode(t) for t in expected["texts"]]
    assert expected["ids"]["llama_tiny"][0][0] == 0 and 0 not in expected["ids"]["chat_tiny/chatml"][0]
