"""Conversation data for supervised fine-tuning: rows -> rendered text -> token ids and an answer mask.

Rows, one JSON object a line, in FILE.jsonl or a folder of them (the formats TRL and the Hub use):

    {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}
    {"prompt": [messages], "completion": [messages]}     rendered together; the prompt alone is rendered as
                                                         for generation (add_generation_prompt) to find where
                                                         the completion starts, as TRL does
    {"prompt": "text", "completion": "text"}             TRL's standard form: no template, the text as it is
                                                         and the eos token after the completion

Messages are rendered with the model's chat template (`dpjax.data.chat_template`) and tokenized with its
tokenizer.json; the tokenizer's character offsets carry the answer's characters to tokens: a token counts
when it overlaps an answer's characters (transformers' rule for `return_assistant_tokens_mask`).

Which characters are the answer (`loss_on`):
    assistant   (default) with `{% generation %}` blocks in the template: what they write. Without: each
                assistant turn's content where it lands in the rendered text, plus the end-of-turn token
                written right after it (the tokenizer's eos_token or generation_config.json's eos ids), so
                that the model learns to stop. Where it lands: the text is rendered once more with that
                turn's content replaced, and the first character where the two renderings differ is where
                the content starts: a template's own text ("assistant") is never taken for an answer.
    completion  prompt/completion rows: everything after the prompt's rendering
    all         every token

An example's `loss_mask` is aligned with its `tokens` (as transformers' assistant_masks with input_ids): token
i counts as a target, predicted from the tokens before it. An example holds at most `seq_len + 1` tokens (a
row of the training batch); longer ones are cut (`truncate="right"` keeps the start, `"left"` the end) or
dropped (`"drop"`), and counted. A row without an answer is skipped and counted, or refused
(`no_answer="refuse"`), and so is an example whose answer truncation cut away.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from dpjax.data import DataError
from dpjax.data import tokenizer as tokenizers_
from dpjax.data.chat_template import ChatTemplate, find, read_config, special_tokens
from dpjax.data.packing import METHODS, pack
from dpjax.errors import UserError

LOSS_ON = ("assistant", "completion", "all")
TRUNCATE = ("right", "left", "drop")
NO_ANSWER = ("skip", "refuse")
_PLACEHOLDER = "\ue002"  # private use: differs from the first character of any content


@dataclass(frozen=True)
class Example:
    """One conversation: int32 token ids and, aligned with them, which count as targets."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    where: str = ""


@dataclass
class Counts:
    """What reading a chat set did, for the run record."""

    rows: int = 0
    examples: int = 0
    truncated: int = 0
    dropped_long: int = 0
    no_answer: int = 0  # skipped: no assistant turn (or its answer cut away by truncation)
    tokens: int = 0
    answer_tokens: int = 0
    files: list[str] = field(default_factory=list)


