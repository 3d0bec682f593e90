"""The data a run trains and evaluates on: the streams of --data and its tokenizer.

Text, token files and synthetic ids are windows of a corpus (`dpjax.data.make_streams`).
Chat data (--data chat:PATH) is conversations, one a row (`dpjax.data.sft.ExampleStream`):
rendered with the model's chat template and tokenized with its tokenizer.json (the
--init-from hf:DIR folder's, or --tokenizer's), the loss on the answers (`dpjax.data.chat`).
Its windows are what one step (--batch-size x --backward-passes conversations) or one
evaluation batch (--batch-size) reads, so that each is normalised by its own answer tokens.
"""

from __future__ import annotations

import dataclasses
import os

from dpjax.data import make_streams, text_chunks, chat as chat_data
from dpjax.data.sft import ExampleStream, PackedStream
from dpjax.data.tokenizer import Bytes, for_corpus, for_model, HF
from dpjax.plan import UsageError
from dpjax.train import rollout, preference


@dataclasses.dataclass
class Chat:
    """What a run's chat data is: its format (template, tokenizer), what reading it counted,
    and the held-out conversations (the eval loss, the end's sample)."""

    format: chat_data.ChatFormat
    counts: chat_data.Counts  # of --data
    train: list
    held_out: list
    eval_counts: chat_data.Counts | None = None  # of --eval-data, when given
    packing: dict | None = None  # --pack: `dpjax.data.sft.PackedStream.describe()`

    def record(self) -> dict:
        """The run record's "data": what was read, skipped, cut, and the answer tokens trained on."""
        c = self.counts
        out: dict[str, object] = {
            "rows": c.rows, "examples": len(self.train), "skipped_no_answer": c.no_answer, "truncated": c.truncated,
            "dropped_long": c.dropped_long, "answer_tokens": _answers(self.train), "held_out": len(self.held_out),
            "held_out_answer_tokens": _answers(self.held_out)}
        if self.eval_counts is not None:
            e = self.eval_counts
            out["eval"] = {"rows": e.rows, "skipped_no_answer": e.no_answer, "truncated": e.truncated,
                           "dropped_long": e.dropped_long}
        if self.packing is not None:
            out["packing"] = self.packing
        return {"chat": out}

    def line(self) -> str:
        r = self.record()["chat"]
        return (f"chat data: {r['examples']:,} conversations to train on ({r['answer_tokens']:,} answer tokens), "
                f"{r['held_out']:,} held out; of {r['rows']:,} rows {r['skipped_no_answer']:,} skipped without an "
                f"answer, {r['truncated']:,} truncated, {r['dropped_long']:,} dropped as too long" + _packing_line(r))


def epochs_clause(examples: int, per_step: int, steps: int) -> str:
    """How much of the set --steps reads, in epochs (TRL's and HuggingFace's count; dpjax counts steps)."""
    return f"; {steps:,} steps of {per_step:,} read {steps * per_step:,}: {steps * per_step / examples:.2f} epochs"


def _packing_line(r) -> str:
    p = r.get("packing")
    if p is None:
        return ""
    dealt = f" (the conversations of {p['window_steps']:,} steps dealt to even their tokens)" if (
        p["window_steps"] > 1) else ""
    return (f"; packed {p['method']}{dealt}: {p['conversations_per_batch']:,} conversations in "
            f"{p['rows_per_batch']:,} rows a micro-batch, their tokens {p['rows_of_tokens']:,} rows on average: "
            f"{p['efficiency']:.1%} of the slots real tokens (one a row: {p['unpacked_efficiency']:.1%})")


def _answers(examples) -> int:
    return sum(int(ex.loss_mask[1:].sum()) for ex in examples)


@dataclasses.dataclass
class Data:
    train: object
    val: object
    tokenizer: object  # what decodes the ids (None: shown as ids)
    chat: Chat | None = None  # or a preference run's pairs (dpjax.train.preference.Pref)
    rows: int | None = None  # the rows a batch of --batch-size examples fills (--pack's); None: one a row


