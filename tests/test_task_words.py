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
