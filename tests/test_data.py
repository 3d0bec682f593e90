"""The byte corpus, its split, and deterministic batches."""

import numpy as np
import pytest

from dpjax.data import DataError, ByteStream, load_corpus, make_streams, stdlib_files


def test_stdlib_corpus_skips_tests_and_site_packages():
    files = stdlib_files()
    assert len(files) > 100
    assert not any("site-packages" in f or "/test/" in f or "/tests/" in f for f in files)
    assert any(f.endswith("/os.py") for f in files)


def test_split_is_deterministic_and_disjoint(tmp_path):
    text = bytes(range(256)) * 40
    (tmp_path / "a.txt").write_bytes(text)
    train, val = make_streams(str(tmp_path), seq_len=16, seed=0, val_fraction=0.1)
    assert train.data.size + val.data.size == len(text)
    np.testing.assert_array_equal(np.concatenate([train.data, val.data]), np.frombuffer(text, np.uint8))


def test_batches_are_windows_in_a_seeded_order():
    data = np.arange(1000, dtype=np.uint8)
    s = ByteStream(data, seq_len=10, seed=3)
    b = s.batch(0, 8)
    assert b.shape == (8, 11) and b.dtype == np.int32
    for row in b:  # each row is a contiguous window of the corpus
        np.testing.assert_array_equal(np.diff(row.astype(np.int64)) % 256, 1)
    np.testing.assert_array_equal(b, ByteStream(data, 10, seed=3).batch(0, 8))  # reproducible
    assert not np.array_equal(b, ByteStream(data, 10, seed=4).batch(0, 8))  # the seed matters
    # a rank's rows are exactly its slice of the global batch
    np.testing.assert_array_equal(s.batch(40, 8, rows=slice(2, 4)), s.batch(40, 8)[2:4])


def test_one_epoch_visits_every_window_once_then_reshuffles():
    data = np.random.default_rng(0).integers(0, 256, 10 * 20 + 1).astype(np.uint8)
    s = ByteStream(data, seq_len=10, seed=0)
    assert s.num_windows == 20
    epoch0 = s.batch(0, 20)
    starts = sorted(int(np.flatnonzero((np.lib.stride_tricks.sliding_window_view(data, 11) == r).all(1))[0])
                    for r in epoch0)
    assert starts == list(range(0, 200, 10))
    epoch1 = s.batch(20, 20)
    assert sorted(map(bytes, epoch0.astype(np.uint8))) == sorted(map(bytes, epoch1.astype(np.uint8)))
    assert not np.array_equal(epoch0, epoch1)
    # crossing the epoch boundary in one batch reads the same as two separate reads
    np.testing.assert_array_equal(s.batch(15, 10), np.concatenate([epoch0[15:], epoch1[:5]]))


def test_synthetic_is_a_function_of_seed_and_position():
    tr, va = make_streams("synthetic", 32, seed=1)
    np.testing.assert_array_equal(tr.batch(5, 4)[1:3], tr.batch(5, 4, rows=slice(1, 3)))
    assert not np.array_equal(tr.batch(0, 4), va.batch(0, 4))


def test_bad_data(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        make_streams(str(tmp_path / "nope"), 16, 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no text files"):
        make_streams(str(tmp_path / "empty"), 16, 0)
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(DataError, match="is empty"):
        load_corpus(str(tmp_path / "e.txt"))
    (tmp_path / "short.txt").write_text("x" * 100)
    with pytest.raises(DataError, match="--seq-len"):
        make_streams(str(tmp_path / "short.txt"), 128, 0)
