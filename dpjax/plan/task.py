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
from dpjax.mesh import CONTEXT, STAGE
from dpjax.models import MODELS
from dpjax.models.base import Decoder
from dpjax.tasks.dpo import VARIANTS

CHAT = "chat:"  # --data chat:PATH: conversations (dpjax.data.chat)
PREF = "pref:"  # --data pref:PATH: preference pairs (dpjax.data.pref, --task dpo)


def rate_notes(s, default_lr: float) -> list[str]:
    """A fine-tune (--init-from) at the from-scratch default rate, said once at the start: TRL's
    trainers default to far lower rates, and a pretrained model at 3e-3 forgets what it knew."""
    if s.init_from is None or s.lr != default_lr:
        return []
    return [f"--lr {s.lr:g} is the default, a rate for training from scratch; a fine-tune of {s.init_from} "
            "usually takes far less (TRL's defaults: 2e-5 for SFT, 1e-6 for DPO and GRPO; LoRA often 1e-4 "
            "to 2e-4): give --lr"]


def check_task(s, model, mesh) -> None:
    if s.task == "lm":
        return
    if not isinstance(model, Decoder):
        decoders = ", ".join(n for n, e in MODELS.items() if issubclass(e.build, Decoder))
        raise UserError(f"--task {s.task} needs a decoder (--model {decoders}); --model {model.name} is not one")
    if mesh.shape.get(STAGE, 1) > 1:
        raise UserError(f"--task {s.task} on a stage axis is not built yet (the pipeline's micro-batches carry "
                        "tokens only); use the data, model, context or FSDP axes")
    if s.task == "grpo" and mesh.shape.get(CONTEXT, 1) > 1:
        raise UserError("--task grpo on a context axis is not built yet (the old and reference log-probs are "
                        "computed whole per sequence); use the data, model or FSDP axes")
    if model.experts:
        # said in the model's words: an hf:DIR of Mixtral or Qwen3-MoE brings its experts without --experts
        raise UserError(f"--task {s.task} on a mixture of experts (--model {model.name}, {model.experts} experts) is "
                        "not built yet (the router's losses are not weighted per answer token); --task lm trains "
                        "it on text or token files")


def check_chat(s) -> None:
    """Chat data (--data chat:PATH) trains --task sft, with a tokenizer that has character
    offsets and a template; the chat flags that name files apply to it only."""
    if s.data.startswith(PREF) or s.task == "dpo":
        return check_pref(s)
    if s.task == "grpo" or s.prompts is not None:
        return check_grpo(s)
    given = [f"--{k.replace('_', '-')}" for k in ("ref_from", "reward") if getattr(s, k) is not None]
    if given:
        raise UserError(f"{', '.join(given)} applies to preference pairs (--data pref:FILE.jsonl), not --data {s.data}")
    chat = s.data.startswith(CHAT)
    if not chat:
        given = [f"--{k.replace('_', '-')}" for k in ("chat_template", "eval_data", "eval_fraction", "pack_window")
                 if getattr(s, k) is not None] + ([f"--pack {s.pack}"] if s.pack != "none" else [])
        if given:
            raise UserError(f"{', '.join(given)} applies to chat data (--data chat:FILE.jsonl), not --data {s.data}")
        return
    if not s.data[len(CHAT):]:
        raise UserError("--data chat:PATH names a FILE.jsonl of conversations or a folder of them")
    if s.task != "sft":
        raise UserError(f"--task {s.task} trains on every token of a text; --data {s.data} is conversations, "
                         "trained on their answers: leave --task out (chat data is --task sft)")
    _check_rendered(s, CHAT)


def _check_rendered(s, prefix: str) -> None:
    """What chat and preference data both need: a held-out set like --data, the model's tokenizer and template."""
    if s.eval_data is not None and s.eval_fraction is not None:
        raise UserError("--eval-data and --eval-fraction both say what is held out for evaluation: give one")
    if s.eval_data is not None and not s.eval_data.startswith(prefix):
        raise UserError(f"--eval-data {s.eval_data}: held-out data is {prefix}PATH, like --data")
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


