"""Which layouts and models a task (`dpjax.tasks`) runs on: the pairs not built yet are
refused in one line before anything compiles; and what chat data (--data chat:PATH, which
trains --task sft) needs of the settings, checked before JAX starts.

--pack places conversations several to a row: chat data only (a text's windows are full
rows already); with --attention cudnn it is refused by the compute policy
(`dpjax.compute.policy.cudnn_refusal`: cuDNN gets the document mask only as a dense bias
through JAX's public API, and dpjax has not run it on a GPU); a set in which no two
conversations fit in one row is refused when it is read (`dpjax.train.streams`)."""

from __future__ import annotations

import os

from dpjax.errors import UserError
from dpjax.mesh import STAGE
from dpjax.models import MODELS
from dpjax.models.base import Decoder

CHAT = "chat:"  # --data chat:PATH: conversations (dpjax.data.chat)


def check_task(s, model, mesh) -> None:
    if s.task == "lm":
        return
    if not isinstance(model, Decoder):
        decoders = ", ".join(n for n, e in MODELS.items() if issubclass(e.build, Decoder))
        raise UserError(f"--task {s.task} needs a decoder (--model {decoders}); --model {model.name} is not one")
    if mesh.shape.get(STAGE, 1) > 1:
        raise UserError(f"--task {s.task} on a stage axis is not built yet (the pipeline's micro-batches carry "
                        "tokens only); use the data, model, context or FSDP axes")
    if model.experts:
        raise UserError(f"--task {s.task} with --experts is not built yet (the router's losses are not weighted "
                        "per answer token)")


def check_chat(s) -> None:
    """Chat data (--data chat:PATH) trains --task sft, with a tokenizer that has character
    offsets and a template; the chat flags that name files apply to it only."""
    chat = s.data.startswith(CHAT)
    if not chat:
        given = [f"--{k.replace('_', '-')}" for k in ("chat_template", "eval_data", "eval_fraction")
                 if getattr(s, k) is not None] + ([f"--pack {s.pack}"] if s.pack != "none" else [])
        if given:
            raise UserError(f"{', '.join(given)} applies to chat data (--data chat:FILE.jsonl), not --data {s.data}")
        return
    if not s.data[len(CHAT):]:
        raise UserError("--data chat:PATH names a FILE.jsonl of conversations or a folder of them")
    if s.task != "sft":
        raise UserError(f"--task {s.task} trains on every token of a text; --data {s.data} is conversations, "
                         "trained on their answers: leave --task out (chat data is --task sft)")
    if s.eval_data is not None and s.eval_fraction is not None:
        raise UserError("--eval-data and --eval-fraction both say what is held out for evaluation: give one")
    if s.eval_data is not None and not s.eval_data.startswith(CHAT):
        raise UserError(f"--eval-data {s.eval_data}: held-out conversations are chat:PATH, like --data")
    if s.eval_fraction is not None and not 0 < s.eval_fraction < 1:
        raise UserError(f"--eval-fraction is between 0 and 1, got {s.eval_fraction}")
    if s.tokenizer is None and not (s.init_from or "").startswith("hf:"):
        raise UserError(f"--data {s.data} is rendered and tokenized as the model's: give --init-from hf:DIR (its "
                         "folder's tokenizer.json and chat template) or --tokenizer DIR")
    if s.tokenizer is not None and s.tokenizer.startswith("bpe:"):
        raise UserError(f"--tokenizer {s.tokenizer} is trained on text; chat data needs the model's own "
                         "tokenizer.json (its folder, with the chat template)")
    if s.chat_template is not None and not os.path.isfile(s.chat_template):
        raise UserError(f"--chat-template {s.chat_template}: no such file")
