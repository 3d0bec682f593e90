"""`python -m dpjax.generate --init-from hf:DIR|CKPT (--prompt TEXT [--tokenizer PATH] |
--prompt-ids 1,2,3) --max-new-tokens N [--temperature T] [--top-p P] [--adapter DIR] [--logprobs K]
[--logprobs-out FILE.npy] [--json]`

Prints the prompt and its continuation (or, with --json, one object: the prompt's ids,
the new ids, the text, and with --logprobs K the K most likely first new tokens and their
log-probs). Greedy unless --temperature is above 0; stops at any of the model's EOS ids
(config.json's and generation_config.json's eos_token_id, or the tokenizer's). Any
prompt + --max-new-tokens up to the model's context. The weights are read onto --mesh
(default: every device on `model` where it divides). User errors: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

from dpjax.collectives.cpu_runtime import guard_flagged
from dpjax.errors import UserError, os_error_line
from dpjax.generate import Sampling, check_length, generate
from dpjax.generate.source import eos_ids, open_source, tokenizer_of
from dpjax.hf import params_of
from dpjax.hf.adapter import read_config as adapter_config
from dpjax.hf.source import default_mesh
from dpjax.models.lora import Lora
from dpjax.sharding import make_layout


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"--prompt-ids takes comma-separated token ids, e.g. 1,2,3; got {text!r}") from None
    if not ids:
        raise UserError("--prompt-ids is empty")
    return ids


def run(args) -> dict:
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1 or args.logprobs < 0:
        raise UserError("--max-new-tokens must be at least 1, --temperature at least 0, --top-p in (0, 1], "
                        "--logprobs at least 0")
    source = open_source(args.init_from)
    vocab = source.model.config.vocab_size
    tok = tokenizer_of(source, args.tokenizer)
    if args.prompt is not None:
        if tok is None:
            raise UserError(f"{args.init_from} has no tokenizer.json (nor tokenizer.model) and {vocab} ids: give "
                            "--tokenizer PATH, or --prompt-ids")
        bos = (source.hub or {}).get("bos_token_id")
        prompt = tok.prompt_ids(args.prompt, bos if isinstance(bos, int) else None, specials=args.bos)
        if not prompt:
            raise UserError("--prompt encodes to no tokens: give some text, or --prompt-ids")
    else:
        prompt = _ids(args.prompt_ids)
    if max(prompt) >= vocab or min(prompt) < 0:
        raise UserError(f"prompt id {max(prompt) if max(prompt) >= vocab else min(prompt)} is outside the "
                        f"model's {vocab} ids")
    need = len(prompt) + args.max_new_tokens
    if need > source.context:  # the context, not the seq_len of the model as saved: said in its words
        raise UserError(f"a prompt of {len(prompt)} tokens + --max-new-tokens {args.max_new_tokens} = {need} positions "
                        f"exceed the model's context of {source.context}: shorten the prompt or ask fewer new tokens")
    model = source.model_for(need)
    check_length(model, len(prompt), args.max_new_tokens)
    model, params = _weights(args, model, source.record)
    new, logp_BxV = generate(model, params, [prompt], args.max_new_tokens,  # one row: it ends at its EOS, if any
                             Sampling(args.temperature, args.top_p, args.seed), eos=eos_ids(source, tok),
                             logprobs=True)
    out = {"prompt_ids": prompt, "new_ids": new[0].tolist()}
    if tok is not None:
        out["text"] = tok.decode(out["new_ids"])
        out["prompt"] = tok.decode(prompt)
    logp_V = logp_BxV[0]
    if args.logprobs:  # the most likely first new tokens, most likely first (ties: the lower id)
        top = np.argsort(-logp_V, kind="stable")[:args.logprobs]
        out["logprobs"] = {"position": len(prompt) - 1, "ids": top.tolist(),
                           "values": [float(v) for v in logp_V[top]]}
    if args.logprobs_out:
        _save(args.logprobs_out, logp_V)
        out["logprobs_file"] = args.logprobs_out
    return out


def _weights(args, model, record):
    """(the model, its parameters on the mesh): with LoRA adapters (--adapter, or a LoRA run's
    checkpoint) the base with them merged in (base + alpha/r B A), as an export --merge writes it."""
    if args.adapter is not None:
        model = model if isinstance(model, Lora) else Lora(model, adapter_config(args.adapter, args.init_from).lora)
    mesh = default_mesh(model, args.mesh)
    params = params_of(args.init_from, model, make_layout(model, mesh), record, adapter=args.adapter)
    if not isinstance(model, Lora):
        return model, params
    return model.base, jax.device_put(jax.jit(model.merge)(params), make_layout(model.base, mesh).shardings())


def _save(path: str, logp_V) -> None:
    try:
        with open(path, "wb") as f:
            np.save(f, logp_V.astype(np.float32))
    except OSError as e:
        raise UserError(os_error_line(e, path)) from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpjax.generate", description=__doc__.split("\n\n")[1])
    p.add_argument("--init-from", required=True, help="hf:DIR (a HuggingFace folder of a supported family) or a dpjax "
                                                         "checkpoint (a training run's --ckpt-dir, an import's)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="text, tokenized by --tokenizer (default: the folder's tokenizer.json or "
                                         "tokenizer.model)")
    which.add_argument("--prompt-ids", help="token ids, e.g. 1,2,3")
    p.add_argument("--tokenizer", help="a tokenizer.json, a SentencePiece .model, or bytes")
    p.add_argument("--no-bos", dest="bos", action="store_false",
                   help="no special tokens before a --prompt. By default a tokenizer.json adds what its post-processor "
                        "adds, as transformers' tokenizer(text) does (Llama 3's and Gemma's a BOS, Qwen's none); a "
                        "SentencePiece or byte tokenizer puts config.json's bos_token_id first")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens to generate at most; fewer when an end-of-turn id comes first (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default 1: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling's seed with --temperature above 0 (default 0)")
    p.add_argument("--mesh", help="e.g. 1x8 (default: every device on model where it divides)")
    p.add_argument("--adapter", help="a PEFT LoRA adapter folder to put on --init-from's weights")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--logprobs", type=int, default=0, metavar="K",
                   help="the K most likely first new tokens' log-probs (at the prompt's last position)")
    p.add_argument("--logprobs-out", metavar="FILE.npy",
                   help="save that position's whole log-prob vector (V float32, numpy's .npy) to FILE.npy")
    args = p.parse_args(argv)
    guard_flagged()  # devices simulated with XLA_FLAGS: guard their collectives before JAX starts
    try:
        out = run(args)
    except UserError as e:
        if os.environ.get("DPJAX_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
        return 0
    print(out.get("prompt", out["prompt_ids"]), end="" if "text" in out else " -> ")
    print(out.get("text", out["new_ids"]))
    if "logprobs" in out:
        lp = out["logprobs"]
        print(f"logprobs at position {lp['position']}: " + ", ".join(
            f"{i}:{v:.6f}" for i, v in zip(lp["ids"], lp["values"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
