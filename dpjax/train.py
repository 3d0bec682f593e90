"""`python -m dpjax.train`: train a byte-level model on a mesh, with data parallelism
over the `data` (and `node`) axes and tensor parallelism over `model`.

    python -m dpjax.train --mesh 2x4 --steps 200 --metrics run.jsonl

Thin by design: it parses flags, builds the pieces from the library (mesh, layout,
data, model, DistributedOptimizer, sharded steps, checkpoints) and runs the loop.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass

from dpjax.mesh import mesh_size, simulate_cpu_devices

# Dispatched-but-unfinished steps allowed in flight: the CPU backend deadlocks with
# ~40+ collective programs dispatched and not awaited, and a few hide dispatch latency.
MAX_IN_FLIGHT = 4


class UsageError(ValueError):
    """Bad input from the command line; printed as one line."""


@dataclass
class TrainConfig:
    mesh: str | None = None
    model: str = "gpt"
    data: str = "stdlib"
    steps: int = 200
    batch_size: int = 32
    seq_len: int = 128
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    optimizer: str = "adamw"
    lr: float = 3e-3
    lr_scaling: str = "none"
    warmup_steps: int = 0
    clip_norm: float = 1.0
    allreduce: str = "ring"
    tp_allreduce: str = "ring"
    fsdp: bool = False
    fusion_mb: float = 64.0
    compression: str = "none"
    backward_passes: int = 1
    update: str = "sync"
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 4
    metrics: str | None = None
    ckpt_dir: str | None = None
    ckpt_every: int = 100
    resume: bool = False
    progress: str = "auto"


def parse_args(argv=None) -> TrainConfig:
    from dpjax.collectives import ALGORITHMS

    p = argparse.ArgumentParser(
        prog="python -m dpjax.train",
        description="Train a byte-level GPT (or MLP) on a device mesh: data parallelism over the data axes "
                    "(gradients averaged by dpjax's explicit collectives in fused buckets) and Megatron-style "
                    "tensor parallelism over the model axis (each device holds 1/n of every large layer). "
                    "On a CPU-only machine the devices the mesh needs are simulated.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--mesh", help="device mesh: '8' or '8x1' (data x model), '2x2x2' (node x data x model), "
                     "'data=2,model=4'; one -1 takes the remaining devices. Default: every device on data")
    a("--model", default="gpt", help="gpt or mlp")
    a("--data", default="stdlib", help="'stdlib' (the Python standard library's source), a text file, "
                                       "a folder of text files, or 'synthetic' (random tokens)")
    a("--steps", type=int, default=200, help="optimizer steps to run (in total, counting resumed ones)")
    a("--batch-size", type=int, default=32, help="global batch in sequences, split over the data axes")
    a("--seq-len", type=int, default=128, help="tokens (bytes) per sequence")
    a("--d-model", type=int, help="model width (default: the model's own)")
    a("--n-layers", type=int, help="transformer layers (gpt)")
    a("--n-heads", type=int, help="attention heads (gpt)")
    a("--optimizer", default="adamw", help="adamw, sgd or momentum")
    a("--lr", type=float, default=3e-3, help="learning rate (before any scaling)")
    a("--lr-scaling", default="none", choices=["none", "linear"],
      help="linear: lr * global batch / 256 (Goyal et al. 2017)")
    a("--warmup-steps", type=int, default=0, help="steps of linear learning-rate warmup")
    a("--clip-norm", type=float, default=1.0, help="clip the averaged gradient to this global norm (0: off)")
    a("--allreduce", default="ring", help=f"gradient allreduce algorithm: {', '.join(ALGORITHMS)}")
    a("--tp-allreduce", default="ring",
      help=f"allreduce over the model axis inside tensor-parallel layers: {', '.join(ALGORITHMS)}")
    a("--fsdp", action="store_true",
      help="fully sharded data parallelism (ZeRO-3): parameters and optimizer state split over the data axes "
           "too, all-gathered just before use, gradients reduce-scattered (with the --allreduce algorithm)")
    a("--fusion-mb", type=float, default=64.0, help="tensor-fusion bucket cap in MiB (0: one allreduce per tensor)")
    a("--compression", default="none", choices=["none", "bf16", "fp16"], help="dtype of gradients on the wire")
    a("--backward-passes", type=int, default=1, help="local gradient accumulation passes per step")
    a("--update", default="sync", help=updates_help())
    a("--seed", type=int, default=0, help="seed for initialisation and data order")
    a("--eval-every", type=int, default=50, help="steps between validation evaluations (0: only at the end)")
    a("--eval-batches", type=int, default=4, help="validation batches per evaluation")
    a("--metrics", help="write one JSON object per step to this file (JSON lines)")
    a("--ckpt-dir", help="folder for checkpoints (orbax)")
    a("--ckpt-every", type=int, default=100, help="steps between checkpoints")
    a("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    a("--progress", default="auto", choices=["auto", "bar", "log", "none"],
      help="progress display: a bar on a terminal, log lines otherwise")
    ns = p.parse_args(argv)
    return TrainConfig(**{k: v for k, v in vars(ns).items()})


def updates_help() -> str:
    from dpjax.updates import HELP

    return HELP


def validate(cfg: TrainConfig) -> None:
    from dpjax.collectives import ALGORITHMS, REDUCE_SCATTER_ALGORITHMS
    from dpjax.models import MODELS

    if cfg.model not in MODELS:
        raise UsageError(f"unknown model {cfg.model!r}; choose one of {', '.join(MODELS)}")
    for flag, alg in (("--allreduce", cfg.allreduce), ("--tp-allreduce", cfg.tp_allreduce)):
        if alg not in ALGORITHMS:
            raise UsageError(f"unknown {flag} algorithm {alg!r}; choose one of {', '.join(ALGORITHMS)}")
    if cfg.tp_allreduce == "hierarchical":
        raise UsageError("--tp-allreduce hierarchical needs two axes; the model axis is one")
    if cfg.fsdp and cfg.allreduce not in REDUCE_SCATTER_ALGORITHMS:
        raise UsageError(f"--fsdp all-gathers and reduce-scatters with the --allreduce algorithm; "
                         f"{cfg.allreduce!r} has none: choose one of {', '.join(REDUCE_SCATTER_ALGORITHMS)}")
    for name in ("steps", "batch_size", "seq_len", "backward_passes", "ckpt_every", "eval_batches"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.eval_every < 0 or cfg.warmup_steps < 0 or cfg.fusion_mb < 0:
        raise UsageError("--eval-every, --warmup-steps and --fusion-mb cannot be negative")
    if cfg.resume and not cfg.ckpt_dir:
        raise UsageError("--resume needs --ckpt-dir")
    from dpjax.updates import parse_update

    if not parse_update(cfg.update).is_sync and (cfg.backward_passes > 1 or cfg.compression != "none" or cfg.fsdp):
        raise UsageError(f"--backward-passes, --compression and --fsdp need --update sync, not {cfg.update!r}")


def setup_devices(cfg: TrainConfig):
    """Simulates the CPU devices the mesh needs (before JAX starts) and builds the mesh."""
    from dpjax import distributed

    distributed.initialize()
    want = mesh_size(cfg.mesh) if cfg.mesh else None
    simulate_cpu_devices(want or 8)
    import jax

    from dpjax.mesh import make_mesh

    devices = jax.devices()
    spec = cfg.mesh or f"{len(devices)}x1"
    if want is not None and want < len(devices) and jax.process_count() == 1:
        devices = devices[:want]  # e.g. --mesh 1x1 on a machine with several GPUs
    return make_mesh(spec, devices)


class Progress:
    """A rich bar on a terminal; otherwise a log line every ~10% of the run."""

    def __init__(self, mode: str, total: int, start: int):
        self.mode = ("bar" if sys.stdout.isatty() else "log") if mode == "auto" else mode
        self.total, self.every = total, max(1, (total - start) // 10)
        self.bar = None
        if self.mode == "bar":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress
            from rich.progress import TextColumn, TimeRemainingColumn

            self.bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("loss {task.fields[loss]:.4f}"),
                                    TextColumn("{task.fields[tps]:,.0f} tok/s"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total, completed=start, loss=float("nan"), tps=0.0)
            self.bar.start()

    def update(self, step: int, loss: float, tps: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step + 1, loss=loss, tps=tps)
        elif self.mode == "log" and ((step + 1) % self.every == 0 or step + 1 == self.total):
            print(f"step {step + 1}/{self.total}  loss {loss:.4f}  {tps:,.0f} tok/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def run(cfg: TrainConfig) -> dict:
    """Trains per `cfg`; returns the summary. Raises UsageError (and other ValueErrors from
    validation) before anything is written when the input is bad."""
    validate(cfg)
    mesh = setup_devices(cfg)
    import jax
    import numpy as np

    from dpjax import step as S
    from dpjax.checkpoint import Checkpointer
    from dpjax.data import make_streams
    from dpjax.mesh import data_axes
    from dpjax.models import get_model
    from dpjax import updates as U
    from dpjax.sharding import make_layout

    dp = math.prod(mesh.shape[a] for a in data_axes(mesh))
    if cfg.batch_size % dp:
        raise UsageError(f"--batch-size {cfg.batch_size} is not divisible by the {dp} data-parallel ranks of "
                         f"mesh {dict(mesh.shape)}; use a multiple of {dp}")
    if cfg.allreduce == "hierarchical" and len(data_axes(mesh)) != 2:
        raise UsageError("--allreduce hierarchical needs a node axis: use a three-axis mesh such as 2x4x1")
    update = U.parse_update(cfg.update)
    model = get_model(cfg.model, seq_len=cfg.seq_len, d_model=cfg.d_model, n_layers=cfg.n_layers,
                      n_heads=cfg.n_heads)
    layout = make_layout(model, mesh, algorithm=cfg.tp_allreduce, fsdp=cfg.fsdp, fsdp_algorithm=cfg.allreduce)
    train_stream, val_stream = make_streams(cfg.data, cfg.seq_len, cfg.seed)
    opt = S.OptimizerConfig(name=cfg.optimizer, lr=cfg.lr, lr_scaling=cfg.lr_scaling,
                            warmup_steps=cfg.warmup_steps, clip_norm=cfg.clip_norm)
    tx = S.distributed_optimizer(opt, layout, cfg.batch_size, algorithm=cfg.allreduce, fusion_mb=cfg.fusion_mb,
                                 compression=None if cfg.compression == "none" else cfg.compression,
                                 backward_passes_per_step=cfg.backward_passes)
    record = {"model": model.describe(), "optimizer": {**asdict(opt), "backward_passes": cfg.backward_passes},
              "data": cfg.data, "seed": cfg.seed, "batch_size": cfg.batch_size}
    if not update.is_sync:  # per-worker state: resumable only by the same rule and worker count
        record["optimizer"].update(update=str(update), workers=dp)

    key = jax.random.key(cfg.seed)
    if update.is_sync:
        params, opt_state = S.init_state(model, tx, layout, key)
    else:  # every worker's copy of the state, on a leading worker axis (dpjax.updates)
        rule = U.make_rule(update, opt.make(cfg.batch_size, layout.specs), S.dp_axis(mesh), seed=cfg.seed,
                           algorithm=cfg.allreduce, fusion_mb=cfg.fusion_mb)
        loss_fn = functools.partial(model.loss, par=layout.parallel())  # tensor-parallel inside each worker
        ustep = U.make_update_step(loss_fn, rule, mesh, param_specs=layout.specs)
        params, opt_state = ustep.init(jax.jit(model.init, out_shardings=layout.shardings())(key))
    # The run's RNG state: nothing in the step draws from it yet (no dropout), but it is
    # saved and restored with the rest so that stochastic steps resume exactly too.
    rng = jax.device_put(jax.random.key_data(jax.random.fold_in(key, 1)), S.replicated(mesh))
    start, cursor = 0, 0
    ckpt = None
    if cfg.ckpt_dir:
        ckpt = Checkpointer(cfg.ckpt_dir)
        latest = ckpt.latest_step()
        if latest is not None and not cfg.resume:
            raise UsageError(f"{cfg.ckpt_dir} already holds checkpoints (latest step {latest}); pass --resume to "
                             "continue, or another --ckpt-dir (nothing was overwritten)")
        if latest is not None:
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                    {"params": params, "opt_state": opt_state, "rng": rng})
            state, saved = ckpt.restore(abstract, expect=record)
            params, opt_state, rng = state["params"], state["opt_state"], state["rng"]
            start, cursor = saved["step"], saved["cursor"]
    if start >= cfg.steps:
        raise UsageError(f"the checkpoint is at step {start}, not before --steps {cfg.steps}; ask for more steps")

    if update.is_sync:
        train_step = S.make_train_step(model, tx, layout)
        eval_step = S.make_eval_step(model, layout)
        params = S.make_broadcast_step(layout)(params)  # Horovod: every rank starts from rank 0's weights
    else:  # eval_step evaluates the workers' consensus (their mean, or the server's copy)
        train_step, eval_step = ustep.train_step, ustep.eval_step
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.backward_passes
    # line-buffered: each step's record is on disk as soon as it is known (tail -f works)
    metrics_file = open(cfg.metrics, "a" if start else "w", buffering=1) if cfg.metrics else None
    is_main = jax.process_index() == 0

    def evaluate():
        losses = [eval_step(params, S.put_batch(val_stream, i * cfg.batch_size, cfg.batch_size, mesh))
                  for i in range(cfg.eval_batches)]
        return float(np.mean([float(x) for x in losses]))

    stop = {"now": False}

    def on_sigint(signum, frame):
        if stop["now"]:
            raise KeyboardInterrupt
        stop["now"] = True

    old_handler = signal.signal(signal.SIGINT, on_sigint)
    progress = Progress(cfg.progress if is_main else "none", cfg.steps, start)
    in_flight: collections.deque = collections.deque()
    last_done, t0 = time.perf_counter(), time.perf_counter()
    last = {"loss": float("nan"), "eval_loss": None, "tokens_per_s": 0.0}
    tps_window: collections.deque = collections.deque(maxlen=20)
    lr_at = opt.schedule(cfg.batch_size)

    def retire():
        nonlocal last_done
        step_i, loss = in_flight.popleft()
        loss = float(loss)  # waits for the step
        now = time.perf_counter()
        dt, last_done = now - last_done, now
        tps_window.append(tokens_per_step / dt)
        last.update(loss=loss, tokens_per_s=float(np.median(tps_window)))
        row = {"step": step_i, "loss": loss, "step_time": dt, "tokens_per_s": tokens_per_step / dt,
               "lr": float(lr_at(step_i))}
        if metrics_file and is_main:
            metrics_file.write(json.dumps(row) + "\n")
        progress.update(step_i, loss, last["tokens_per_s"])

    def record_eval(step_i):
        last["eval_loss"] = evaluate()
        if metrics_file and is_main:
            metrics_file.write(json.dumps({"step": step_i, "eval_loss": last["eval_loss"]}) + "\n")

    def drain():
        while in_flight:
            retire()

    def save(step_done):
        drain()
        ckpt.save(step_done, {"params": params, "opt_state": opt_state, "rng": rng},
                  {**record, "step": step_done, "cursor": cursor})

    try:
        step_i = start
        for step_i in range(start, cfg.steps):
            for _ in range(cfg.backward_passes):
                batch = S.put_batch(train_stream, cursor, cfg.batch_size, mesh)
                params, opt_state, loss = train_step(params, opt_state, batch)
                cursor += cfg.batch_size
            in_flight.append((step_i, loss))
            if len(in_flight) > MAX_IN_FLIGHT:
                retire()
            done = step_i + 1
            if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                drain()
                record_eval(step_i)
            if ckpt and (done % cfg.ckpt_every == 0 or done == cfg.steps or stop["now"]):
                save(done)
            if stop["now"]:
                break
        drain()
        if not stop["now"]:
            record_eval(cfg.steps - 1)
    finally:
        progress.close()
        signal.signal(signal.SIGINT, old_handler)
        if metrics_file:
            metrics_file.close()
        if ckpt:
            ckpt.close()
    elapsed = time.perf_counter() - t0
    return {"steps": step_i + 1, "interrupted": stop["now"], "loss": last["loss"], "eval_loss": last["eval_loss"],
            "tokens_per_s": last["tokens_per_s"], "seconds": elapsed, "mesh": dict(mesh.shape)}


def summary_line(s: dict) -> str:
    ev = "n/a" if s["eval_loss"] is None else f"{s['eval_loss']:.4f}"
    mesh = "x".join(str(v) for v in s["mesh"].values())
    head = "interrupted" if s["interrupted"] else "done"
    return (f"{head}: {s['steps']} steps on mesh {mesh}, train loss {s['loss']:.4f}, eval loss {ev}, "
            f"{s['tokens_per_s']:,.0f} tokens/s, {s['seconds']:.1f} s")


def main(argv=None) -> int:
    cfg = parse_args(argv)
    try:
        summary = run(cfg)
    except ValueError as e:  # UsageError, DataError, CheckpointError and mesh errors: one line
        if os.environ.get("DPJAX_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary_line(summary), flush=True)
    return 130 if summary["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
