"""1-bit Adam against AdamW where users run it: `python -m dpjax.train --optimizer onebit_adam`
as a process, over a grid of run lengths, batches, seeds and meshes (issue 36, item 4).

    python experiments/onebit_grid.py --json /tmp/grid.json --table /tmp/grid.md
    python experiments/onebit_grid.py --steps 200 --batches 32 --seeds 11 \\
        --onebit "" "onebit,start=40,refresh=2,bound=0.1"            # probes: specs against AdamW

Each cell is one (steps, batch, mesh, seed): AdamW (`--optimizer adamw`) against 1-bit Adam
(`--optimizer onebit_adam`, with `--compression SPEC` when a spec is given; "" is the
default the plan resolves, `dpjax.updates.onebit_adam.default_compression`). On a mesh with
a node axis (two sites, `2x4x1`) 1-bit Adam compresses between the sites only
(`--compress-axes node`, exact inside each), as the README runs it; AdamW is exact
everywhere. The figure compared is the mean of the last `--last` steps' training loss
(both optimizers see the same batches in the same order from the same initial parameters:
a seed fixes both), and the ratio is 1-bit's over AdamW's.

AdamW's learning rate is constant (no --warmup-steps), so its first S steps do not depend
on --steps: one AdamW run of the longest length gives every shorter cell's AdamW figure
(the window ending at step S), which `--no-reuse` turns off (a run per cell).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from _bench import add_smoke, checkout_env, load_avg, markdown_table, smoke_outputs

MODEL = ["--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--d-ff", "128", "--seq-len", "32"]
MODEL_TEXT = "GPT d_model 32, 2 layers, 4 heads, d_ff 128, seq 32, bytes of the stdlib corpus"


def train(steps: int, batch: int, mesh: str, seed: int, onebit: str | None, workdir: str) -> list[dict]:
    """The per-step metrics rows (loss, comm_bytes, ...) of one `python -m dpjax.train` process (onebit None:
    AdamW; "" 1-bit Adam's default; else its --compression spec). A run whose metrics are
    complete in `workdir` is read, not run again (an interrupted grid resumes)."""
    name = f"{steps}-{batch}-{mesh}-{seed}-{'adamw' if onebit is None else (onebit or 'default')}"
    metrics = os.path.join(workdir, name.replace(",", "_").replace("=", "") + ".jsonl")
    rows = _rows(metrics)
    if len(rows) == steps:
        return rows
    cmd = [sys.executable, "-m", "dpjax.train", "--steps", str(steps), "--batch-size", str(batch), "--mesh", mesh,
           "--seed", str(seed), "--eval-every", "0", "--eval-batches", "1", "--progress", "none",
           "--metrics", metrics, "--overwrite", *MODEL]
    if onebit is not None:
        cmd += ["--optimizer", "onebit_adam"] + (["--compression", onebit] if onebit else [])
        if mesh.count("x") == 2:  # node x data x model: compress between the two sites only
            cmd += ["--compress-axes", "node"]
    env = checkout_env()  # the seeds of a cell run the same programs: compile each once
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(workdir, "jit-cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    t0 = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-3000:]}")
    rows = _rows(metrics)
    assert len(rows) == steps, (name, len(rows))
    print(f"  {name}: {time.time() - t0:.0f} s, last loss {rows[-1]['loss']:.4f} (load {load_avg():.1f})", flush=True)
    return rows


def _rows(metrics: str) -> list[dict]:
    """A metrics file's step rows (those with a training loss), in order."""
    if not os.path.exists(metrics):
        return []
    with open(metrics) as fh:
        return [row for row in map(json.loads, fh) if "loss" in row]


def window(rows: list[dict], steps: int, last: int) -> float:
    """The mean training loss of the `last` steps ending at step `steps`."""
    part = [row["loss"] for row in rows[max(0, steps - last):steps]]
    return sum(part) / len(part)


def sent(rows: list[dict], steps: int) -> float:
    """The bytes the busiest device sent in the first `steps` steps (the metrics' comm_bytes:
    a step's compiled exchange, charged the branch it ran)."""
    return float(sum(row.get("comm_bytes", 0) for row in rows[:steps]))


def grid(args, workdir: str, done=None) -> list[dict]:
    """Every cell's two figures; the processes run `args.jobs` at a time, a group (batch,
    seed, mesh: its AdamW run and 1-bit Adam's runs of each length) after another, so that
    a grid cut short holds whole groups; `done(cells)` is called as each group completes."""
    longest = max(args.steps)
    groups = []
    for batch in args.batches:
        for seed in args.seeds:
            for mesh in args.meshes:
                base = (batch, seed, args.adamw_mesh or mesh)
                runs = [(s, batch, base[2], seed, None) for s in ([longest] if args.reuse else args.steps)]
                runs += [(s, batch, mesh, seed, spec) for s in args.steps for spec in args.onebit]
                groups.append(runs)
    cells = []
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {}
        for runs in groups:
            for key in runs:
                if key not in futures:
                    futures[key] = pool.submit(train, *key, workdir)
        for runs in groups:
            for steps, batch, mesh, seed, spec in runs:
                if spec is None:
                    continue
                base = futures[(longest if args.reuse else steps, batch, args.adamw_mesh or mesh, seed, None)]
                mine = futures[(steps, batch, mesh, seed, spec)].result()
                a, b = window(base.result(), steps, args.last), window(mine, steps, args.last)
                fewer = sent(base.result(), steps) / max(sent(mine, steps), 1.0)
                cells.append({"steps": steps, "batch": batch, "mesh": mesh, "seed": seed, "onebit": spec or "default",
                              "adamw": a, "onebit_loss": b, "ratio": b / a, "bytes_fewer": fewer,
                              "adamw_mesh": args.adamw_mesh or mesh})
            if done:
                done(cells)
    return cells


def table(cells: list[dict]) -> str:
    cells = sorted(cells, key=lambda c: (c["onebit"], c["mesh"], c["steps"], c["batch"], c["seed"]))
    rows = [[c["onebit"], c["steps"], c["batch"], c["mesh"], c["seed"], f"{c['adamw']:.4f}", f"{c['onebit_loss']:.4f}",
             f"{c['ratio']:.4f}", f"{100 * (c['ratio'] - 1):+.1f}%", f"{c['bytes_fewer']:.1f}"] for c in cells]
    out = markdown_table(["1-bit spec", "steps", "batch", "mesh", "seed", "AdamW loss", "1-bit loss", "ratio",
                          "vs AdamW", "x fewer bytes"], rows, right=set(range(1, 10)))
    for spec in dict.fromkeys(c["onebit"] for c in cells):
        mine = [c for c in cells if c["onebit"] == spec]
        worst = max(mine, key=lambda c: c["ratio"])
        over = [c for c in mine if c["ratio"] > 1.02]
        out += (f"\n{spec}: ratio {min(c['ratio'] for c in mine):.4f}-{worst['ratio']:.4f} over {len(mine)} cells; "
                f"worst {worst['steps']} steps, batch {worst['batch']}, {worst['mesh']}, seed {worst['seed']}; "
                f"{len(over)} above 1.02\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, nargs="+", default=[200, 1000])
    p.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--meshes", nargs="+", default=["8x1", "2x4x1"], help="8x1: one site; 2x4x1: two sites")
    p.add_argument("--onebit", nargs="+", default=[""], help='1-bit Adam\'s --compression specs ("": the default)')
    p.add_argument("--last", type=int, default=10, help="the steps whose mean training loss is compared")
    p.add_argument("--no-reuse", dest="reuse", action="store_false",
                   help="an AdamW run per cell (default: the longest run's prefix, see the docstring)")
    p.add_argument("--adamw-mesh", help="AdamW's runs on this mesh only, the baseline of every mesh's cells "
                   "(default: each mesh its own)")
    p.add_argument("--jobs", type=int, default=1, help="processes at a time")
    p.add_argument("--workdir", help="keep the runs' metrics here; a grid run again reads the runs done (default: "
                   "a temporary directory)")
    p.add_argument("--json", help="write the cells here")
    p.add_argument("--table", help="write the markdown table here")
    add_smoke(p, "AdamW and the default, 4 steps, batch 8, one seed, two sites")
    args = p.parse_args(argv)
    smoke_outputs(args, "json", "table", "workdir")
    if args.smoke:
        args.steps, args.batches, args.seeds, args.meshes, args.last = [4], [8], [0], ["2x4x1"], 2
    print(f"{MODEL_TEXT}; load {load_avg():.1f}", flush=True)

    def write(cells):
        text = table(cells)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"model": MODEL_TEXT, "last": args.last, "cells": cells}, fh, indent=1)
        if args.table:
            with open(args.table, "w") as fh:
                fh.write(text)
        return text

    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        cells = grid(args, args.workdir, write)
    else:
        with tempfile.TemporaryDirectory(prefix="onebit-grid-") as workdir:
            cells = grid(args, workdir, write)
    print(write(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
