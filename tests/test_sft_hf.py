"""Answer-only fine-tuning against HuggingFace's own code: a tiny random Llama made by transformers, with a
ChatML tokenizer and template whose answers sit in `{% generation %}` blocks (tests/fixtures/sft_hf, made by
tests/fixtures/make_sft_hf_fixture.py). transformers gave, per conversation, the ids and the assistant mask
(`apply_chat_template(..., return_assistant_tokens_mask=True)`), and the masked cross-entropy of its
`LlamaForCausalLM` over the answer targets of the whole batch: dpjax's chat data must give the same ids and mask,
and dpjax's first step, importing that checkpoint, the same loss."""

import json
import os

import jax
import numpy as np
import pytest
from conftest import read_losses

from dpjax import hf
from dpjax.data import chat
from dpjax.data.sft import ExampleStream
from dpjax.sharding import make_layout
from dpjax.tasks import TASKS
from dpjax.train import main

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "sft_hf")
CHAT = os.path.join(FIXTURE, "chat.jsonl")
with open(os.path.join(FIXTURE, "expected.json")) as _f:
    EXPECTED = json.load(_f)


def test_ids_and_answer_masks_are_transformers():
    examples, counts = chat.load(CHAT, chat.ChatFormat(FIXTURE), 64)
    assert counts.examples == len(EXPECTED["rows"])
    for ex, ref in zip(examples, EXPECTED["rows"]):
        assert list(ex.tokens) == ref["ids"]
        np.testing.assert_array_equal(np.asarray(ex.loss_mask, int), ref["assistant_masks"])


def test_the_sft_loss_of_the_imported_model_is_transformers(mesh_of):
    """The task's loss on one device, the unsharded model with the Hub weights, on the stream's one batch of
    all 8 conversations (the weights N / n make the plain mean over slots the mean over answer targets)."""
    model, _ = hf.model_from_hf(FIXTURE, seq_len=64)
    params = hf.load_params(FIXTURE, model, make_layout(model, mesh_of("1x1", 1)))
    examples, _ = chat.load(CHAT, chat.ChatFormat(FIXTURE), 64)
    stream = ExampleStream([(ex.tokens, ex.loss_mask) for ex in examples], 64, window=len(examples))
    batch = stream.batch(0, len(examples))
    got = float(jax.jit(TASKS["sft"].loss(model))(params, batch))
    assert abs(got - EXPECTED["loss"]) <= 1e-5 * EXPECTED["loss"], (got, EXPECTED["loss"])


def first_loss(tmp_path, *mesh) -> float:
    """One step over all 8 conversations (one global batch: the loss is the mean over all their answer
    tokens, whatever the stream's order), from the imported checkpoint, the held-out split the same file."""
    metrics = tmp_path / "m.jsonl"
    assert main(["--init-from", f"hf:{FIXTURE}", "--data", f"chat:{CHAT}", "--eval-data", f"chat:{CHAT}",
                 "--batch-size", "8", "--seq-len", "64", "--steps", "1", "--eval-every", "0", "--eval-batches", "1",
                 "--sample-tokens", "0", "--metrics", str(metrics), *mesh]) == 0
    return read_losses(metrics)[0]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["2x4", "8x1", "fsdp"])
def test_first_loss_is_transformers_masked_cross_entropy(tmp_path, mesh):
    layout = ["--mesh", "4x2", "--fsdp"] if mesh == "fsdp" else ["--mesh", mesh]
    got = first_loss(tmp_path, *layout)
    assert abs(got - EXPECTED["loss"]) <= 1e-5 * EXPECTED["loss"], (got, EXPECTED["loss"])
