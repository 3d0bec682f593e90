"""The train step of the main job's layouts, compiled and fingerprinted: a refactor that changes no
behaviour leaves every fingerprint as it was.

    python experiments/step_fingerprints.py --out before.json          # on the tree before a change
    python experiments/step_fingerprints.py --compare before.json      # after it: exit 1 on a difference
    python experiments/step_fingerprints.py --smoke                    # one tiny layout: what the tests run

Each layout is a `python -m dpjax.train` command line (LAYOUTS below): its Settings are parsed by the
CLI's own parser, resolved into a plan on the 8 simulated CPU devices, and its train program
(`dpjax.step.for_plan(plan).train`) lowered and compiled for the parameters and optimizer state
the Trainer makes (a tiny model's, made by the step's own init) and an abstract batch (no step
runs). Two texts are hashed:

- the lowered StableHLO (what dpjax asks XLA to compile), without source locations;
- the compiled HLO after XLA's passes, with every `metadata={...}` and the tables of source files,
  functions and stack frames removed: they name the Python file and line each operation was
  traced from, which moves when code moves, while the program does not.

A difference names the layout and which of its two texts moved; `--keep DIR` writes the texts, to
diff them.

Compare runs of the same layouts in the same order (the same `--only`s, or none): a layout's texts
depend on what the process traced before it (a 2x4 run alone hashes differently from the 2x4 after
8x1). The devices are XLA_FLAGS' simulated ones without dpjax's CPU guards
(`simulate_cpu_devices`), the same on both sides of a comparison.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import dpjax.step as S  # noqa: E402
from dpjax.mesh import data_axes  # noqa: E402
from dpjax.plan import resolve  # noqa: E402
from dpjax.train.cli import parse_args  # noqa: E402

TINY = ["--n-layers", "2", "--d-model", "32", "--n-heads", "4", "--seq-len", "16", "--batch-size", "16"]
# The main job's layouts (README, docs/parallelism.md): data, data x model, FSDP, the compressed
# exchanges, a hierarchical allreduce, pipeline, context and expert axes, an update rule.
LAYOUTS: dict[str, list[str]] = {
    "8x1": ["--mesh", "8x1"],
    "2x4": ["--mesh", "2x4"],
    "2x4 fsdp": ["--mesh", "2x4", "--fsdp"],
    "8x1 butterfly": ["--mesh", "8x1", "--allreduce", "butterfly"],  # ring is the default on CPU
    "2x2x2 hierarchical": ["--mesh", "2x2x2", "--allreduce", "hierarchical"],
    "8x1 bf16": ["--mesh", "8x1", "--compression", "bf16"],
    "8x1 int8": ["--mesh", "8x1", "--compression", "int8"],
    "8x1 powersgd": ["--mesh", "8x1", "--compression", "powersgd:2"],
    "4x2 topk": ["--mesh", "4x2", "--compression", "topk:0.25"],
    "8x1 local sgd": ["--mesh", "8x1", "--update", "sparse:2"],
    "stage=2,data=4 1f1b": ["--mesh", "stage=2,data=4", "--schedule", "1f1b", "--microbatches", "4"],
    "context=2,data=4": ["--mesh", "context=2,data=4"],
    "data=2,expert=4 moe": ["--mesh", "data=2,expert=4", "--experts", "4"],
}
SMOKE = {"2x4": LAYOUTS["2x4"]}
_METADATA = re.compile(r",? metadata=\{[^{}]*\}")
# The compiled text's tables of where the code sits: the files, functions and lines traced from
_SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def program(compiled_text: str) -> str:
    """The compiled HLO without what names the Python source: each op's metadata and the tables."""
    blocks = _METADATA.sub("", compiled_text).split("\n\n")
    return "\n\n".join(b for b in blocks if b.split("\n", 1)[0].strip() not in _SOURCE_TABLES)


def texts(argv: list[str]) -> tuple[str, str]:
    """(the lowered StableHLO, the compiled HLO without metadata) of one layout's train step."""
    plan = resolve(parse_args([*TINY, *argv]), jax.devices())
    step = S.for_plan(plan)
    # the parameters and optimizer state made as the Trainer makes them (tiny: they are made, not
    # only shaped, so that each value has the sharding the step's init gives it); the batch abstract
    params, state = step.init(S.init_params(plan.model, plan.layout, jax.random.key(0), plan.policy))
    batch = jax.ShapeDtypeStruct((plan.passes, plan.global_batch, plan.model.config.seq_len + 1), "int32",
                                 sharding=NamedSharding(plan.mesh, P(None, data_axes(plan.mesh) or None)))
    lowered = step.train.lower(params, state, batch)
    return lowered.as_text(), program(lowered.compile().as_text())


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprints(layouts: dict[str, list[str]], keep: str | None = None) -> dict[str, dict[str, str]]:
    out = {}
    for i, (name, argv) in enumerate(layouts.items(), 1):
        lowered, compiled = texts(argv)
        out[name] = {"argv": " ".join(argv), "lowered": digest(lowered), "compiled": digest(compiled)}
        if keep:  # the texts themselves, to diff when a fingerprint moved
            os.makedirs(keep, exist_ok=True)
            for kind, text in (("lowered", lowered), ("compiled", compiled)):
                with open(os.path.join(keep, f"{re.sub(r'[^A-Za-z0-9]+', '_', name)}.{kind}.txt"), "w") as fh:
                    fh.write(text)
        print(f"[{i}/{len(layouts)}] {name}: lowered {out[name]['lowered']}, compiled {out[name]['compiled']}",
              file=sys.stderr, flush=True)
    return out


def compare(before: dict, after: dict) -> list[str]:
    """The layouts whose program changed (or that only one side has), each with what moved."""
    moved = []
    for name in sorted(set(before) | set(after)):
        b, a = before.get(name), after.get(name)
        if b is None or a is None:
            moved.append(f"{name}: only {'after' if b is None else 'before'}")
        elif b["argv"] != a["argv"]:
            moved.append(f"{name}: different command lines ({b['argv']!r} / {a['argv']!r})")
        else:
            moved += [f"{name}: {kind} {b[kind]} -> {a[kind]}" for kind in ("lowered", "compiled")
                      if b[kind] != a[kind]]
    return moved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="write the fingerprints to this JSON file")
    ap.add_argument("--compare", metavar="FILE", help="compare with fingerprints written before; exit 1 if any moved")
    ap.add_argument("--keep", metavar="DIR", help="also write each layout's two texts into DIR (to diff them)")
    ap.add_argument("--only", action="append", help="one layout by name (repeatable; default: all)")
    ap.add_argument("--smoke", action="store_true", help="one layout (2x4): what the tests run")
    args = ap.parse_args(argv)
    layouts = SMOKE if args.smoke else {k: v for k, v in LAYOUTS.items() if not args.only or k in args.only}
    if args.only and len(layouts) != len(args.only):
        ap.error(f"--only names no layout: choose from {', '.join(LAYOUTS)}")
    got = fingerprints(layouts, args.keep)
    print(json.dumps(got, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(got, fh, indent=1)
    if args.compare:
        with open(args.compare) as fh:
            before = {k: v for k, v in json.load(fh).items() if k in got}
        moved = compare(before, got)
        print("\n".join(moved) if moved else f"all {len(got)} layouts compile to the same programs", file=sys.stderr)
        return 1 if moved else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