def streams(cfg, model, rows_multiple: int = 1) -> Data:
    """The training and validation streams of --data, and what the ids are: the
    --tokenizer given (bpe:N is trained on the corpus here), bytes of text, or for a
    token file perhaps an --init-from folder's tokenizer. rows_multiple: what a packed
    batch's rows are rounded up to (the data axes' devices, which split them)."""
    if cfg.data.startswith("chat:"):
        return _chat_streams(cfg, model, rows_multiple)
    if cfg.task == "grpo":  # prompts to sample completions of (dpjax.train.rollout)
        folder = tokenizer_folder(cfg)
        return Data(*rollout.streams(cfg, chat_format(cfg, model, folder), folder))
    if cfg.data.startswith("pref:"):  # preference pairs, --task dpo (dpjax.train.preference)
        folder = tokenizer_folder(cfg)
        return Data(*preference.streams(cfg, chat_format(cfg, model, folder), folder))
    if cfg.task != "lm":
        raise UsageError(f"--task {cfg.task} trains on conversations' answers: give --data chat:FILE.jsonl "
                         f"(--data {cfg.data} is text)")
    given, vocab = None, model.config.vocab_size
    if cfg.tokenizer:
        given = for_corpus(cfg.tokenizer, text_chunks(cfg.data))
        if given.vocab_size > vocab:
            raise UsageError(f"--tokenizer {cfg.tokenizer} has {given.vocab_size} ids, the model {vocab}")
    train, val = make_streams(cfg.data, cfg.seq_len, cfg.seed, vocab_size=vocab, token_dtype=cfg.token_dtype,
                              tokenizer=given)
    text = not cfg.data.endswith(".bin") and cfg.data != "synthetic"
    return Data(train, val, given or (Bytes() if text else for_model(cfg.init_from, None, vocab, text=False)))


def tokenizer_folder(cfg) -> str:
    """Where the chat data's tokenizer.json and template are: --tokenizer's folder (or the
    folder of the file it names), else the --init-from hf:DIR folder (dpjax.plan checked one is given)."""
    if cfg.tokenizer:
        return cfg.tokenizer if os.path.isdir(cfg.tokenizer) else os.path.dirname(os.path.abspath(cfg.tokenizer))
    return cfg.init_from[len("hf:"):]


def _pairs(examples) -> list:
    return [(ex.tokens, ex.loss_mask) for ex in examples]


def chat_format(cfg, model, folder: str):
    """The chat template (or --chat-template) and tokenizer of `folder`, which conversations and
    preference pairs are read with; a tokenizer with more ids than the model's vocabulary is refused."""
    fmt = chat_data.ChatFormat(folder, cfg.chat_template)
    ids, vocab = fmt.tok.get_vocab_size(with_added_tokens=True), model.config.vocab_size
    if ids > vocab:
        raise UsageError(f"the tokenizer in {folder} has {ids:,} ids, more than the model's vocabulary of {vocab:,}: "
                         "give the model's own tokenizer")
    return fmt


def _chat_streams(cfg, model, rows_multiple: int = 1) -> Data:
    folder = tokenizer_folder(cfg)
    fmt = chat_format(cfg, model, folder)

    def load(spec):
        return chat_data.load(spec[len("chat:"):], fmt, cfg.seq_len, cfg.loss_on, cfg.truncate, cfg.no_answer)

    examples, counts = load(cfg.data)
    eval_counts = None
    if cfg.eval_data:
        train, (held_out, eval_counts) = examples, load(cfg.eval_data)
    else:
        train, held_out = chat_data.split(examples, 0.05 if cfg.eval_fraction is None else cfg.eval_fraction,
                                          cfg.seed)
    chat = Chat(fmt, counts, train, held_out, eval_counts)
    # a step reads --batch-size x --backward-passes conversations from a cursor that moves by that much
    # (and resumes where it stopped): each step's window is normalised by its own answer tokens
    window = cfg.batch_size * cfg.backward_passes
    # --pack-window: the steps whose conversations are dealt among them (dpjax.data.balance); None: an epoch's
    deal = cfg.pack_window if cfg.pack_window is not None else (None if cfg.pack != "none" else 1)
    if cfg.pack == "none":
        train_stream, rows = ExampleStream(_pairs(train), cfg.seq_len, cfg.seed, window=window, deal_steps=deal), None
    else:  # the evaluation reads one conversation a row: its answer-token mean is the same either way
        shortest = min(len(ex.tokens) for ex in train)
        if 2 * shortest > cfg.seq_len + 1:
            raise UsageError(f"--pack {cfg.pack}: no two conversations fit in a row of --seq-len {cfg.seq_len} + 1 "
                             f"tokens (the shortest has {shortest}" + (", after --truncate" if counts.truncated else "")
                             + "): raise --seq-len or leave --pack out")
        train_stream = PackedStream(_pairs(train), cfg.seq_len, cfg.seed, window=window, deal_steps=deal,
                                    batch_size=cfg.batch_size, method=cfg.pack, steps=cfg.steps, multiple=rows_multiple)
        chat.packing, rows = train_stream.describe(), train_stream.rows
    val_stream = ExampleStream(_pairs(held_out), cfg.seq_len, cfg.seed, window=cfg.batch_size)
    return Data(train_stream, val_stream, HF(fmt.tok, os.path.join(folder, "tokenizer.json")), chat, rows)
