"""`python -m dpjax.hf import DIR --out CKPT` / `python -m dpjax.hf export CKPT --out DIR`.

import: a HuggingFace folder of a supported family (config.json, safetensors: one file or shards and
their index) -> a dpjax checkpoint (parameters, float32, step 0), read on a mesh
(--mesh, default every device on `model` where it divides: each device reads its own
block from the memory-mapped files). export: a dpjax checkpoint (an import's, or a
training run's --ckpt-dir, from any mesh) -> a HuggingFace folder in the Hub's layout,
with the imported model's config.json (changed only where the model differs), tokenizer,
chat template and generation config; an existing export is replaced only with
--overwrite. verify: dpjax against transformers on a folder (greedy continuations,
last-position log-probs, round trip), printed as a markdown card (`dpjax.hf.verify`).
User errors: one line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

from dpjax.collectives.cpu_runtime import guard_flagged
from dpjax.errors import UserError, os_error_line
from dpjax.hf import identity
from dpjax.hf.adapter import export as export_adapter
from dpjax.hf.family import FAMILIES
from dpjax.hf.files import DTYPES
from dpjax.hf.load import model_from_hf
from dpjax.hf.source import default_mesh, model_of, params_of
from dpjax.hf.verify import verify
from dpjax.hf.writer import TORCH_DTYPES, check_out, export, save_checkpoint
from dpjax.models.lora import Lora
from dpjax.sharding import make_layout


def do_import(folder: str, out: str, mesh_spec: str | None) -> str:
    model, hub = model_from_hf(folder)
    if os.path.isdir(out) and os.listdir(out):
        raise UserError(f"{out} exists and is not empty; pass a new folder")
    layout = make_layout(model, default_mesh(model, mesh_spec))
    params = params_of("hf:" + folder, model, layout)
    save_checkpoint(out, params, model, hub, hub.get("dtype") or hub.get("torch_dtype") or "float32", folder)
    n = model.num_params(params)
    return f"{out}: {model.name} with {n:,} parameters from {folder} (step 0); train with --init-from {out}"


def do_export(ckpt: str, out: str, dtype: str | None, shard_mb: float, overwrite: bool = False,
              lora: str | None = None) -> str:
    """lora: for a LoRA run's checkpoint, "adapter" (PEFT's files) or "merge" (full weights, base + alpha/r B A)."""
    made = check_out(out, overwrite)
    try:
        return _export(ckpt, out, dtype, shard_mb, lora)
    except BaseException:
        if made and os.path.isdir(out) and not os.listdir(out):
            os.rmdir(out)  # a failed export leaves no empty folder behind
        raise


def _export(ckpt: str, out: str, dtype: str | None, shard_mb: float, lora: str | None = None) -> str:
    model, _, record = model_of(ckpt)
    if model.name not in FAMILIES:
        raise UserError(f"{ckpt} holds a {model.name} model; the HuggingFace export writes {', '.join(FAMILIES)}")
    origin = identity.origin(ckpt, record)  # the imported model: its config, tokenizer, template
    layout = make_layout(model, default_mesh(model))
    params = params_of(ckpt, model, layout, record)
    dtype = dtype or (record.get("hf") or {}).get("dtype") or (origin and origin.dtype) or "float32"
    model, params, adapter = _lora_export(ckpt, model, params, lora)
    if adapter:
        base = origin and (origin.folder or origin.missing)  # PEFT's base_model_name_or_path
        files = export_adapter(params, model, out, dtype=DTYPES[TORCH_DTYPES[dtype]], base=base or None)
        return f"{out}: {', '.join(files)} ({dtype}): a PEFT adapter of {base or 'its base model'}"
    files = export(params, model, out, dtype=dtype, base_config=origin and origin.config,
                   max_shard_bytes=int(shard_mb * 2**20))
    files += identity.copy_files(origin, out)
    line = f"{out}: {', '.join(files)} ({dtype})"
    if origin is None:
        return line + "; no tokenizer: the model was not imported from a HuggingFace folder"
    if origin.missing:
        return line + (f"; {origin.missing}, where the model was imported from, is not there: no tokenizer"
                       + ("" if origin.config else ", and config.json is dpjax's own"))
    return line


def _lora_export(ckpt: str, model, params, how: str | None):
    """(the model and parameters to write, whether as an adapter): a LoRA checkpoint's
    adapters (--adapter), or its base with them merged (--merge)."""
    if not isinstance(model, Lora):
        if how:
            raise UserError(f"{ckpt} holds no LoRA adapters (a run without --lora): export it without --{how}")
        return model, params, False
    if how is None:
        raise UserError(f"{ckpt} holds a LoRA run (a frozen base and adapters): export --adapter writes PEFT's "
                        "adapter files, --merge the full weights with the adapters merged in")
    if how == "adapter":
        return model, params, True
    return model.base, jax.jit(model.merge)(params), False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpjax.hf", description=__doc__.split("\n\n")[1])
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("import", help="a HuggingFace folder -> a dpjax checkpoint")
    i.add_argument("folder", help="a HuggingFace model folder (config.json, *.safetensors)")
    i.add_argument("--out", required=True, help="the dpjax checkpoint folder to write")
    i.add_argument("--mesh", help="read onto this mesh (default: every device on model where it divides)")
    e = sub.add_parser("export", help="a dpjax checkpoint -> a HuggingFace folder")
    e.add_argument("ckpt", help="a dpjax checkpoint folder: a training run's --ckpt-dir or an import's --out")
    e.add_argument("--out", required=True, help="the HuggingFace folder to write")
    e.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="the files' dtype (default: the imported folder's, else float32)")
    e.add_argument("--shard-mb", type=float, default=5 * 1024, help="largest safetensors file in MiB (default 5 GiB)")
    e.add_argument("--overwrite", action="store_true", help="replace the files of a folder that is not empty "
                                                            "(default: refuse)")
    how = e.add_mutually_exclusive_group()  # a LoRA run's checkpoint (--lora): which of the two
    how.add_argument("--adapter", dest="lora", action="store_const", const="adapter",
                     help="write the LoRA adapters as PEFT does (adapter_config.json, adapter_model.safetensors)")
    how.add_argument("--merge", dest="lora", action="store_const", const="merge",
                     help="write full weights with the LoRA adapters merged in (base + alpha/r B A: for vLLM)")
    v = sub.add_parser("verify", help="dpjax against HuggingFace transformers on a folder: a card")
    v.add_argument("folder", help="a HuggingFace model folder of a supported family")
    v.add_argument("--expected", help="transformers' saved outputs (a fixture's expected.json) instead of running it")
    v.add_argument("--train", default="", help="meshes to train 5 steps on from the folder and compare, e.g. 2x4,8x1")
    v.add_argument("--name", help="the folder's name on the card (default: its path)")
    args = p.parse_args(argv)
    guard_flagged()  # devices simulated with XLA_FLAGS: guard their collectives before JAX starts
    try:
        if args.command == "import":
            line = do_import(args.folder, args.out, args.mesh)
        elif args.command == "verify":
            line, ok = verify(args.folder, args.expected, tuple(filter(None, args.train.split(","))), name=args.name)
            print(line, end="")
            return 0 if ok else 1
        else:
            line = do_export(args.ckpt, args.out, args.dtype, args.shard_mb, args.overwrite, args.lora)
    except UserError as e:
        if os.environ.get("DPJAX_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a read-only --out, a full disk: one line, like a user error
        if os.environ.get("DPJAX_DEBUG"):
            raise
        print(f"error: {os_error_line(e, args.folder if args.command == 'verify' else args.out)}", file=sys.stderr)
        return 2
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
