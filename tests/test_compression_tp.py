"""Compression beside tensor parallelism: a method that decides per fused bucket (top-k's
selection, int8's block scales) buckets a model rank's shards apart from the tensors
every model rank holds alike (`dpjax.fusion.leaf_classes`). Mixed, a replicated tensor
was compressed beside a different shard on each model rank and its copies drifted
apart: DPJAX_CHECK=1 (every step's replicated values compared across devices) failed
on the 2nd step, and a resumed run left the straight one."""

from __future__ import annotations

import pytest

from dpjax.train import main

from conftest import assert_resumes_bit_for_bit, tiny_gpt


def _tiny(corpus, *extra):
    return tiny_gpt(corpus, "--mesh", "2x2x2", "--compress-axes", "node", *extra)


@pytest.mark.parametrize("form", [(), ("--compress-whole",)], ids=["per-shard", "whole"])
def test_replicated_tensors_stay_alike_across_model_ranks(corpus, monkeypatch, form):
    monkeypatch.setenv("DPJAX_CHECK", "1")
    assert main(_tiny(corpus, "--compression", "topk:0.05", "--steps", "4", *form)) == 0


def test_a_resumed_run_with_top_k_beside_tensor_parallelism_is_the_straight_one(corpus, tmp_path):
    assert_resumes_bit_for_bit(_tiny(corpus, "--compression", "topk:0.05", "--compress-whole"), tmp_path)
