"""`python -m dpjax.generate --init-from hf:DIR|CKPT (--prompt TEXT [--tokenizer PATH] |
--prompt-ids 1,2,3) --max-new-tokens N [--temperature T] [--top-p P] [--adapter DIR] [--json]`

Prints the prompt and its continuation (or, with --json, one object: the prompt's ids,
the new ids and the text). Greedy unless --temperature is above 0; stops at the model's
EOS (config.json's eos_token_id, or the tokenizer's). The weights are read onto --mesh
(default: every device on `model` where it divides). User errors: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dpjax.collectives.cpu_runtime import guard_flagged
from dpjax.errors import UserError


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"--prompt-ids takes comma-separated token ids, e.g. 1,2,3; got {text!r}") from None
    if not ids:
        raise UserError("--prompt-ids is empty")
    return ids


def eos_ids(hub: dict | None, tok) -> list[int]:
    eos = (hub or {}).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return ids or ([tok.eos_id] if tok is not None and tok.eos_id is not None else [])


def run(args) -> dict:
    from dpjax.generate import Sampling, generate
    from dpjax.hf import model_of
    from dpjax.data.tokenizer import for_model

    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UserError("--max-new-tokens must be at least 1, --temperature at least 0, --top-p in (0, 1]")
    model, hub, record = model_of(args.init_from)
    tok = for_model(args.init_from, args.tokenizer, model.config.vocab_size)
    if args.prompt is not None:
        if tok is None:
            raise UserError(f"{args.init_from} has no tokenizer.json (nor tokenizer.model) and "
                            f"{model.config.vocab_size} ids: give "
                            "--tokenizer PATH, or --prompt-ids")
        prompt = tok.encode(args.prompt)
        bos = (hub or {}).get("bos_token_id")
        if isinstance(bos, int) and args.bos:
            prompt = [bos] + prompt
    else:
        prompt = _ids(args.prompt_ids)
    if max(prompt) >= model.config.vocab_size:
        raise UserError(f"prompt id {max(prompt)} is beyond the model's {model.config.vocab_size} ids")
    model, _, _ = model_of(args.init_from, seq_len=len(prompt) + args.max_new_tokens)
    model, params = _weights(args, model, record)
    new = generate(model, params, [prompt], args.max_new_tokens,  # one row: it ends at its EOS, if any
                   Sampling(args.temperature, args.top_p, args.seed), eos=eos_ids(hub, tok))[0].tolist()
    out = {"prompt_ids": prompt, "new_ids": new}
    if tok is not None:
        out["text"] = tok.decode(new)
        out["prompt"] = tok.decode(prompt)
    return out


def _weights(args, model, record):
    """(the model, its parameters on the mesh): with LoRA adapters (--adapter, or a LoRA run's
    checkpoint) the base with them merged in (base + alpha/r B A), as an export --merge writes it."""
    import jax

    from dpjax.hf import params_of
    from dpjax.hf.source import default_mesh
    from dpjax.models.lora import Lora
    from dpjax.sharding import make_layout

    if args.adapter is not None:
        from dpjax.hf.adapter import read_config

        model = model if isinstance(model, Lora) else Lora(model, read_config(args.adapter).lora)
    mesh = default_mesh(model, args.mesh)
    params = params_of(args.init_from, model, make_layout(model, mesh), record, adapter=args.adapter)
    if not isinstance(model, Lora):
        return model, params
    return model.base, jax.device_put(jax.jit(model.merge)(params), make_layout(model.base, mesh).shardings())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpjax.generate", description=__doc__.split("\n\n")[1])
    p.add_argument("--init-from", required=True, help="hf:DIR (a HuggingFace Llama folder) or a dpjax checkpoint")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="text, tokenized by --tokenizer (default: the folder's tokenizer.json or "
                                         "tokenizer.model)")
    which.add_argument("--prompt-ids", help="token ids, e.g. 1,2,3")
    p.add_argument("--tokenizer", help="a tokenizer.json, a SentencePiece .model, or bytes")
    p.add_argument("--no-bos", dest="bos", action="store_false", help="do not start a --prompt with the BOS id")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default 1: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", help="e.g. 1x8 (default: every device on model where it divides)")
    p.add_argument("--adapter", help="a PEFT LoRA adapter folder to put on --init-from's weights")
    p.add_argument("--json", action="store_true", help="print one JSON object")
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
    else:
        print(out.get("prompt", out["prompt_ids"]), end="" if "text" in out else " -> ")
        print(out.get("text", out["new_ids"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
