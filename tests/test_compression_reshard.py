"""Compression state in a checkpoint resumed on another mesh (issue 20: "restored bit for
bit, resharded across meshes"): the error buffers of two sites, saved on 2x4x1, come
back on 2x2x2 (the model split over 2) equal to every bit; PowerSGD's Q, one per
tensor-parallel shard, cannot follow a change of the model split, and says so."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dpjax.train import main
from dpjax.train.cli import parse_args
from dpjax.train.trainer import Trainer

from conftest import tiny_gpt


def _args(corpus, ckpt, mesh, compression, *extra):
    return tiny_gpt(corpus, "--mesh", mesh, "--compress-axes", "node", "--compression", compression,
                    "--compress-whole", "--ckpt-dir", str(ckpt), *extra)


def _restored(argv):
    t = Trainer(parse_args(argv + ["--resume"]))
    return t, jax.tree.map(np.asarray, t.opt_state)


def test_error_buffers_move_to_another_model_split_bit_for_bit(corpus, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert main(_args(corpus, ckpt, "2x4x1", "int8", "--steps", "3", "--ckpt-every", "3")) == 0
    _, on_a = _restored(_args(corpus, ckpt, "2x4x1", "int8", "--steps", "4"))
    t, on_b = _restored(_args(corpus, ckpt, "2x2x2", "int8", "--steps", "4"))
    assert t.start == 3 and dict(t.mesh.shape) == {"node": 2, "data": 2, "model": 2}
    flat_a, flat_b = jax.tree.leaves(on_a), jax.tree.leaves(on_b)
    assert len(flat_a) == len(flat_b) and sum(np.abs(x).sum() > 0 for x in flat_a) > 1  # the buffers are not zero
    for a, b in zip(flat_a, flat_b):
        np.testing.assert_array_equal(a, b)
    split = [x.sharding.spec for x in jax.tree.leaves(t.opt_state) if "model" in str(x.sharding.spec)]
    assert split, "on 2x2x2 some of the state is split over model"


@pytest.mark.slow  # each trains on two meshes (about 25 s); the restore itself is tested fast above
def test_powersgd_across_a_change_of_the_model_split_is_one_line(corpus, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert main(_args(corpus, ckpt, "2x4x1", "powersgd:2", "--steps", "2", "--ckpt-every", "2")) == 0
    capsys.readouterr()
    assert main(_args(corpus, ckpt, "2x2x2", "powersgd:2", "--steps", "3", "--resume")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "PowerSGD keeps one Q per tensor-parallel or pipeline shard" in err[0], err
    assert "corrupt" not in err[0]


@pytest.mark.slow  # each trains on two meshes (about 25 s); the restore itself is tested fast above
def test_the_per_shard_form_across_a_change_of_sites_size_is_one_line(corpus, tmp_path, capsys):
    """Per shard (the default with --compress-axes) each device keeps its own shard's
    buffer: 4 devices a site cannot become 2."""
    ckpt = tmp_path / "ckpt"
    a = [x for x in _args(corpus, ckpt, "2x4x1", "int8") if x != "--compress-whole"]
    assert main(a + ["--steps", "2", "--ckpt-every", "2"]) == 0
    capsys.readouterr()
    assert main([x if x != "2x4x1" else "2x2x2" for x in a] + ["--steps", "3", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "per shard, each device keeps its shard's" in err[0], err


@pytest.mark.slow  # each trains on two meshes (about 25 s); the restore itself is tested fast above
def test_fsdp_error_buffers_across_a_change_of_size_are_one_line(corpus, tmp_path, capsys):
    """Under FSDP each device keeps a full-size buffer: 8 data ranks cannot become 4."""
    ckpt = tmp_path / "ckpt"
    a = [x for x in _args(corpus, ckpt, "8x1", "randk:0.1", "--fsdp")
         if x not in ("--compress-axes", "node", "--compress-whole")]
    assert main(a + ["--steps", "2", "--ckpt-every", "2"]) == 0
    capsys.readouterr()
    b = [x if x != "8x1" else "4x2" for x in a]
    assert main(b + ["--steps", "3", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "under FSDP each device keeps a full-size error buffer" in err[0], err
    assert "corrupt" not in err[0]


if __name__ == "__main__":
    pytest.main([__file__])
