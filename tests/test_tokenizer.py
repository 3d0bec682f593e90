"""Real tokenizers: python -m dpjax.data.prepare --tokenizer against HuggingFace `tokenizers`'
own encoding, a BPE trained here (lossless: its ids decode to the text), the training
data tokenized on the fly, and the one-line errors."""

import os

import numpy as np
import pytest

from dpjax.data import make_streams
from dpjax.data.prepare import main as prepare
from dpjax.data.tokenizer import load
from dpjax.errors import UserError

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "llama_tiny", "tokenizer.json")
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog, {i * i} times\n" for i in range(300))


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


def test_prepare_with_a_tokenizer_json_writes_its_ids(corpus, tmp_path):
    from tokenizers import Tokenizer

    out = str(tmp_path / "t.bin")
    assert prepare([corpus, "--out", out, "--tokenizer", FIXTURE]) == 0
    want = Tokenizer.from_file(FIXTURE).encode(TEXT, add_special_tokens=False).ids
    np.testing.assert_array_equal(np.fromfile(out, np.uint16), want)


def test_prepare_trains_a_bpe_that_gives_the_text_back(corpus, tmp_path, capsys):
    out = str(tmp_path / "t.bin")
    assert prepare([corpus, "--out", out, "--tokenizer", "bpe:300"]) == 0
    assert "--vocab-size 300" in capsys.readouterr().out
    tok = load(str(tmp_path / "t.tokenizer.json"))
    ids = np.fromfile(out, np.uint16)
    assert tok.vocab_size == 300 and ids.max() < 300 and ids.size < len(TEXT) / 2  # merges: fewer ids than bytes
    assert tok.decode(ids) == TEXT


def test_text_data_tokenized_for_training(corpus):
    """make_streams with a tokenizer: every row is a window of the corpus's ids."""
    tok = load(FIXTURE)
    ids = np.asarray(tok.encode(TEXT))
    train, _val = make_streams(corpus, 16, 0, vocab_size=tok.vocab_size, tokenizer=tok)
    rows = train.batch(3, 4)
    assert rows.shape == (4, 17)
    for row in rows:
        starts = [i for i in range(ids.size - 16) if np.array_equal(ids[i:i + 17], row)]
        assert starts, row


def test_user_errors_are_one_line(corpus, tmp_path, capsys):
    from dpjax.train.cli import main as train

    assert prepare([corpus, "--out", str(tmp_path / "t.bin"), "--tokenizer", "nothing.json"]) == 2
    assert prepare([corpus, "--out", str(tmp_path / "t.bin"), "--tokenizer", "bpe:12"]) == 2
    assert train(["--tokenizer", FIXTURE, "--data", "synthetic", "--dry-run"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(e.startswith("error: ") for e in errors), errors
    assert "no such file" in errors[0] and "bpe:N takes N > 256" in errors[1] and "tokenizes text" in errors[2]


@pytest.mark.slow  # a training run's compile
def test_train_with_a_tokenizer(corpus, capsys):
    from dpjax.train.cli import main as train

    assert train(["--tokenizer", FIXTURE, "--data", corpus, "--mesh", "1x1", "--steps", "2", "--batch-size", "2",
                  "--seq-len", "16", "--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--d-ff", "32",
                  "--eval-every", "0", "--progress", "log", "--sample-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "sample: " in out and "done: 2 steps" in out.strip().splitlines()[-1]


def test_prepare_in_parallel_equals_serial(tmp_path):
    """Several files over a pool of 2 processes: the same bytes as in this process, each
    file's ids in the files' order (a folder's sorted files, then the next source)."""
    from tokenizers import Tokenizer

    folder = tmp_path / "docs"
    folder.mkdir()
    texts = [TEXT[i * 1000:(i + 1) * 1000 + 7 * i] for i in range(5)]
    for i, text in enumerate(texts[:4]):
        (folder / f"{i}.txt").write_text(text)
    (tmp_path / "last.txt").write_text(texts[4])
    serial, parallel = str(tmp_path / "s.bin"), str(tmp_path / "p.bin")
    sources = [str(folder), str(tmp_path / "last.txt"), "--tokenizer", FIXTURE]
    assert prepare([*sources, "--out", serial, "--workers", "1"]) == 0
    assert prepare([*sources, "--out", parallel, "--workers", "2"]) == 0
    tok = Tokenizer.from_file(FIXTURE)
    want = np.concatenate([tok.encode(t, add_special_tokens=False).ids for t in texts])
    np.testing.assert_array_equal(np.fromfile(serial, np.uint16), want)
    assert (tmp_path / "p.bin").read_bytes() == (tmp_path / "s.bin").read_bytes()


def test_docs_recipe_token_width_is_recorded_not_guessed(corpus, tmp_path, capsys):
    """docs/hf.md's `prepare my_texts/ --out tokens.u32.bin --tokenizer tokenizer.json`, as a
    process, with a vocabulary of 320: training reads back the tokenizer's ids. The width is
    written beside the file and trusted over the name (--dtype uint16 into a u32 name); a
    file without it is read by its name as before; a second prepare onto it is refused in
    one line with nothing replaced (also as a process) unless --overwrite; an --out that
    cannot be written is one line."""
    import subprocess
    import sys

    from tokenizers import Tokenizer

    from dpjax.data import open_tokens

    texts = tmp_path / "my_texts"
    texts.mkdir()
    os.replace(corpus, texts / "a.txt")
    out = str(tmp_path / "tokens.u32.bin")
    cmd = [sys.executable, "-m", "dpjax.data.prepare", str(texts), "--out", out, "--tokenizer", FIXTURE,
           "--workers", "1"]
    want = Tokenizer.from_file(FIXTURE).encode(TEXT, add_special_tokens=False).ids

    def read():
        train, val = make_streams(out, 16, 0, vocab_size=320)
        return np.concatenate([train.data, val.data])

    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(read(), want)
    before = open(out, "rb").read()
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert (r.returncode, r.stderr) == (2, f"error: {out} exists; pass --overwrite to replace it (nothing was "
                                            "written)\n")
    assert open(out, "rb").read() == before
    assert prepare([str(texts), "--out", out, "--tokenizer", FIXTURE, "--workers", "1", "--dtype", "uint16",
                    "--overwrite"]) == 0
    assert os.path.getsize(out) == 2 * len(want)
    np.testing.assert_array_equal(read(), want)  # the name says u32, the file says uint16: the file wins
    os.truncate(out, 2 * len(want) - 2)
    with pytest.raises(UserError, match="were not written together") as e:
        read()
    assert "\n" not in str(e.value)
    os.remove(out + ".json")  # an older file, or nanoGPT's: the name decides, as before
    os.truncate(out, 4 * (len(want) // 2))
    assert open_tokens(out).dtype == np.uint32
    (tmp_path / "afile").write_text("")
    capsys.readouterr()
    assert prepare([str(texts), "--out", str(tmp_path / "afile" / "t.bin")]) == 2
    assert capsys.readouterr().err == f"error: cannot write {tmp_path / 'afile' / 't.bin'}: Not a directory\n"
