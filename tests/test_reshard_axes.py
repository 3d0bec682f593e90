"""Checkpoints resharded across context and expert sizes (issue 40): a run checkpointed on
one split of the 8 devices and resumed on another takes the same next step as the run
that was never interrupted, through the CLI's --ckpt-dir/--resume.

Context: parameters are replicated over `context` and the loss is the mean over every
token, so any split of the devices (even plain 8x1) continues the run. Experts: their
leaves are sharded over `expert`, so the checkpoint's global array is cut anew; the batch's
rows are split over all 8 devices on both meshes, so the routing groups (and with them the
router losses) are the same rows and the losses agree to float32 round-off."""

import json
import shutil

import numpy as np
import pytest
from conftest import read_losses, tiny_gpt

from dpjax.train import main

FIRST, STEPS = 2, 3  # checkpoint after 2 steps; the third is the step that must agree


def _resumed_equal_uninterrupted(corpus, tmp_path, extra, first, seconds):
    """Runs `first` for FIRST steps with a checkpoint, resumes it on each of `seconds` to
    STEPS, and compares every resumed run's losses with STEPS uninterrupted steps on `first`."""
    ckpt = tmp_path / "ckpt"
    base = tiny_gpt(corpus, *extra)
    straight = tmp_path / "straight.jsonl"
    assert main(base + ["--mesh", first, "--steps", str(STEPS), "--metrics", str(straight)]) == 0
    reference = read_losses(straight)
    assert len(reference) == STEPS
    path = tmp_path / "m.jsonl"
    assert main(base + ["--mesh", first, "--steps", str(FIRST), "--ckpt-dir", str(ckpt), "--ckpt-every", "1000",
                        "--metrics", str(path)]) == 0
    for i, second in enumerate(seconds):
        here, metrics = tmp_path / f"ckpt{i}", tmp_path / f"m{i}.jsonl"
        shutil.copytree(ckpt, here)  # each resume starts from the same saved step
        shutil.copy(path, metrics)
        assert main(base + ["--mesh", second, "--steps", str(STEPS), "--ckpt-dir", str(here), "--ckpt-every", "1000",
                            "--metrics", str(metrics), "--resume"]) == 0
        resumed = read_losses(metrics)
        assert len(resumed) == STEPS
        assert resumed[:FIRST] == reference[:FIRST]  # the first run's rows, kept
        # float32 round-off: another split sums the gradient's partial sums in another order
        np.testing.assert_allclose(resumed[FIRST:], reference[FIRST:], rtol=2e-6, atol=0, err_msg=second)
    return straight


CONTEXT = ("--seq-len", "16", "--context-attention", "ring")


# Each test trains 3 times (an uninterrupted run, the first half, the resume): 30-80 s under load.
@pytest.mark.slow
@pytest.mark.parametrize("seconds", [["data=4,context=2"], ["8x1"]])
def test_a_context_checkpoint_resumes_on_another_context_size(corpus, tmp_path, seconds):
    _resumed_equal_uninterrupted(corpus, tmp_path, CONTEXT, "data=2,context=4", seconds)


# 8 experts of d_ff 32, top 2, capacity factor 4 = E/k: no token dropped on either mesh
EXPERTS = ("--experts", "8", "--top-k", "2", "--capacity-factor", "4")


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [(), ("--fsdp",)], ids=["replicated", "fsdp"])
def test_an_expert_checkpoint_resumes_on_another_expert_size(corpus, tmp_path, fsdp):
    straight = _resumed_equal_uninterrupted(corpus, tmp_path, EXPERTS + fsdp, "data=2,expert=4", ["data=4,expert=2"])
    rows = [r for r in map(json.loads, open(straight)) if "loss" in r]
    # each step's row carries its own forward's router figures (dpjax.step's loss_and_stats): no drops here
    assert [r["dropped"] for r in rows] == [0.0] * STEPS and all(r["router_balance"] > 0 for r in rows)
