"""A preference run's data (--data pref:PATH, --task dpo) and its reference's log-probs.

The pairs are read like chat data (`dpjax.train.streams`: the model's template and
tokenizer.json; `dpjax.data.pref`), a held-out set from --eval-data pref:PATH or
--eval-fraction. Before the first step, `reference` computes every pair's reference
log-probs (--ref-logps precompute: the sums over each answer's tokens, by
`dpjax.tasks.dpo.pair_logps`, sharded like the step) with the starting weights, or with
--ref-from's, and stores them in the streams, which feed them in each batch: no second
copy of the model lives beside the policy while training. A resumed run recomputes them
from the same starting weights (before the checkpoint is restored), so it reads what the
uninterrupted run read.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from dpjax.data import chat as chat_data, pref
from dpjax.data.tokenizer import HF
from dpjax.hf import params_of
from dpjax.mesh import data_axes
from dpjax.step import put_batch
from dpjax.tasks import dpo
from dpjax.tasks.dpo import VARIANTS, reference_of, pair_logps

PREF = "pref:"


@dataclasses.dataclass
class Pref:
    """What a run's preference data is; shaped like `streams.Chat` where the end's sample
    reads it (`format`, `held_out[0].where`: a held-out pair's prompt)."""

    format: chat_data.ChatFormat
    counts: pref.Counts  # of --data
    train: list
    held_out: list
    eval_counts: pref.Counts | None = None

    def record(self) -> dict:
        c = self.counts
        out: dict[str, object] = {"rows": c.rows, "pairs": len(self.train), "truncated": c.truncated,
                                  "dropped": c.dropped, "held_out": len(self.held_out)}
        if self.eval_counts is not None:
            out["eval"] = {"rows": self.eval_counts.rows, "dropped": self.eval_counts.dropped}
        return {"pref": out}

    def line(self) -> str:
        r = self.record()["pref"]
        return (f"preference data: {r['pairs']:,} pairs to train on, {r['held_out']:,} held out; of {r['rows']:,} "
                f"rows {r['truncated']:,} truncated, {r['dropped']:,} dropped (an answer past --seq-len)")


def streams(cfg, fmt, folder: str) -> tuple:
    """(train stream, held-out stream, tokenizer, Pref) of --data pref:PATH, read with `fmt`, the
    template and tokenizer.json of `folder` (`dpjax.train.streams` makes both, and its `Data` of these)."""
    def load(spec):
        return pref.load(spec[len(PREF):], fmt, cfg.seq_len, cfg.truncate)

    pairs, counts = load(cfg.data)
    eval_counts = None
    if cfg.eval_data:
        train, (held_out, eval_counts) = pairs, load(cfg.eval_data)
    else:
        train, held_out = chat_data.split(pairs, 0.05 if cfg.eval_fraction is None else cfg.eval_fraction, cfg.seed)
    data = Pref(fmt, counts, train, held_out, eval_counts)
    return (pref.PairStream(train, cfg.seq_len, cfg.seed), pref.PairStream(held_out, cfg.seq_len, cfg.seed),
            HF(fmt.tok, os.path.join(folder, "tokenizer.json")), data)


def logps_program(plan):
    """logps(params, batch) -> B x 2 sums of each pair's answer log-probs (chosen, rejected),
    the global batch split over the data axes like the step's; params laid out by the plan's
    layout (the step's consensus form)."""
    layout, model = plan.layout, plan.model
    par = dataclasses.replace(layout.parallel(), policy=plan.policy)
    rows = data_axes(layout.mesh) or None

    def body(params, batch):  # LoRA: the base with the adapters off (dpjax.tasks.dpo.reference_of)
        if reference_of(model) is not None:
            return dpo.reference_logps(model, params, batch, par)
        return pair_logps(model, params, batch, par)[0]

    return jax.jit(jax.shard_map(body, mesh=layout.mesh, in_specs=(layout.specs, P(rows)), out_specs=P(rows),
                                 check_vma=False))


class _InOrder:
    """A PairStream read in file order (what `put_batch` reads from)."""

    def __init__(self, stream):
        self.stream, self.seq_len = stream, stream.seq_len

    def batch(self, cursor, batch_size, rows=slice(None)):
        return self.stream.ordered(cursor, batch_size, rows)


def reference_logps(plan, params, stream, batch_size: int):
    """Every pair's reference log-probs (N x 2, numpy), `batch_size` pairs a call."""
    program, out = logps_program(plan), []
    for start in range(0, stream.num_examples, batch_size):
        got = program(params, put_batch(_InOrder(stream), start, batch_size, plan.mesh))
        out.append(np.asarray(multihost_utils.process_allgather(got, tiled=True)))
    return np.concatenate(out)[:stream.num_examples]


def reference(trainer) -> None:
    """Sets the streams' reference log-probs (--ref-logps precompute) from the starting
    parameters (`trainer.params`, before a checkpoint is restored) or --ref-from's (with
    LoRA: their base, the adapters off); nothing for a variant without a reference (SimPO)
    or with --ref-logps online (the step computes them)."""
    cfg, plan = trainer.cfg, trainer.plan
    online = cfg.ref_logps == "online"
    if not VARIANTS[cfg.dpo_loss].reference or (online and reference_of(trainer.model) is not None):
        return  # SimPO has none; LoRA online: the step computes ρ from the base (dpjax.tasks.dpo)
    if cfg.ref_from:
        params = plan.policy.store(params_of(cfg.ref_from, trainer.model, trainer.layout))
        what = cfg.ref_from
    else:
        params = trainer.step.consensus(trainer.params)
        what = "the starting weights"
    if online:
        trainer.online_reference = Online(plan, params)
        trainer.say(f"the reference: a frozen copy of {what}, split like the policy; its log-probs computed each step")
        return
    for stream in (trainer.train_stream, trainer.val_stream):
        stream.set_reference(reference_logps(plan, params, stream, cfg.batch_size))
    trainer.say(f"reference log-probs of {trainer.train_stream.num_examples + trainer.val_stream.num_examples:,} "
                f"pairs computed with {what}")


class Online:
    """--ref-logps online without LoRA: a frozen copy of the reference's parameters, laid
    out (FSDP-split) like the policy's, and a batch -> the batch with its pairs' ρ computed
    by that copy (`logps_program`'s computation, the train batch's A micro-batches one after
    another). A resumed run copies the same starting weights again before its restore."""

    def __init__(self, plan, params):
        layout = plan.layout
        # a copy: the step donates the policy's buffers, which consensus may return as they are
        self.params = jax.jit(lambda p: jax.tree.map(jax.numpy.copy, p), out_shardings=layout.shardings())(params)
        par = dataclasses.replace(layout.parallel(), policy=plan.policy)
        rows = data_axes(layout.mesh) or None

        def one(params, batch):
            return pair_logps(plan.model, params, batch, par)[0]

        def passes(params, batch_A):
            return jax.lax.map(lambda b: one(params, b), batch_A)

        def program(body, spec):
            return jax.jit(jax.shard_map(body, mesh=layout.mesh, in_specs=(layout.specs, spec), out_specs=spec,
                                         check_vma=False))

        self.eval_logps, self.train_logps = program(one, P(rows)), program(passes, P(None, rows))

    def __call__(self, batch):
        """`batch` (A x B x ... for a train step, B x ... for evaluation) with its "ref" computed."""
        logps = self.train_logps if batch["tokens"].ndim == 3 else self.eval_logps
        return {**batch, "ref": logps(self.params, batch)}