def rows(path: str):
    """(where, row) for every non-blank line of FILE.jsonl or of each *.jsonl under a folder, in sorted order."""
    if os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".jsonl"))
        if not files:
            raise DataError(f"chat data folder {path!r} holds no .jsonl files")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise DataError(f"chat data {path!r} does not exist; give a FILE.jsonl or a folder of them")
    for name in files:
        with open(name, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{name}:{i}"
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{where}: not a JSON object ({e})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{where}: a row is a JSON object, got {type(row).__name__}")
                yield where, row


def row_at(where: str) -> dict:
    """The row an Example's `where` ("FILE:LINE") names, read again."""
    name, line = where.rsplit(":", 1)
    with open(name, encoding="utf-8") as f:
        for i, text in enumerate(f, 1):
            if i == int(line):
                return json.loads(text)
    raise DataError(f"{where}: no such line (the file changed while training?)")


def _messages(value, where: str, key: str) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        raise DataError(f"{where}: {key!r} is a list of {{\"role\": ..., \"content\": ...}} messages")
    return value


def _overlap(offsets: np.ndarray, spans) -> np.ndarray:
    """Tokens whose [start, end) characters overlap any span (transformers' assistant-mask rule)."""
    mask = np.zeros(len(offsets), bool)
    for s, e in spans:
        mask |= (offsets[:, 0] < e) & (offsets[:, 1] > s)
    return mask


class ChatFormat:
    """A model's chat template, special tokens and tokenizer.json: rows -> (ids, mask).

    folder: the model's (or its tokenizer's) folder: tokenizer.json, tokenizer_config.json,
    chat_template.jinja, generation_config.json. template_file: a template to use instead of its own."""

    def __init__(self, folder: str, template_file: str | None = None):
        self.folder, self.template_file = folder, template_file
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise DataError(f"chat data needs the model's tokenizer.json (its character offsets): none in {folder!r}")
        self.tok = tokenizers_.load(path).tok
        self.special = special_tokens(read_config(folder))
        self.stops = self._stops()
        self._template = None

    def _stops(self) -> list[str]:
        """The end-of-turn tokens an answer ends with: eos_token and generation_config.json's eos ids."""
        stops = [self.special["eos_token"]] if "eos_token" in self.special else []
        path = os.path.join(self.folder, "generation_config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                ids = json.load(f).get("eos_token_id")
            for i in ids if isinstance(ids, list) else [ids] if isinstance(ids, int) else []:
                token = self.tok.id_to_token(i)
                if token is not None and token not in stops:
                    stops.append(token)
        return sorted(stops, key=len, reverse=True)  # a longer token before one it contains

    @property
    def template(self) -> ChatTemplate:
        """Found and compiled when a row first needs it (string prompt/completion rows need none)."""
        if self._template is None:
            source, name = find(self.folder, self.template_file)
            self._template = ChatTemplate(source, self.special, name)
        return self._template

    def encode_text(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(int32 ids, [n, 2] character offsets) of `text`, no special tokens added (the template writes them)."""
        enc = self.tok.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, np.int32), np.asarray(enc.offsets, np.int64).reshape(-1, 2)

    def render(self, row: dict, where: str = "a row", loss_on: str = "assistant") -> tuple[str, list]:
        """(the row's text, the character spans of its answer: [] when it has none)."""
        if loss_on not in LOSS_ON:
            raise DataError(f"loss on {loss_on!r}: one of {', '.join(LOSS_ON)}")
        if "messages" in row:
            if loss_on == "completion":
                raise DataError(f"{where}: loss on completion needs prompt/completion rows; this one has messages "
                                "(use assistant or all)")
            messages = _messages(row["messages"], where, "messages")
            text, spans = self.template.render(messages, where=where)
            return text, ([(0, len(text))] if loss_on == "all" else self._answers(messages, text, spans, where))
        if "prompt" not in row or "completion" not in row:
            raise DataError(f"{where}: a row has \"messages\", or \"prompt\" and \"completion\"; got {sorted(row)}")
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            eos = self.special.get("eos_token", "")
            text = prompt + completion + ("" if completion.endswith(eos) else eos)
            return text, [(0 if loss_on == "all" else len(prompt), len(text))]
        messages = _messages(prompt, where, "prompt") + _messages(completion, where, "completion")
        text, spans = self.template.render(messages, where=where)
        if loss_on == "all":
            return text, [(0, len(text))]
        if loss_on == "assistant":
            return text, self._answers(messages, text, spans, where)
        head, _ = self.template.render(prompt, add_generation_prompt=True, where=where)
        if not text.startswith(head):
            raise DataError(f"{where}: {self.template.name} does not render the prompt as the start of the whole "
                            "row, so where the completion starts is unknown; use loss on assistant")
        return text, [(len(head), len(text))]

    def _answers(self, messages, text, spans, where):
        if self.template.has_generation:
            return spans
        out = []
        for k, m in enumerate(messages):
            content = m.get("content")
            if m["role"] != "assistant" or not content or (isinstance(content, str) and not content.strip()):
                continue  # no answer text in this turn (a tool call alone, say)
            if not isinstance(content, str):
                raise DataError(f"{where}: assistant turn {k}'s content is not a string, and {self.template.name} "
                                "has no {% generation %} blocks to say where its answer is")
            other, _ = self.template.render(messages[:k] + [{**m, "content": _PLACEHOLDER}] + messages[k + 1:],
                                            where=where)
            start = _common_prefix(text, other)
            written = next((c for c in (content, content.strip(), content.lstrip(), content.rstrip())
                            if c and text.startswith(c, start)), None)
            if written is None:
                raise DataError(f"{where}: {self.template.name} does not write assistant turn {k}'s text as it is, "
                                "so where its answer lands is unknown; give a template with {% generation %} blocks "
                                "(--chat-template) or use loss on all")
            end = start + len(written)
            end += next((len(s) for s in self.stops if text.startswith(s, end)), 0)
            out.append((start, end))
        return out

    def prompt(self, row: dict, where: str = "a row") -> str:
        """What the model is asked before the row's first answer: its messages up to the first assistant turn
        rendered for generation (add_generation_prompt), or a string prompt as it is."""
        if "messages" not in row and isinstance(row.get("prompt"), str):
            return row["prompt"]
        messages = _messages(row["messages"], where, "messages") if "messages" in row else _messages(
            row.get("prompt"), where, "prompt")
        first = next((k for k, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        return self.template.render(messages[:first], add_generation_prompt=True, where=where)[0]

    def encode(self, row: dict, where: str = "a row", loss_on: str = "assistant") -> Example:
        """The row as int32 ids and their answer mask (all False when it has no answer)."""
        text, spans = self.render(row, where, loss_on)
        ids, offsets = self.encode_text(text)
        return Example(ids, _overlap(offsets, spans), where)


def _common_prefix(a: str, b: str) -> int:
    """The length of a's and b's common start (a binary search of slices compared in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid - 1)
    return lo


def fit(ex: Example, seq_len: int, truncate: str) -> Example | None:
    """`ex` cut to at most seq_len + 1 tokens (None: dropped), as `truncate` says."""
    limit = seq_len + 1
    if len(ex.tokens) <= limit:
        return ex
    if truncate == "drop":
        return None
    keep = slice(-limit, None) if truncate == "left" else slice(0, limit)
    return Example(ex.tokens[keep], ex.loss_mask[keep], ex.where)


def load(path: str, fmt: ChatFormat, seq_len: int, loss_on: str = "assistant", truncate: str = "right",
         no_answer: str = "skip") -> tuple[list[Example], Counts]:
    """Every row of `path` as an Example of at most seq_len + 1 tokens, and the counts of what was cut or skipped."""
    if truncate not in TRUNCATE:
        raise DataError(f"truncate {truncate!r}: one of {', '.join(TRUNCATE)}")
    if no_answer not in NO_ANSWER:
        raise DataError(f"rows without an answer: {no_answer!r} is not one of {', '.join(NO_ANSWER)}")
    if seq_len < 1:
        raise DataError(f"sequence length must be positive, got {seq_len}")
    out, counts, longest, cut_away = [], Counts(files=[path]), 0, 0
    for where, row in rows(path):
        counts.rows += 1
        ex = fmt.encode(row, where, loss_on)
        if not ex.loss_mask[1:].any():  # the first token is no one's target
            if no_answer == "refuse":
                raise DataError(f"{where}: no assistant answer to train on (loss on {loss_on}); fix the row or skip "
                                "such rows")
            counts.no_answer += 1
            continue
        cut = fit(ex, seq_len, truncate)
        longest = max(longest, len(ex.tokens))
        if cut is None:
            counts.dropped_long += 1
            continue
        if len(cut.tokens) < len(ex.tokens):
            counts.truncated += 1
            if not cut.loss_mask[1:].any():
                counts.no_answer += 1
                cut_away += 1
                continue
        out.append(cut)
        counts.tokens += len(cut.tokens)
        counts.answer_tokens += int(cut.loss_mask[1:].sum())
    counts.examples = len(out)
    if not out:
        why = "no row has an answer to train on"
        if cut_away:
            why = (f"truncating at --seq-len {seq_len} + 1 tokens ({truncate}) cut the answer of {cut_away} rows "
                   f"away (the longest: {longest} tokens); raise --seq-len or truncate on the other side")
        elif counts.dropped_long:
            why = (f"every example is longer than --seq-len {seq_len} + 1 tokens (the longest: {longest}); raise "
                   "--seq-len or truncate instead of dropping")
        raise DataError(f"chat data {path!r}: {why} ({counts.rows} rows)")
    return out, counts


def split(examples: list, fraction: float, seed: int = 0) -> tuple[list, list]:
    """(train, held-out): `fraction` of the examples (at least one), drawn by a permutation of `seed`, held out
    for the eval loss on answers; each part keeps the file's order."""
    if not 0 < fraction < 1:
        raise DataError(f"the held-out fraction is between 0 and 1, got {fraction}")
    n_eval = max(1, round(len(examples) * fraction))
    if n_eval >= len(examples):
        raise DataError(f"holding out {fraction} of {len(examples)} examples leaves none to train on; hold out less "
                        "or give the held-out set as its own file")
    held = set(np.random.default_rng(seed).permutation(len(examples))[:n_eval].tolist())
    return ([ex for i, ex in enumerate(examples) if i not in held], [ex for i, ex in enumerate(examples) if i in held])


def main(argv=None) -> int:
    """Read a chat set as training would and say what it holds: counts, answer tokens, packing efficiency."""
    p = argparse.ArgumentParser(prog="python -m dpjax.data.chat", description=main.__doc__)
    p.add_argument("data", help="FILE.jsonl or a folder of them")
    p.add_argument("--model", required=True, help="the folder of the model's tokenizer.json and chat template")
    p.add_argument("--chat-template", default=None, help="a jinja template file to use instead of the model's")
    p.add_argument("--seq-len", type=int, required=True, help="as training's --seq-len: an example holds at most "
                                                              "seq_len + 1 tokens")
    p.add_argument("--loss-on", choices=LOSS_ON, default="assistant", help="which tokens the loss counts, as "
                                                                           "training's --loss-on (default assistant)")
    p.add_argument("--truncate", choices=TRUNCATE, default="right", help="a longer example: keep its start (right), "
                                                                         "its end (left), or drop it")
    p.add_argument("--no-answer", choices=NO_ANSWER, default="skip", help="rows without an answer: skip or refuse")
    p.add_argument("--pack", choices=tuple(METHODS), default="first_fit",
                   help="the packer whose efficiency is reported (default first_fit)")
    args = p.parse_args(argv)
    try:
        fmt = ChatFormat(args.model, args.chat_template)
        examples, counts = load(args.data, fmt, args.seq_len, args.loss_on, args.truncate, args.no_answer)
        packed = pack(examples, args.seq_len, args.pack)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in vars(counts).items() if k != "files"}
    summary.update(rows_packed=len(packed.rows), packing=args.pack, efficiency=round(packed.efficiency, 4))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