def check_pref(s) -> None:
    """Preference pairs (--data pref:PATH) train --task dpo against a reference that exists."""
    if not s.data.startswith(PREF):
        raise UserError(f"--task dpo trains on preference pairs: give --data pref:FILE.jsonl (--data {s.data} is not)")
    if not s.data[len(PREF):]:
        raise UserError("--data pref:PATH names a FILE.jsonl of preference pairs or a folder of them")
    if s.task != "dpo":
        raise UserError(f"--data {s.data} is preference pairs, trained by --task dpo; --task {s.task} is not that: "
                         "leave --task out")
    if s.dpo_loss not in VARIANTS:
        raise UserError(f"unknown --dpo-loss {s.dpo_loss!r}; choose one of {', '.join(VARIANTS)}")
    if not s.dpo_beta > 0:
        raise UserError(f"--dpo-beta is positive, got {s.dpo_beta}")
    if s.ref_logps == "online" and s.ref_from is not None and (s.lora or s.adapter):
        raise UserError(f"--ref-from {s.ref_from} with --ref-logps online: with --lora the reference is the "
                        "policy's own base (adapters off); use --ref-logps precompute for another reference model")
    if s.ref_from is not None:
        if not VARIANTS[s.dpo_loss].reference:
            raise UserError(f"--dpo-loss {s.dpo_loss} needs no reference model; leave --ref-from out")
        path = s.ref_from[len("hf:"):] if s.ref_from.startswith("hf:") else s.ref_from
        if not os.path.isdir(path):
            raise UserError(f"--ref-from {s.ref_from}: no such folder (the reference model: hf:DIR of a HuggingFace "
                             "model, or a checkpoint folder)")
    _check_rendered(s, PREF)


def check_grpo(s) -> None:
    """--task grpo samples completions of --prompts, scored by --reward, in groups of two or more."""
    if s.task != "grpo":
        raise UserError(f"--prompts are for --task grpo (completions sampled and rewarded); --task {s.task} is not "
                        "that: leave --task out")
    if s.prompts is None:
        raise UserError("--task grpo samples completions of prompts: give --prompts FILE.jsonl (rows "
                        "{\"prompt\": ...})")
    if not os.path.exists(s.prompts):
        raise UserError(f"--prompts {s.prompts}: no such file or folder")
    if s.reward is None or ":" not in s.reward or not s.reward.rsplit(":", 1)[1]:
        raise UserError(f"--task grpo scores completions with --reward module:function (or path/to/file.py:function)"
                        f"{'' if s.reward is None else f', got {s.reward!r}'}")
    if s.group_size < 2:
        raise UserError(f"--group-size {s.group_size}: a completion's advantage is its reward against the mean of "
                        "its group; a group of one has no baseline (give 2 or more)")
    if s.batch_size % s.group_size:
        raise UserError(f"--batch-size {s.batch_size} counts completions: a multiple of --group-size {s.group_size}")
    for name, value, ok in (("--max-completion", s.max_completion, s.max_completion >= 1),
                            ("--grpo-updates", s.grpo_updates, s.grpo_updates >= 1),
                            ("--temperature", s.temperature, s.temperature > 0),
                            ("--clip-eps", s.clip_eps, 0 < s.clip_eps < 1), ("--kl-coef", s.kl_coef, s.kl_coef >= 0)):
        if not ok:
            raise UserError(f"{name} {value} is out of range (--max-completion and --grpo-updates at least 1, "
                            "--temperature > 0, 0 < --clip-eps < 1, --kl-coef >= 0)")
    if s.backward_passes != 1:
        raise UserError("--task grpo with --backward-passes is not built yet: raise --batch-size instead")
    given = [f"--{k.replace('_', '-')}" for k in ("eval_data", "eval_fraction", "ref_from")
             if getattr(s, k) is not None]
    if given:
        raise UserError(f"{', '.join(given)} does not apply to --task grpo (no held-out loss: the metrics rows "
                        "carry the reward)")
    if s.data != "stdlib":
        raise UserError(f"--task grpo reads --prompts, not --data {s.data}: leave --data out")
    _check_rendered(s, "")
