"""A crash sweep of `python -m dpjax.train`: every pair of values of any two options runs as
a real process for a few steps, and each must end in exit 0 or a one-line refusal (exit 2,
one line on stderr) — never a signal, never a traceback.

The options are the covering design's factors (the layout, the update rule, compression,
accumulation, the compute dtype) with the layer loop and the gradient exchange's
algorithm; `pairwise` picks rows greedily until every pair of values of any two factors
appears in some row (the classic AETG construction), so 7 factors take ~25 processes,
not the 1,600 of every combination.

    python experiments/sweep.py                 # the whole sweep, a table of rows
    python experiments/sweep.py --smoke         # two rows, one step each
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import time

import _bench


# factor -> values, each value the flags it adds ("" adds none)
FACTORS = {
    "layout": ["--mesh 8x1", "--mesh 2x4", "--mesh 2x2x2", "--mesh 8x1 --fsdp", "--mesh 2x2x2 --fsdp"],
    "update": ["--update sync", "--update delayed:2", "--update sparse:3", "--update async:2", "--update delayed:0"],
    # hierarchical needs a node axis, which one layout here has: tests/test_train.py runs it on 2x4x1 and 2x2x2 --fsdp
    "allreduce": ["--allreduce ring", "--allreduce psum", "--allreduce butterfly", "--allreduce tree"],
    "compression": ["", "--compression bf16"],
    "passes": ["", "--backward-passes 2"],
    "dtype": ["--dtype float32", "--dtype bfloat16"],
    "loop": ["", "--layer-loop"],
}
TINY = ("--d-model 32 --n-layers 2 --n-heads 4 --d-ff 64 --seq-len 32 --batch-size 16 --seed 4 --progress none "
        "--eval-batches 1")


def pairwise(factors: dict[str, list], tries: int = 50) -> list[dict]:
    """Rows (one value per factor) until every pair of values of any two factors appears.
    Greedy: each new row is, of `tries` candidates grown factor by factor (each from another
    first factor), the one covering the most pairs not yet covered; deterministic."""
    names = list(factors)
    sizes = [len(factors[n]) for n in names]

    def pair(i, vi, j, vj):
        return (i, vi, j, vj) if i < j else (j, vj, i, vi)

    todo = {(i, vi, j, vj) for i, j in itertools.combinations(range(len(names)), 2)
            for vi in range(sizes[i]) for vj in range(sizes[j])}
    rows = []
    while todo:
        best, best_gain = None, -1
        for t in range(tries):
            row = {}
            for k in [(t + n) % len(names) for n in range(len(names))]:
                row[k] = max(range(sizes[k]), key=lambda v: (sum(pair(i, vi, k, v) in todo for i, vi in row.items()),
                                                             -((v + t) % sizes[k])))
            gain = sum(pair(i, row[i], j, row[j]) in todo for i, j in itertools.combinations(row, 2))
            if gain > best_gain:
                best, best_gain = row, gain
        rows.append(best)
        todo -= {pair(i, best[i], j, best[j]) for i, j in itertools.combinations(best, 2)}
    return [{n: factors[n][best_row[i]] for i, n in enumerate(names)} for best_row in rows]


def ends_well(rc, stderr_lines: list[str]) -> bool:
    """Exit 0, or a user error's one-line refusal (exit 2, one line, no traceback)."""
    return rc == 0 or (rc == 2 and len(stderr_lines) == 1 and "Traceback" not in stderr_lines[0])


def run(row: dict, steps: int, timeout: float) -> dict:
    flags = " ".join(v for v in row.values() if v).split() + TINY.split() + ["--steps", str(steps)]
    env = _bench.checkout_env()
    began = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "dpjax.train", *flags], check=False, env=env, capture_output=True,
                           text=True, timeout=timeout)
        rc, err = p.returncode, p.stderr.strip().splitlines()
    except subprocess.TimeoutExpired:
        rc, err = "timeout", []
    ok = ends_well(rc, err)
    return {"flags": " ".join(flags[:len(flags) - len(TINY.split()) - 2]), "exit": rc,
            "seconds": time.perf_counter() - began, "ok": ok, "said": (err[-1][:100] if err and rc != 0 else "")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="training steps per process (default 3)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a process may take (default 600)")
    ap.add_argument("--smoke", action="store_true", help="two rows of one step: the sweep's machinery")
    args = ap.parse_args(argv)
    rows = pairwise(FACTORS)
    if args.smoke:
        rows, args.steps = rows[:2], 1
    print(f"{len(rows)} processes cover every pair of {len(FACTORS)} options' values")
    print("| options | exit | seconds | refusal or fault |")
    print("|---|---:|---:|---|")
    bad = 0
    for row in rows:
        r = run(row, args.steps, args.timeout)
        bad += not r["ok"]
        print(f"| `{r['flags']}` | {r['exit']} | {r['seconds']:.1f} | {r['said']} |", flush=True)
    print(f"{len(rows) - bad} of {len(rows)} ended in exit 0 or a one-line refusal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
