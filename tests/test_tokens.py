"""Token files (`--data X.bin --vocab-size N`, uint16 / uint32, memory-mapped; written by
`python -m dpjax.data.prepare` with the byte tokenizer) and per-process batches: the same
batches as the text they came from, each process reading only its rows (counted), the
library's `shard_batch(..., process_local=True)`, and 2 processes against 1."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import dpjax
from dpjax.train import main

from conftest import read_losses

HERE = os.path.dirname(os.path.abspath(__file__))


def tiny(data, *extra):
    return ["--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "16",
            "--batch-size", "16", "--data", data, "--eval-every", "0", "--eval-batches", "1",
            "--progress", "none", "--mesh", "2x2x2", *extra]


@pytest.fixture(scope="module")
def tokens(corpus, tmp_path_factory):
    """The corpus as a uint16 token file, written by the prepare script's command line."""
    out = tmp_path_factory.mktemp("tok") / "corpus.bin"
    r = subprocess.run([sys.executable, "-m", "dpjax.data.prepare", corpus, str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{out}: 300,000 tokens (uint16)")
    return str(out)


@pytest.fixture(scope="module")
def text_run(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "m.jsonl"
    assert main(tiny(corpus, "--steps", "6", "--metrics", str(path))) == 0
    return read_losses(path)


def test_the_prepared_file_holds_the_bytes(corpus, tokens):
    np.testing.assert_array_equal(np.fromfile(tokens, np.uint16), np.frombuffer(open(corpus, "rb").read(), np.uint8))


@pytest.mark.parametrize("layout", ["uint16", "uint32", "llm.c"])
def test_a_token_file_trains_like_its_text(corpus, tokens, text_run, tmp_path, layout):
    """The byte tokens of the corpus, as a uint16 file, a uint32 file or a uint16 file
    behind llm.c's header: the same batches, so the same losses bit for bit."""
    ids = np.fromfile(tokens, np.uint16)
    data = tokens
    if layout == "uint32":
        data = str(tmp_path / "corpus.u32.bin")
        ids.astype(np.uint32).tofile(data)
    elif layout == "llm.c":
        data = str(tmp_path / "llmc.bin")
        header = np.zeros(256, np.int32)
        header[:3] = (20240520, 1, ids.size)
        with open(data, "wb") as fh:
            fh.write(header.tobytes() + ids.tobytes())
    path = tmp_path / "m.jsonl"
    assert main(tiny(data, "--vocab-size", "256", "--steps", "6", "--metrics", str(path))) == 0
    assert read_losses(path) == text_run


def test_each_block_of_rows_is_read_once():
    """put_batch on 2x4: each of the 2 row blocks is read once, not once per device of
    the model axis that holds it (4 each)."""
    from dpjax.data import SyntheticStream
    from dpjax.step import put_batch

    stream = SyntheticStream(8, seed=1)
    whole, read = stream.batch, []
    stream.batch = lambda c, b, rows=slice(None): (read.extend(range(b)[rows]), whole(c, b, rows))[1]
    x = put_batch(stream, 0, 8, dpjax.make_mesh("2x4"))
    assert sorted(read) == list(range(8))
    np.testing.assert_array_equal(np.asarray(x), whole(0, 8))


def test_process_local_shard_batch_in_one_process():
    mesh = dpjax.make_mesh("2x2x2")
    rows = dpjax.process_rows(mesh, 16)
    assert rows == slice(0, 16)  # one process holds every row
    x = np.arange(16 * 3).reshape(16, 3)
    y = dpjax.shard_batch(mesh, x[rows], process_local=True)
    assert y.sharding == dpjax.shard_batch(mesh, x).sharding
    np.testing.assert_array_equal(np.asarray(y), x)


def test_token_file_errors_are_one_line(tokens, tmp_path, capsys):
    assert main(tiny(tokens, "--steps", "2")) == 2
    want = f"error: --data {tokens} is a token file: give its tokenizer's --vocab-size"
    assert capsys.readouterr().err.strip() == want
    big = tmp_path / "big.bin"
    np.array([1, 2, 300, 4] * 400, np.uint16).tofile(big)
    assert main(tiny(str(big), "--vocab-size", "256", "--steps", "2")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the token file holds id 300, not below --vocab-size 256")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    assert main(tiny(str(odd), "--vocab-size", "256")) == 2
    assert "not a whole number of uint16 ids" in capsys.readouterr().err


def _launch(*args):
    cmd = [sys.executable, "-m", "dpjax.launch", "-n", "2", "--devices-per-process", "4", "--", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_each_process_reads_only_its_rows(tokens):
    r = _launch(sys.executable, os.path.join(HERE, "mp_tokens.py"), tokens)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = sorted((json.loads(line.split("] ", 1)[1]) for line in r.stdout.splitlines() if '"read"' in line),
                  key=lambda x: x["process"])
    assert [s["process"] for s in seen] == [0, 1]
    for s in seen:  # the rows its devices hold, each read once; its process_rows are those rows
        assert [row for _, row in s["read"]] == s["held"] == list(range(*s["rows"]))
    assert seen[0]["held"] == list(range(8)) and seen[1]["held"] == list(range(8, 16))


@pytest.mark.slow
def test_two_processes_equal_one_and_resume_on_one(tokens, text_run, tmp_path):
    path, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    common = tiny(tokens, "--vocab-size", "256", "--metrics", str(path), "--ckpt-dir", str(ckpt), "--ckpt-every", "3")
    r = _launch(sys.executable, "-m", "dpjax.train", *common, "--steps", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    # float32 round-off only: the same global batch, summed across processes in another order
    np.testing.assert_allclose(read_losses(path), text_run[:3], rtol=2e-5, atol=0)
    assert main(common + ["--steps", "6", "--resume"]) == 0  # the 2-process checkpoint, on 1 process
    np.testing.assert_allclose(read_losses(path), text_run, rtol=2e-5, atol=0)
