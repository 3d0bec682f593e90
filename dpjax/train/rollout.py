"""GRPO's generate-score loop (`--task grpo`): the rollouts the clipped objective trains on.

Every --grpo-updates steps (a generation batch) the `Rollouts` hook, before the step reads its
batch:

    generate  the next --batch-size / G prompts (a seeded order, epoch after epoch), each G times,
              sampled by `dpjax.generate` on the trainer's own parameters as they lie on the mesh
              (the same arrays the step updates: no second engine, no copy of the weights);
              prompts of one token length are sampled together (a row has no padding to mask)
    score     each completion (up to its end-of-turn token) decoded and given to --reward
              (`dpjax.train.reward`), the advantages normalised within each group
              (`dpjax.tasks.grpo.group_advantages`), and the log-probs of the completions'
              tokens under the reference (the starting weights, frozen: --kl-coef > 0; with --lora
              the base, adapters off) and under the sampling policy (with --grpo-updates > 1), by a
              program sharded like the step

and that batch (`dpjax.tasks.grpo`'s rows) is what the next --grpo-updates steps train on.
Every metrics row carries the batch's mean `reward` and the time split: `generate_time`,
`score_time` (both 0 on a step that reuses the batch) and `train_time` (the step's own
step_time); on the timeline the host phases "generate" and "score".

The sampling key of generation batch j is drawn from (--seed, j, the prompt length): the same
seed gives the same completions on every mesh, and a run resumed from a checkpoint at a
multiple of --grpo-updates samples what the uninterrupted run sampled.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from dpjax.data.sft import EpochOrder
from dpjax.train.hooks import Hook
from dpjax.data import prompts as prompt_data
from dpjax.data.tokenizer import HF
from dpjax.generate import Sampling, generate
from dpjax.mesh import data_axes
from dpjax.step import put_batch
from dpjax.tasks.dpo import reference_of
from dpjax.tasks.grpo import group_advantages, token_logps
from dpjax.train.reward import Reward


class RolloutStream:
    """The generation batch under training, as `dpjax.step.put_batch` reads a stream: every step
    of the batch reads the same rows (the cursor is not a position in it)."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.arrays: dict[str, np.ndarray] | None = None  # the batch's rows, set by each generation

    def batch(self, cursor: int, batch_size: int, rows: slice = slice(None)) -> dict:
        assert self.arrays is not None, "a generation fills the batch before a step reads it"
        return {k: v[rows] for k, v in self.arrays.items()}


def streams(cfg, fmt, folder: str) -> tuple:
    """(train stream, validation stream: none, tokenizer, the prompts' Prompts) of --prompts, read
    with `fmt`, the template and tokenizer.json of `folder` (`dpjax.train.streams` makes both)."""
    reward = Reward(cfg.reward)  # a spec that does not import: refused before anything compiles
    prompts = prompt_data.Prompts(fmt, prompt_data.load(cfg.prompts, fmt, cfg.seq_len, cfg.max_completion), reward)
    return RolloutStream(cfg.seq_len), None, HF(fmt.tok, os.path.join(folder, "tokenizer.json")), prompts


def logps_program(plan, base: bool = False):
    """logps(params, tokens_NxT1) -> N x T log-probs of each row's targets, the rows split over
    the data axes as the step splits them; params laid out by the plan's layout (the consensus form).
    base: a LoRA model's base with the adapters off (`dpjax.tasks.dpo.reference_of`), as DPO's."""
    layout, model = plan.layout, plan.model
    par = dataclasses.replace(layout.parallel(), policy=plan.policy)
    rows = data_axes(layout.mesh) or None

    def body(params, tokens):
        if not base:
            return token_logps(model, params, tokens, par)
        reference, frozen, parallel = reference_of(model)
        return token_logps(reference, frozen(params), tokens, parallel(par))

    return jax.jit(jax.shard_map(body, mesh=layout.mesh, in_specs=(layout.specs, P(rows)), out_specs=P(rows),
                                 check_vma=False))


def reference(trainer) -> None:
    """The reference's parameters: a copy of the starting ones (before a checkpoint is restored,
    so that a resumed run's reference is the uninterrupted run's), laid out like the policy; none
    with --kl-coef 0, and none with --lora (the reference is the base with the adapters off, read
    from the policy's own parameters: `Rollouts`). A copy: the step donates the parameters it updates."""
    trainer.ref_params = None
    if trainer.cfg.kl_coef > 0 and reference_of(trainer.model) is None:
        trainer.ref_params = jax.jit(lambda p: jax.tree.map(jnp.copy, p))(trainer.step.consensus(trainer.params))


def _seed(seed: int, batch: int, length: int) -> int:
    return int(np.random.default_rng((seed, batch, length)).integers(2**31))


def sample(model, params, prompts, group: int, max_new: int, temperature: float, seed: tuple[int, int], eos) -> list:
    """The completions (int32 ids, each up to and including its first `eos` id) of each prompt,
    `group` a prompt, prompt after prompt. Rows of one prompt length are sampled in one call."""
    by_length: dict = {}
    for k, p in enumerate(prompts):
        by_length.setdefault(len(p.ids), []).append(k)
    out = [None] * (len(prompts) * group)
    for length, ks in sorted(by_length.items()):
        prompt_BxT = np.repeat(np.stack([prompts[k].ids for k in ks]), group, axis=0)
        new_BxN = generate(model, params, prompt_BxT, max_new, Sampling(temperature, 1.0, _seed(*seed, length)), eos)
        for r, k in enumerate(ks):
            for g in range(group):
                c = new_BxN[r * group + g]
                stop = np.flatnonzero(np.isin(c, eos))
                out[k * group + g] = c[:stop[0] + 1] if len(stop) else c
    return out


