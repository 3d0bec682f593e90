"""A task refused on a model says so in the model's words: an `hf:DIR` of Mixtral brings its experts
without the user giving --experts, so the line names the model and its experts, and what does train it."""

from __future__ import annotations

import pathlib
from types import SimpleNamespace

import pytest

from dpjax.errors import UserError
from dpjax.hf.source import model_of
from dpjax.plan import check_task

MIXTRAL = pathlib.Path(__file__).parent / "fixtures" / "mixtral_tiny"


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_a_fine_tune_of_an_imported_mixture_of_experts_names_it(task):
    model, hub, _ = model_of(f"hf:{MIXTRAL}")
    experts = hub["num_local_experts"]
    with pytest.raises(UserError) as e:
        check_task(SimpleNamespace(task=task), model, SimpleNamespace(shape={"data": 1, "model": 1}))
    line = str(e.value)
    assert "\n" not in line and f"--task {task} on a mixture of experts (--model mixtral, {experts} experts)" in line
    assert "--task lm" in line


def test_a_fine_tune_at_the_from_scratch_rate_is_told_once():
    """--init-from with the default --lr (3e-3, a rate for training from scratch) adds one note that names
    TRL's defaults; a rate given, or a run from scratch, adds none."""
    from dpjax.plan.task import rate_notes
    from dpjax.settings import Settings

    default = Settings().lr
    (note,) = rate_notes(SimpleNamespace(init_from="hf:tuned", lr=default), default)
    assert "\n" not in note and note.startswith(f"--lr {default:g} is the default") and "2e-5 for SFT" in note
    assert rate_notes(SimpleNamespace(init_from="hf:tuned", lr=2e-5), default) == []
    assert rate_notes(SimpleNamespace(init_from=None, lr=default), default) == []
