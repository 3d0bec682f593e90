"""`python -m dpjax.train --data chat:FILE.jsonl`: fine-tuning on conversations with the
loss on the answers only, as a user runs it. The first step's loss is checked against
numpy's masked cross-entropy of the unsharded model on the tokens and masks that
`dpjax.data.chat.load` gives (in the stream's seeded order, recomputed here); two meshes
agree; bad input is one line with nothing written."""

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import assert_resumes_bit_for_bit, read_losses

from dpjax.data import chat
from dpjax.train import main, parse_args

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
CHATML = os.path.join(FIXTURES, "chat_tiny", "chatml")  # a tiny BPE (360 ids) with a ChatML-like template
SEQ, B = 48, 8
CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"), ("Peru", "Lima"),
            ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Chile", "Santiago")]


def conversations(n=200, seed=0):
    """A templated set whose answers follow a rule: 'The capital of X is Y.'"""
    rng = np.random.default_rng(seed)
    out = []
    for i in rng.integers(0, len(CAPITALS), n):
        country, city = CAPITALS[i]
        out.append({"messages": [{"role": "user", "content": f"What is the capital of {country}?"},
                                 {"role": "assistant", "content": f"The capital of {country} is {city}."}]})
    return out


def write_rows(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    return write_rows(tmp_path_factory.mktemp("chat") / "chat.jsonl", conversations())


def tiny(data, *extra):
    return ["--model", "llama", "--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--n-kv-heads", "2",
            "--d-ff", "64", "--tokenizer", CHATML, "--data", f"chat:{data}", "--seq-len", str(SEQ),
            "--batch-size", str(B), "--optimizer", "sgd", "--lr", "0.5", "--clip-norm", "0", "--eval-every", "0",
            "--eval-batches", "1", "--sample-tokens", "0", *extra]


def reference_first_loss(data, args) -> float:
    """numpy: -log p(answer targets) summed over the first step's conversations, over their
    number: the examples as chat.load reads them, the held-out split and the stream's
    seeded order redone here, the logits of the unsharded model at its initial parameters."""
    from dpjax import step as S
    from dpjax.plan import resolve

    examples, _ = chat.load(data, chat.ChatFormat(CHATML), SEQ)
    train, _ = chat.split(examples, 0.05, seed=0)
    first = [train[i] for i in np.random.default_rng((0, 0)).permutation(len(train))[:B]]  # epoch 0's order
    tokens = np.zeros((B, SEQ + 1), np.int32)
    counts = np.zeros((B, SEQ + 1), bool)
    for r, ex in enumerate(first):
        tokens[r, :len(ex.tokens)], counts[r, :len(ex.tokens)] = ex.tokens, ex.loss_mask
    # the run's own init program on its mesh (the values do not depend on the mesh): the process
    # that follows finds it in the session's compile cache
    plan = resolve(parse_args([*args, "--mesh", "8x1"]), jax.devices()[:8])
    params = plan.layout.unstore(jax.device_get(S.init_params(plan.model, plan.layout, jax.random.key(0),
                                                              plan.policy)))
    logits = np.asarray(jax.jit(plan.model.apply)(params, tokens[:, :-1]), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return float(nll[counts[:, 1:]].sum() / counts[:, 1:].sum())


@pytest.fixture(scope="module")
def process_run(chat_file, tmp_path_factory):
    """2 steps on 8x1 as a user runs them, a process; and numpy's first loss."""
    reference = reference_first_loss(chat_file, tiny(chat_file))
    metrics = tmp_path_factory.mktemp("run") / "m.jsonl"
    proc = subprocess.run([sys.executable, "-m", "dpjax.train", *tiny(chat_file, "--mesh", "8x1", "--steps", "2",
                                                                      "--metrics", str(metrics))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc, metrics, reference


def test_first_loss_is_the_answer_mean(chat_file, process_run):
    _, metrics, reference = process_run
    got = read_losses(metrics)
    assert abs(got[0] - reference) <= 1e-5 * reference, (got[0], reference)


@pytest.mark.slow
def test_meshes_agree(chat_file, process_run, tmp_path):
    """2x4 (the model split over 4 devices, the rows over 2) gives 8x1's steps."""
    assert main([*tiny(chat_file, "--mesh", "2x4", "--steps", "2", "--metrics", str(tmp_path / "m.jsonl"))]) == 0
    np.testing.assert_allclose(read_losses(tmp_path / "m.jsonl"), read_losses(process_run[1]), rtol=1e-5)


def test_the_start_line_and_the_record_give_the_counts(process_run):
    proc, metrics, _ = process_run
    with open(metrics) as f:
        record = json.loads(f.readline())["record"]
    assert record["settings"]["task"] == "sft"  # implied by chat data
    data = record["data"]["chat"]
    assert (data["rows"], data["examples"], data["held_out"], data["truncated"]) == (200, 190, 10, 0)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("chat data: "))
    assert f"({data['answer_tokens']:,} answer tokens)" in line and "190 conversations" in line
    s = record["settings"]  # the epochs the steps read, as a TRL user counts them
    read = s["steps"] * s["batch_size"] * s["backward_passes"]
    assert line.endswith(f"; {s['steps']} steps of {s['batch_size'] * s['backward_passes']} read {read}: "
                         f"{read / 190:.2f} epochs")


def test_truncation_and_skips_are_counted(tmp_path):
    rows = conversations(12) + [{"messages": [{"role": "user", "content": "no answer here"}]}]
    rows.append({"messages": [{"role": "user", "content": "long " * 80}, {"role": "assistant", "content": "ok"}]})
    path = write_rows(tmp_path / "c.jsonl", rows)
    from dpjax.train.streams import streams

    cfg = parse_args(tiny(path, "--truncate", "left", "--eval-fraction", "0.25"))
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=360))  # streams reads only the vocabulary
    data = streams(cfg, model).chat.record()["chat"]
    assert (data["rows"], data["skipped_no_answer"], data["truncated"]) == (14, 1, 1)
    assert data["examples"] + data["held_out"] == 13 and data["held_out"] == 3
    with pytest.raises(chat.DataError, match="cut the answer of 12 rows away"):  # the answers are at the end
        chat.load(write_rows(tmp_path / "d.jsonl", conversations(12)), chat.ChatFormat(CHATML), 8, truncate="right")


def run_error(args, capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


def test_bad_chat_input_is_one_line_and_writes_nothing(chat_file, tmp_path, capsys):
    out = tmp_path / "out"
    writes = ["--metrics", str(out / "m.jsonl"), "--ckpt-dir", str(out / "ckpt")]
    out.mkdir()
    no_answer = write_rows(tmp_path / "n.jsonl", conversations(3) + [{"messages": [{"role": "user", "content": "hi"}]}])
    assert "n.jsonl:4: no assistant answer" in run_error([*tiny(no_answer, "--no-answer", "refuse"), *writes], capsys)
    bare = tmp_path / "bare"  # a tokenizer without a chat template
    bare.mkdir()
    shutil.copy(os.path.join(CHATML, "tokenizer.json"), bare)
    args = tiny(chat_file, *writes)
    args[args.index(CHATML)] = str(bare)
    assert "chat template" in run_error(args, capsys)
    assert "--task lm" in run_error([*tiny(chat_file, "--task", "lm"), *writes], capsys)
    tool = {"messages": [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]}
    raises = write_rows(tmp_path / "t.jsonl", conversations(1) + [tool])
    template = os.path.join(FIXTURES, "chat_tiny", "plain", "chat_template.jinja")  # raise_exception on a tool turn
    err = run_error([*tiny(raises, "--chat-template", template), *writes], capsys)
    assert "t.jsonl:2" in err and "Unknown role: tool" in err, err
    assert "give --data chat:" in run_error(["--model", "llama", "--vocab-size", "64", "--data", "synthetic",
                                              "--task", "sft", "--seq-len", "16", *writes], capsys)
    model = tmp_path / "model"  # llama_tiny's weights (320 ids) with the chat tokenizer (360)
    shutil.copytree(os.path.join(FIXTURES, "llama_tiny"), model)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(CHATML, name), model)
    assert "more than the model's vocabulary of 320" in run_error(
        ["--init-from", f"hf:{model}", "--data", f"chat:{chat_file}", "--seq-len", "32", *writes], capsys)
    assert os.listdir(out) == []


@pytest.mark.slow
def test_resume_of_a_chat_run_is_bit_for_bit(chat_file, tmp_path):
    # 2 micro-batches: a step's window is 2 x --batch-size conversations, and the cursor resumes on its start
    assert_resumes_bit_for_bit(tiny(chat_file, "--mesh", "4x2", "--backward-passes", "2"), tmp_path)


@pytest.mark.slow
def test_fine_tuning_lowers_the_eval_loss_on_answers(chat_file, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    args = tiny(chat_file, "--steps", "60", "--eval-every", "20", "--eval-batches", "2", "--optimizer", "adamw",
                "--lr", "1e-2", "--sample-tokens", "16", "--metrics", str(metrics), "--progress", "log")
    assert main(args) == 0
    with open(metrics) as f:
        evals = [row["eval_loss"] for row in map(json.loads, f) if "eval_loss" in row]
    assert len(evals) == 3 and evals[0] > evals[1] > evals[2], evals
    assert evals[-1] < 0.5 * np.log(360), evals  # well under a uniform guess over the vocabulary
    sample = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("sample: "))
    # a held-out question rendered for generation, answered in the template's form, the turn ended
    assert "<|im_start|>assistant\\n|The capital of " in sample and sample.endswith("<|im_end|>"), sample