def rows(prompts, completions, group: int, seq_len: int, pad_id: int = 0) -> dict:
    """The task's tokens (N x T+1: prompt, completion, padding) and weights (N x T: T / |completion|
    on the targets that are completion tokens) of completions sampled `group` a prompt."""
    N, T = len(completions), seq_len
    tokens_NxT1 = np.full((N, T + 1), pad_id, np.int32)
    weights_NxT = np.zeros((N, T), np.float32)
    for i, c in enumerate(completions):
        p = prompts[i // group].ids
        L, n = len(p), len(c)
        tokens_NxT1[i, :L], tokens_NxT1[i, L:L + n] = p, c
        weights_NxT[i, L - 1:L - 1 + n] = T / n  # target t predicts token t+1: the completion's from L-1
    return {"tokens": tokens_NxT1, "weights": weights_NxT}


class _Tokens:
    def __init__(self, tokens_NxT1):
        self.tokens, self.seq_len = tokens_NxT1, tokens_NxT1.shape[1] - 1

    def batch(self, cursor, batch_size, rows=slice(None)):
        return {"tokens": self.tokens[rows]}


class Rollouts(Hook):
    """Generates and scores a generation batch every --grpo-updates steps (the first in `start`,
    before the metrics file is opened: a reward that fails on it writes nothing), and puts the
    reward and the time split into every step's row."""

    def __init__(self, trainer):
        cfg = trainer.cfg
        self.trainer, self.cfg = trainer, cfg
        self.reward = trainer.chat.reward
        self.prompts = trainer.chat.prompts
        self.per_batch = cfg.batch_size // cfg.group_size
        self.order = EpochOrder(len(self.prompts), cfg.seed)
        fmt = trainer.chat.format
        self.eos = np.asarray([i for i in (fmt.tok.token_to_id(t) for t in fmt.stops) if i is not None], np.int32)
        self.logps = logps_program(trainer.plan)
        # --lora: the reference's log-probs from the base inside the policy's parameters (no copy)
        self.base_logps = logps_program(trainer.plan, base=True) if cfg.kl_coef > 0 and trainer.ref_params is None \
            else None
        self.figures: dict = {}

    def start(self, loop) -> None:
        if self.trainer.start < self.cfg.steps:
            self._roll(loop, self.trainer.start + 1)

    def before(self, loop, step: int) -> None:
        if self.figures.get("step") != step and (step - 1) % self.cfg.grpo_updates == 0:
            loop.drain()  # the rows in flight are written before this batch's time is spent
            self._roll(loop, step)
        fresh = self.figures["step"] == step
        loop.tag(reward=self.figures["reward"], generate_time=self.figures["generate_time"] if fresh else 0.0,
                 score_time=self.figures["score_time"] if fresh else 0.0)

    def step(self, loop, row: dict) -> None:
        row["train_time"] = row["step_time"]

    def _roll(self, loop, step: int) -> None:
        trainer, cfg = self.trainer, self.cfg
        j = (step - 1) // cfg.grpo_updates  # the generation batch
        picked = self.order(np.arange(j * self.per_batch, (j + 1) * self.per_batch))
        prompts = [self.prompts[k] for k in picked]
        params = trainer.step.consensus(trainer.params)  # the workers' agreed parameters, as evaluation reads them
        t0 = time.perf_counter()
        with loop.phase("generate"):
            completions = sample(trainer.model, trainer.layout.unstore(params), prompts, cfg.group_size,
                                 cfg.max_completion, cfg.temperature, (cfg.seed, j), self.eos)
        t1 = time.perf_counter()
        with loop.phase("score"):
            rewards_N = np.asarray([self.reward(prompts[i // cfg.group_size], self._text(c), prompts[
                i // cfg.group_size].where) for i, c in enumerate(completions)], np.float32)
            batch = self._batch(prompts, completions, rewards_N, params)
        t2 = time.perf_counter()
        trainer.train_stream.arrays = batch
        self.figures = {"step": step, "reward": float(rewards_N.mean()), "generate_time": t1 - t0,
                        "score_time": t2 - t1}
        loop.reset_clock()  # generating and scoring are not the step's train_time

    def _text(self, completion) -> str:
        ids = completion[:-1] if len(completion) and completion[-1] in self.eos else completion
        return self.trainer.chat.format.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def _batch(self, prompts, completions, rewards_N, params) -> dict:
        """The task's batch as numpy: rows, advantages, and the reference's and the sampling
        policy's log-probs where the run needs them (`dpjax.tasks.grpo`)."""
        cfg, trainer = self.cfg, self.trainer
        out = rows(prompts, completions, cfg.group_size, cfg.seq_len)
        out["adv"] = np.asarray(group_advantages(jnp.asarray(rewards_N), cfg.group_size), np.float32)
        tokens = put_batch(_Tokens(out["tokens"]), 0, len(completions), trainer.mesh)["tokens"]

        def logps(program, p):
            return np.asarray(multihost_utils.process_allgather(program(p, tokens), tiled=True), np.float32)

        if trainer.ref_params is not None:
            out["ref"] = logps(self.logps, trainer.ref_params)
        elif self.base_logps is not None:
            out["ref"] = logps(self.base_logps, params)
        if cfg.grpo_updates > 1:
            out["old"] = logps(self.logps, params)
        return out
