"""A crash sweep of `python -m dpjax.train`: every pair of values of any two options runs as
a real process for a few steps, and each must end in exit 0 or a one-line refusal (exit 2,
one line on stderr) — never a signal, never a traceback, never a hang.

Two covering designs (DESIGNS): the layouts (data, tensor-parallel, FSDP, context, expert
and stage axes) against the compute features (dtype with fp8, remat, the model, attention,
the layer loop, accumulation, the data and tokenizer, sampling, commits and checkpoints),
and the update rules against the exchange (allreduce, compression and its axes, the
optimizer with 1-bit Adam, fusion). `pairwise` picks rows greedily until every pair of
values of any two factors of a design appears in some row (the classic AETG construction),
so ~100 processes, not the millions of every combination. With `--cover planned` (the default)
the cover passes over a row that `dpjax.plan` refuses (resolved in this process, no compile)
where another row covers the same new pairs, so few pairs are seen only refused.

    python experiments/sweep.py --jobs 2        # both designs, a table of rows each
    python experiments/sweep.py --design "update rules x exchange"
    python experiments/sweep.py --smoke         # one row of one step per design
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import subprocess
import sys
import tempfile
import time

import _bench


# design -> factor -> values, each value the flags it adds ("" adds none; "{tmp}" is a fresh
# folder of the row's own). Two covering designs, not one: a pair of the 12 layouts with the
# 8 compressions would be one row each (~100 rows); the layouts meet the compute features,
# and the update rules meet the exchange on the data-parallel layouts they share.
DESIGNS = {
    "layouts x features": {
        "layout": ["--mesh 8x1", "--mesh 2x4", "--mesh 2x2x2", "--mesh 8x1 --fsdp", "--mesh 2x2x2 --fsdp",
                   "--mesh data=2,context=4",
                   "--mesh data=2,context=2,model=2 --fsdp --context-attention allgather",
                   "--mesh data=2,expert=4 --experts 8",
                   "--mesh expert=4,model=2 --experts 8 --top-k 1 --expert-alltoall bruck",
                   "--mesh data=2,expert=4 --fsdp --experts 8 --expert-alltoall xla",
                   "--mesh stage=2,data=2,model=2 --schedule gpipe",
                   "--mesh stage=2,data=4 --fsdp --schedule interleaved --microbatches 2 --n-layers 4"],
        "dtype": ["--dtype float32", "--dtype bfloat16", "--dtype fp8"],
        "remat": ["--remat auto", "--remat none", "--remat dots", "--remat full"],
        "model": ["", "--model llama --n-kv-heads 2"],
        "attention": ["--attention naive", "--attention xla"],
        "loop": ["", "--layer-loop"],
        "passes": ["", "--backward-passes 2"],
        "data": ["", "--data synthetic", "--tokenizer bpe:300"],
        "output": ["--progress none", "--progress log --sample-tokens 4",
                   "--progress log --commit-dir {tmp} --commit-every 1",
                   "--progress none --ckpt-dir {tmp} --ckpt-every 1 --metrics {tmp}/m.jsonl"],
    },
    "update rules x exchange": {
        "layout": ["--mesh 8x1", "--mesh 2x2x2", "--mesh 8x1 --fsdp", "--mesh 2x2x2 --fsdp",
                   "--mesh 2x2x2 --fsdp --workers node"],
        "update": ["--update sync", "--update delayed:2", "--update delayed-nocomp:1", "--update sparse:2,outer=0.7",
                   "--update async:2,fetch=2,push=2"],
        "allreduce": ["--allreduce ring", "--allreduce psum", "--allreduce butterfly", "--allreduce tree",
                      "--allreduce ps", "--allreduce hierarchical"],
        "compression": ["", "--compression bf16", "--compression topk:0.25", "--compression onebit",
                        "--compression powersgd:2,start=1"],
        "compress-axes": ["", "--compress-axes node", "--compress-axes node --compress-whole"],
        "optimizer": ["--optimizer adamw", "--optimizer sgd", "--optimizer momentum", "--optimizer onebit_adam"],
        "passes": ["", "--backward-passes 2"],
        "dtype": ["--dtype float32", "--dtype bfloat16"],
        "fusion": ["", "--fusion-mb 0"],
    },
}
TINY = "--d-model 32 --n-layers 2 --n-heads 4 --d-ff 64 --seq-len 32 --batch-size 16 --seed 4 --eval-batches 1"


def pairwise(factors: dict[str, list], tries: int = 50, refuses=None) -> list[dict]:
    """Rows (one value per factor) until every pair of values of any two factors appears.
    Greedy: each new row is, of `tries` candidates grown factor by factor (each from another
    first factor), the one covering the most pairs not yet covered; deterministic.
    refuses(row) -> str | None: a row dpjax refuses is passed over for the next best
    candidate that covers a new pair, so a pair is seen refused only where no candidate
    holding it is taken (a refused row is then taken: its pairs are covered by the refusal)."""
    names = list(factors)
    sizes = [len(factors[n]) for n in names]

    def pair(i, vi, j, vj):
        return (i, vi, j, vj) if i < j else (j, vj, i, vi)

    def named(row):
        return {n: factors[n][row[i]] for i, n in enumerate(names)}

    todo = {(i, vi, j, vj) for i, j in itertools.combinations(range(len(names)), 2)
            for vi in range(sizes[i]) for vj in range(sizes[j])}
    rows, verdicts = [], {}
    while todo:
        candidates = []
        for t in range(tries):
            row = {}
            for k in [(t + n) % len(names) for n in range(len(names))]:
                row[k] = max(range(sizes[k]), key=lambda v: (sum(pair(i, vi, k, v) in todo for i, vi in row.items()),
                                                             -((v + t) % sizes[k])))
            gain = sum(pair(i, row[i], j, row[j]) in todo for i, j in itertools.combinations(row, 2))
            candidates.append((-gain, t, row))
        candidates.sort(key=lambda c: c[:2])  # the most new pairs first, then the earliest candidate

        def taken(row):
            key = tuple(sorted(row.items()))
            if key not in verdicts:
                verdicts[key] = refuses(named(row)) if refuses else None
            return verdicts[key] is None

        best = next((row for gain, _, row in candidates if gain < 0 and taken(row)), candidates[0][2])
        rows.append(best)
        todo -= {pair(i, best[i], j, best[j]) for i, j in itertools.combinations(best, 2)}
    return [named(row) for row in rows]


def plan_refusal(row: dict, tmp: str) -> str | None:
    """The one line dpjax refuses a row with when its settings are resolved in this process
    (`dpjax.plan.resolve`: the plan's checks, no compile), or None: what `pairwise` asks to
    prefer rows that train. Refusals made later (data, folders) are not seen here."""
    from dpjax.errors import UserError
    from dpjax.plan import resolve
    from dpjax.train.cli import parse_args

    flags = TINY.split() + " ".join(v for v in row.values() if v).replace("{tmp}", tmp).split()
    try:
        resolve(parse_args(flags))
    except (UserError, SystemExit) as e:
        return str(e) or type(e).__name__
    return None


def ends_well(rc, stderr_lines: list[str]) -> bool:
    """Exit 0, or a user error's one-line refusal (exit 2, one line, no traceback)."""
    return rc == 0 or (rc == 2 and len(stderr_lines) == 1 and "Traceback" not in stderr_lines[0])


def pairs_of(factors: dict):
    """Every pair of values of two factors: (factor, value, factor, value)."""
    for a, b in itertools.combinations(factors, 2):
        yield from ((a, va, b, vb) for va in factors[a] for vb in factors[b])


def refused_only(rows: list[dict], exits: list) -> set:
    """The pairs of values (factor, value, factor, value) that only refused rows hold: pairs
    the sweep saw refused, never trained (a refusal may stand for a combination that works)."""
    def pairs(row):
        return {(a, row[a], b, row[b]) for a, b in itertools.combinations(row, 2)}

    trained = set().union(*(pairs(r) for r, rc in zip(rows, exits) if rc == 0))
    return set().union(*(pairs(r) for r in rows)) - trained


def run(row: dict, steps: int, timeout: float) -> dict:
    """One row as a process: TINY first, so a row's own flags (a layout's --n-layers) win."""
    with tempfile.TemporaryDirectory(prefix="dpjax-sweep-") as tmp:
        own = " ".join(v for v in row.values() if v).replace("{tmp}", tmp).split()
        flags = TINY.split() + own + ["--steps", str(steps)]
        began = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, "-m", "dpjax.train", *flags], check=False,
                               env=_bench.checkout_env(), capture_output=True, text=True, timeout=timeout)
            rc, err = p.returncode, p.stderr.strip().splitlines()
        except subprocess.TimeoutExpired:
            rc, err = "timeout", []
        seconds = time.perf_counter() - began
    said = (err[-1][:160] if err and rc != 0 else "")
    return {"flags": " ".join(v for v in row.values() if v), "exit": rc, "seconds": seconds,
            "ok": ends_well(rc, err), "said": said, "stderr": err}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="training steps per process (default 2)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a process may take (default 300)")
    ap.add_argument("--design", choices=list(DESIGNS), action="append",
                    help="run only this covering design (repeatable; default: every one)")
    ap.add_argument("--jobs", type=int, default=1, help="processes at a time (default 1)")
    ap.add_argument("--cover", choices=["planned", "plain"], default="planned",
                    help="planned: rows the plan refuses are passed over where another row covers the same new "
                         "pairs (each candidate resolved in this process); plain: the cover of the values alone "
                         "(default: planned)")
    ap.add_argument("--smoke", action="store_true", help="two rows of one step: the sweep's machinery")
    args = ap.parse_args(argv)
    bad = total = 0
    if args.cover == "planned" and not args.smoke:
        _bench.simulate(8)
    for name in args.design or list(DESIGNS):
        with tempfile.TemporaryDirectory(prefix="dpjax-sweep-") as tmp:
            planned = args.cover == "planned" and not args.smoke
            rows = pairwise(DESIGNS[name], refuses=(lambda row: plan_refusal(row, tmp)) if planned else None)
        print(f"\n{name}: {len(rows)} processes cover every pair of {len(DESIGNS[name])} options' values"
              + (" (smoke: the first, one step)" if args.smoke else ""))
        if args.smoke:
            rows, args.steps = rows[:1], 1
        print("| options | exit | seconds | refusal or fault |")
        print("|---|---:|---:|---|", flush=True)
        exits = []
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for r in pool.map(lambda row: run(row, args.steps, args.timeout), rows):
                bad += not r["ok"]
                exits.append(r["exit"])
                print(f"| `{r['flags']}` | {r['exit']} | {r['seconds']:.1f} | {r['said']} |", flush=True)
                if not r["ok"]:
                    print("\n".join("    " + line for line in r["stderr"][-30:]), file=sys.stderr, flush=True)
        total += len(rows)
        untrained = refused_only(rows, exits)
        print(f"{len(untrained)} of {sum(1 for _ in pairs_of(DESIGNS[name]))} pairs of values only in rows that did "
              "not train (refused: covered by the refusal alone)")
    print(f"{total - bad} of {total} ended in exit 0 or a one-line refusal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
