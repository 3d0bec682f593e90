"""`python -m dpjax.train`: train a byte-level model on a mesh, with data parallelism
over the data axes (`data`, `node`), tensor parallelism over `model`, and any update
rule between workers.

    python -m dpjax.train --mesh 2x4 --steps 200 --metrics run.jsonl

Thin by design (nanodo's main): `TrainConfig` is the one list of settings (the command
line is generated from it), `Trainer` builds the pieces from the library (mesh,
layout, model, rule, the one step builder, data, checkpoints) and then `run` loops.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from dpjax import distributed
from dpjax.errors import UserError
from dpjax.mesh import mesh_size, simulate_cpu_devices

# Dispatched-but-unfinished steps allowed in flight: the CPU backend deadlocks with
# ~40+ collective programs dispatched and not awaited, and a few hide dispatch latency.
MAX_IN_FLIGHT = 4


class UsageError(UserError):
    """Bad input from the command line; printed as one line."""


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    """Every setting of a run. The command line is generated from these fields (a field
    `batch_size` is the flag `--batch-size`); model options (`--d-model`, ...) come from
    the models' own configs into `model_options`."""

    mesh: str | None = _opt(None, "device mesh: '8' or '8x1' (data x model), '2x2x2' (node x data x model), "
                                  "'data=2,model=4'; one -1 takes the remaining devices. Default: every device "
                                  "on data")
    model: str = _opt("gpt", "the model: gpt or mlp")
    data: str = _opt("stdlib", "'stdlib' (the Python standard library's source), a text file, a folder of text "
                               "files, or 'synthetic' (random tokens)")
    steps: int = _opt(200, "optimizer steps to run (in total, counting resumed ones)")
    batch_size: int = _opt(32, "global batch in sequences per backward pass, split over the data axes")
    seq_len: int = _opt(128, "tokens (bytes) per sequence")
    optimizer: str = _opt("adamw", "adamw, sgd or momentum (Nesterov, 0.9)")
    lr: float = _opt(3e-3, "learning rate (before any scaling)")
    lr_scaling: str = _opt("none", "linear: lr * global batch / 256 (Goyal et al. 2017)", choices=("none", "linear"))
    warmup_steps: int = _opt(0, "steps of linear learning-rate warmup")
    weight_decay: float = _opt(0.0, "AdamW's decoupled weight decay")
    clip_norm: float = _opt(1.0, "clip each worker's gradient to this global norm (0: off)")
    update: str = _opt("sync", "")  # help: dpjax.updates.HELP
    workers: str | None = _opt(None, "the data axes the update rule's workers span, e.g. 'node' (one worker per "
                                     "node: synchronous data parallelism inside it, the rule between nodes). "
                                     "Default: every data axis for delayed/sparse/async (each rank a worker), "
                                     "none for sync. With --fsdp the parameters are split over the other data "
                                     "axes: '--workers node --fsdp' with sync is hybrid sharding (HSDP)")
    link: list | None = _opt(None, "emulate a slow link on a mesh axis, e.g. 'node=183ms,23mbit' (repeatable): every "
                                   "collective crossing that axis waits for its alpha-beta time; values are "
                                   "unchanged, only time", action="append")
    allreduce: str = _opt("ring", "")  # help: the algorithms, or auto
    tp_allreduce: str = _opt("ring", "")
    fsdp: bool = _opt(False, "fully sharded data parallelism (ZeRO-3) inside each worker: parameters and "
                             "optimizer state split over the data axes too, all-gathered just before use, "
                             "gradients reduce-scattered (with the --allreduce algorithm)")
    fusion_mb: float | str = _opt(64.0, "tensor-fusion bucket cap in MiB (0: one allreduce per tensor); 'auto': "
                                        "timed on the first steps like --allreduce auto", type="mib")
    compression: str = _opt("none", "dtype of gradients (and of the rule's exchanges) on the wire",
                            choices=("none", "bf16", "fp16"))
    backward_passes: int = _opt(1, "micro-batches per step: gradients accumulated over this many backward "
                                   "passes, exchanged once")
    microbatches: int | None = _opt(None, "with a stage axis: micro-batches each data-parallel replica's batch is "
                                          "cut into, to flow through the pipeline's stages. Default: one per stage")
    schedule: str | None = _opt(None, "with a stage axis: the pipeline schedule (naive: one stage at a time; "
                                      "gpipe: all forwards, then all backwards; 1f1b: one forward, one backward, "
                                      "memory bounded by the stages; interleaved: 1f1b over --virtual-stages "
                                      "chunks per stage). Default: 1f1b",
                                choices=("naive", "gpipe", "1f1b", "interleaved"))
    virtual_stages: int | None = _opt(None, "with --schedule interleaved: chunks of layers per stage, visited "
                                            "round robin (bubble (S-1)/(V*M+S-1)). Default: 2")
    seed: int = _opt(0, "seed for initialisation, data order and async's staleness")
    eval_every: int = _opt(50, "steps between validation evaluations (0: only at the end)")
    eval_batches: int = _opt(4, "validation batches per evaluation")
    metrics: str | None = _opt(None, "write one JSON object per step to this file (JSON lines)")
    ckpt_dir: str | None = _opt(None, "folder for checkpoints (orbax)")
    ckpt_every: int = _opt(100, "steps between checkpoints")
    resume: bool = _opt(False, "continue from the latest checkpoint in --ckpt-dir")
    progress: str = _opt("auto", "progress display: a bar on a terminal, log lines otherwise",
                         choices=("auto", "bar", "log", "none"))
    # Timeline and autotune (dpjax.timeline, dpjax.autotune)
    timeline: str | None = _opt(None, "write a Chrome trace / Perfetto timeline (a track per device: phases, every "
                                      "collective and ring step, every op) of --timeline-steps profiled steps to "
                                      "this file (.json or .json.gz); summarise it with python -m dpjax.timeline "
                                      "FILE. Only those steps are profiled")
    timeline_steps: int = _opt(3, "steps --timeline profiles: the ones after the first step (which compiles) and "
                                  "after any autotune")
    autotune_samples: int = _opt(3, "with --allreduce auto or --fusion-mb auto: timed steps per candidate in each "
                                    "round of the search (successive halving; the slower half goes each round)")
    model_options: dict = field(default_factory=dict)  # from --d-model etc.: {option: value}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    from dpjax.collectives import ALGORITHMS
    from dpjax.models import model_options
    from dpjax.updates import HELP

    late = {"update": HELP, "allreduce": f"gradient allreduce algorithm: {', '.join(ALGORITHMS)}; or auto: each "
                                         "is timed on the first steps of the run and the fastest kept (recorded in "
                                         "the metrics and the checkpoint; a resumed run keeps it)",
            "tp_allreduce": f"allreduce over the model axis inside tensor-parallel layers: {', '.join(ALGORITHMS)}"}
    p = argparse.ArgumentParser(
        prog="python -m dpjax.train",
        description="Train a byte-level GPT (or MLP) on a device mesh: data parallelism over the data axes "
                    "(gradients averaged by dpjax's explicit collectives in fused buckets), Megatron-style "
                    "tensor parallelism over the model axis (each device holds 1/n of every large layer), and an "
                    "update rule between workers (sync, delayed, sparse/local SGD/DiLoCo, async). On a CPU-only "
                    "machine the devices the mesh needs are simulated.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        if f.name == "model_options":
            continue
        help_ = late.get(f.name) or f.metadata["help"]
        if f.type in ("bool", bool):
            p.add_argument(_flag(f.name), action="store_true", help=help_)
            continue
        if f.metadata.get("action") == "append":
            p.add_argument(_flag(f.name), action="append", default=f.default, help=help_, metavar="AXIS=LAT,BW")
            continue
        kind = {"int": int, "int | None": int, "float": float, "mib": _mib}.get(
            f.metadata.get("type") or str(f.type), str)
        p.add_argument(_flag(f.name), type=kind, default=f.default, help=help_,
                       choices=f.metadata.get("choices"))
    g = p.add_argument_group("model options (each belongs to one model; an option the chosen --model does "
                             "not have is an error)")
    for model, opts in model_options().items():
        for name, default in opts.items():
            g.add_argument(_flag(name), type=int, default=argparse.SUPPRESS, dest=f"model_{name}", metavar="N",
                           help=f"{model}: {MODEL_OPTION_HELP.get(name, name)} (default: {default})")
    return p


def _mib(text: str):
    """--fusion-mb: MiB, or 'auto'."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB or auto, got {text!r}") from None


MODEL_OPTION_HELP = {"d_model": "model width", "n_layers": "transformer blocks", "n_heads": "attention heads",
                     "d_ff": "MLP width", "context": "bytes of context each position sees",
                     "d_embed": "byte embedding width", "d_hidden": "hidden units"}


def parse_args(argv=None) -> TrainConfig:
    ns = vars(build_parser().parse_args(argv))
    opts = {k[len("model_"):]: ns.pop(k) for k in list(ns) if k.startswith("model_")}
    return TrainConfig(**ns, model_options=opts)


def validate(cfg: TrainConfig) -> None:
    """Checks that need no devices; the rest (mesh, layout) is checked as it is built."""
    from dpjax.collectives import ALGORITHMS, REDUCE_SCATTER_ALGORITHMS
    from dpjax.models import MODELS, model_options
    from dpjax.optim import OPTIMIZERS
    from dpjax.updates import parse_update

    if cfg.model not in MODELS:
        raise UsageError(f"unknown model {cfg.model!r}; choose one of {', '.join(MODELS)}")
    wrong = [o for o in cfg.model_options if o not in model_options()[cfg.model]]
    if wrong:
        has = ", ".join(_flag(o) for o in model_options()[cfg.model])
        raise UsageError(f"{', '.join(_flag(o) for o in wrong)} does not apply to --model {cfg.model} "
                         f"(its options: {has})")
    if cfg.optimizer not in OPTIMIZERS:
        raise UsageError(f"unknown --optimizer {cfg.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    for flag, alg in (("--allreduce", cfg.allreduce), ("--tp-allreduce", cfg.tp_allreduce)):
        if alg not in ALGORITHMS and (flag, alg) != ("--allreduce", "auto"):
            raise UsageError(f"unknown {flag} algorithm {alg!r}; choose one of {', '.join(ALGORITHMS)}")
    if cfg.tp_allreduce == "hierarchical":
        raise UsageError("--tp-allreduce hierarchical needs two axes; the model axis is one")
    if cfg.fsdp and cfg.allreduce not in (*REDUCE_SCATTER_ALGORITHMS, "auto"):
        raise UsageError(f"--fsdp all-gathers and reduce-scatters with the --allreduce algorithm; "
                         f"{cfg.allreduce!r} has none: choose one of {', '.join(REDUCE_SCATTER_ALGORITHMS)}")
    for name in ("steps", "batch_size", "seq_len", "backward_passes", "ckpt_every", "eval_batches", "timeline_steps",
                 "autotune_samples"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"{_flag(name)} must be at least 1, got {getattr(cfg, name)}")
    if not isinstance(cfg.fusion_mb, (int, float)) and cfg.fusion_mb != "auto":
        raise UsageError(f"--fusion-mb takes MiB or auto, got {cfg.fusion_mb!r}")
    if cfg.eval_every < 0 or cfg.warmup_steps < 0 or cfg.weight_decay < 0 or (
            cfg.fusion_mb != "auto" and cfg.fusion_mb < 0):
        raise UsageError("--eval-every, --warmup-steps, --fusion-mb and --weight-decay cannot be negative")
    if cfg.resume and not cfg.ckpt_dir:
        raise UsageError("--resume needs --ckpt-dir")
    for name in ("microbatches", "virtual_stages"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise UsageError(f"{_flag(name)} must be at least 1, got {getattr(cfg, name)}")
    if cfg.virtual_stages is not None and cfg.schedule != "interleaved":
        raise UsageError(f"--virtual-stages applies to --schedule interleaved, not {cfg.schedule or '1f1b'}")
    parse_update(cfg.update)


def start_setting(cfg: TrainConfig):
    """The allreduce and fusion cap a run starts with: the flags', or for `auto` the
    defaults (the autotune's baseline)."""
    from dpjax.autotune import Setting

    return Setting("ring" if cfg.allreduce == "auto" else cfg.allreduce,
                   64.0 if cfg.fusion_mb == "auto" else float(cfg.fusion_mb))


def setup_devices(cfg: TrainConfig):
    """Starts jax.distributed if launched as one of several processes, simulates the CPU
    devices this process contributes to the mesh (before JAX starts), builds the mesh."""
    distributed.initialize()
    want, nproc = (mesh_size(cfg.mesh) if cfg.mesh else None), distributed.launched_processes()
    if want is not None and want % nproc:
        raise UsageError(f"--mesh {cfg.mesh} has {want} devices, which {nproc} processes cannot share equally")
    simulate_cpu_devices(want // nproc if want else 8)
    import jax

    from dpjax.mesh import make_mesh

    devices = jax.devices()
    spec = cfg.mesh or f"{len(devices)}x1"
    if want is not None and want < len(devices) and jax.process_count() == 1:
        devices = devices[:want]  # e.g. --mesh 1x1 on a machine with several GPUs
    return make_mesh(spec, devices)


def pipeline_config(cfg: TrainConfig, mesh):
    """The `dpjax.pipeline.Pipeline` the flags ask for on a mesh with a stage axis (None
    without one); pipeline flags on a mesh without a stage axis are a UsageError."""
    from dpjax.mesh import STAGE
    from dpjax.pipeline import Pipeline

    given = [_flag(n) for n in ("schedule", "microbatches", "virtual_stages") if getattr(cfg, n) is not None]
    if STAGE not in mesh.axis_names:
        if given:
            raise UsageError(f"{', '.join(given)} needs a stage axis: name one in --mesh, e.g. "
                             f"--mesh stage=2,data={max(1, mesh.size // 2)}")
        return None
    schedule = cfg.schedule or "1f1b"
    virtual = cfg.virtual_stages or (2 if schedule == "interleaved" else 1)
    return Pipeline(schedule, cfg.microbatches, virtual)


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


class Trainer:
    """Builds everything a run needs from a `TrainConfig`; `run()` then loops. Raises a
    UserError before anything is written when the input is bad."""

    def __init__(self, cfg: TrainConfig):
        validate(cfg)
        self.cfg = cfg
        self.mesh = mesh = setup_devices(cfg)
        import jax

        from dpjax import step as S
        from dpjax.data import make_streams
        from dpjax.links import parse_link
        from dpjax.mesh import data_axes, dp_size, parse_axes
        from dpjax.models import get_model
        from dpjax.optim import OptimizerConfig
        from dpjax.sharding import make_layout
        from dpjax.updates import parse_update

        dp = dp_size(mesh)
        if cfg.batch_size % dp:
            raise UsageError(f"--batch-size {cfg.batch_size} is not divisible by the {dp} data-parallel ranks of "
                             f"mesh {dict(mesh.shape)}; use a multiple of {dp}")
        self.update = update = parse_update(cfg.update)
        per_worker = not update.is_sync  # the rule keeps every worker's copy
        workers = (S.default_workers(mesh, per_worker) if cfg.workers is None
                   else parse_axes(cfg.workers, mesh, "--workers"))
        if cfg.allreduce == "hierarchical" and len(data_axes(mesh)) < 2:
            raise UsageError("--allreduce hierarchical needs a node axis: use a three-axis mesh such as 2x4x1")
        self.model = model = get_model(cfg.model, seq_len=cfg.seq_len, **cfg.model_options)
        self.setting = start_setting(cfg)  # the allreduce and fusion cap (an autotune may change them)
        self.layout = layout = make_layout(model, mesh, algorithm=cfg.tp_allreduce, fsdp=cfg.fsdp,
                                           fsdp_algorithm=self.setting.algorithm, workers=workers,
                                           pipeline=pipeline_config(cfg, mesh))
        self.train_stream, self.val_stream = make_streams(cfg.data, cfg.seq_len, cfg.seed)
        self.opt = opt = OptimizerConfig(name=cfg.optimizer, lr=cfg.lr, lr_scaling=cfg.lr_scaling,
                                         warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay,
                                         clip_norm=cfg.clip_norm)
        links = tuple(parse_link(text) for text in cfg.link or ())
        for link in links:
            if link.axis not in mesh.axis_names:
                raise UsageError(f"--link {link}: mesh {dict(mesh.shape)} has no axis {link.axis!r}")
        self._for_layout = lambda lay, exchange: S.for_model(  # noqa: E731
            model, lay, global_batch=cfg.batch_size, update=update, opt=opt, passes=cfg.backward_passes,
            exchange=exchange, links=links, seed=cfg.seed)
        self._steps, self._sent = {}, {}
        self.step = self.step_for(self.setting)
        # What must match for a checkpoint to resume: per-worker state needs the same
        # rule and the same number of workers (the mesh may change).
        self.record = {"model": model.describe(), "data": cfg.data, "seed": cfg.seed, "batch_size": cfg.batch_size,
                       "optimizer": {**dataclasses.asdict(opt), "backward_passes": cfg.backward_passes,
                                     "update": str(update)}}
        if self.step.rule.per_worker:
            self.record["optimizer"]["workers"] = layout.num_workers
        if layout.pipeline is not None and layout.pipeline.virtual_stages > 1:
            # the layer stack is stored V x L/V: it resumes on any stage count, with the same V
            self.record["model"]["virtual_stages"] = layout.pipeline.virtual_stages

        key = jax.random.key(cfg.seed)
        self.params, self.opt_state = self.step.init(S.init_params(model, layout, key))
        # The run's RNG state: nothing in the step draws from it yet (no dropout), but it is
        # saved and restored with the rest so that stochastic steps resume exactly too.
        self.rng = jax.device_put(jax.random.key_data(jax.random.fold_in(key, 1)), S.replicated(mesh))
        self.start, self.cursor, self.ckpt, self.resumed = 0, 0, None, {}
        if cfg.ckpt_dir:
            self._restore()
        self.tuner = self._plan_autotune()
        self.recorder = None
        if cfg.timeline:
            from dpjax.timeline import Recorder

            self.recorder = Recorder()
        if self.start >= cfg.steps:
            raise UsageError(f"the checkpoint is at step {self.start}, not before --steps {cfg.steps}; "
                             "ask for more steps")

    def _state(self) -> dict:
        return {"params": self.params, "opt_state": self.opt_state, "rng": self.rng}

    def _restore(self) -> None:
        import jax

        from dpjax.checkpoint import Checkpointer

        self.ckpt = Checkpointer(self.cfg.ckpt_dir)
        latest = self.ckpt.latest_step()
        if latest is not None and not self.cfg.resume:
            raise UsageError(f"{self.cfg.ckpt_dir} already holds checkpoints (latest step {latest}); pass --resume "
                             "to continue, or another --ckpt-dir (nothing was overwritten)")
        if latest is None:
            return
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self._state())
        state, saved = self.ckpt.restore(abstract, expect=self.record)
        self.params, self.opt_state, self.rng = state["params"], state["opt_state"], state["rng"]
        self.start, self.cursor, self.resumed = saved["step"], saved["cursor"], saved

    # --- the exchange setting and its autotune (dpjax.autotune) ---

    def step_for(self, setting):
        """The steps with this allreduce algorithm and fusion cap, built once each."""
        if setting not in self._steps:
            from dpjax import step as S
            from dpjax.sharding import make_layout

            cfg = self.cfg
            from dpjax.replicas import check_always, checked

            layout = make_layout(self.model, self.mesh, algorithm=cfg.tp_allreduce, fsdp=cfg.fsdp,
                                 fsdp_algorithm=setting.algorithm, workers=self.layout.workers,
                                 pipeline=self.layout.pipeline)
            wire = None if cfg.compression == "none" else cfg.compression
            step = self._for_layout(layout, S.Exchange(setting.algorithm, setting.fusion_mb, wire))
            if check_always():  # DPJAX_CHECK=1: every step's replicated values are checked (dpjax.replicas)
                step = dataclasses.replace(step, train=checked(step.train, ("params", "opt_state", "loss"),
                                                               "dpjax.train step"))
            self._steps[setting] = step
        return self._steps[setting]

    def _plan_autotune(self):
        """The search `--allreduce auto` / `--fusion-mb auto` ask for (None if neither, or
        if the checkpoint resumed recorded a choice for them: that choice is kept)."""
        import jax

        from dpjax import autotune
        from dpjax.collectives import ALGORITHMS, REDUCE_SCATTER_ALGORITHMS
        from dpjax.mesh import data_axes

        cfg = self.cfg
        knobs = [k for k, v in (("allreduce", cfg.allreduce), ("fusion_mb", cfg.fusion_mb)) if v == "auto"]
        kept = self.resumed.get("autotune")
        if not knobs:
            return None
        if kept and set(knobs) <= set(kept["tuned"]):
            self.setting = autotune.Setting(kept["allreduce"], kept["fusion_mb"])
            self.step, self.record["autotune"] = self.step_for(self.setting), kept
            self._say(f"autotune: keeping the checkpoint's choice --allreduce {self.setting.algorithm} "
                      f"--fusion-mb {self.setting.fusion_mb:g}")
            return None
        algorithms = None
        if "allreduce" in knobs:
            algorithms = [a for a in (REDUCE_SCATTER_ALGORITHMS if cfg.fsdp else ALGORITHMS)
                          if a != "hierarchical" or len(data_axes(self.mesh)) >= 2]
        caps = None
        if "fusion_mb" in knobs:  # on the shapes each device's gradients have (its shards)
            local = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(sh.shard_shape(x.shape), x.dtype),
                                 jax.eval_shape(self.model.init, jax.random.key(0)), self.layout.shardings())
            caps = autotune.fusion_caps(local, (self.setting.fusion_mb, *autotune.CAPS))
        tuner = autotune.Tuner(self.setting, algorithms, caps and (lambda alg: caps), per_round=cfg.autotune_samples)
        need = tuner.budget
        if self.start + need > cfg.steps:
            raise UsageError(f"the autotune needs up to {need} steps from step {self.start}, more than --steps "
                             f"{cfg.steps}; ask for more steps or fewer --autotune-samples")
        return tuner

    def _tuned(self, write, step_i: int) -> None:
        """The search is over: its choice runs from now on, in the metrics and the checkpoint."""
        rec = self.tuner.record()
        self.setting = self.tuner.choice
        self.step, self.tuner, self.record["autotune"] = self.step_for(self.setting), None, rec
        write({"step": step_i, "autotune": rec})
        how = "; ".join(f"{st['knob']}: {st['winner']} won" + (
            "" if st["winner"] == st["from"] else f", {st['winner_vs_from']:.3f}x {st['from']}'s speed"
            + ("" if st["choice"] == st["winner"] else f", under {rec['min_gain']}x: kept {st['from']}"))
            for st in rec["stages"])
        self._say(f"autotune: --allreduce {self.setting.algorithm} --fusion-mb {self.setting.fusion_mb:g}, "
                  f"{rec['gain']:.3f}x the speed of {rec['start']} ({how}; {rec['steps']} steps)")

    def _comm_bytes(self, step, args) -> int:
        """What the busiest device sends per step, read from the compiled step
        (`cost.hlo_comm`; JAX's cached executable, so no compile)."""
        if id(step) not in self._sent:
            from dpjax.collectives.cost import hlo_comm
            from dpjax.timeline import compiled_text

            self._sent[id(step)] = hlo_comm(compiled_text(step.train, *args)).max_bytes
        return self._sent[id(step)]

    def _write_timeline(self, args, write, steps) -> None:
        """The profiled steps' timeline to --timeline; their comm_fraction to the metrics."""
        import jax

        from dpjax.timeline_summary import summarize

        rec, path = self.recorder, self.cfg.timeline
        rec.stop()
        if jax.process_count() > 1:  # each process profiles its own devices
            path = os.path.join(os.path.dirname(path), f"rank{jax.process_index()}-{os.path.basename(path)}")
        rec.program(self.step.train, *args)
        summary = summarize(rec.write(path))
        for row in summary.steps:
            write({"step": row["step"], "comm_fraction": round(row["comm_fraction"], 4)})
        share = sum(r["comm_fraction"] for r in summary.steps) / len(summary.steps)
        self._say(f"timeline: steps {steps.start}-{steps[-1]} in {path}, communication {100 * share:.0f}% of a step "
                  f"(python -m dpjax.timeline {path})")

    def _say(self, line: str) -> None:
        import jax

        if jax.process_index() == 0 and self.cfg.progress != "none":
            print(line, flush=True)

    def batch(self):
        from dpjax.step import put_batch

        b = put_batch(self.train_stream, self.cursor, self.cfg.batch_size, self.mesh, passes=self.cfg.backward_passes)
        self.cursor += self.cfg.batch_size * self.cfg.backward_passes
        return b

    def evaluate(self) -> float:
        import numpy as np

        from dpjax.step import put_batch

        cfg = self.cfg
        losses = [self.step.evaluate(self.params, put_batch(self.val_stream, i * cfg.batch_size, cfg.batch_size,
                                                            self.mesh))
                  for i in range(cfg.eval_batches)]
        return float(np.mean([float(x) for x in losses]))

    def save(self, step_done: int) -> None:
        self.ckpt.save(step_done, self._state(), {**self.record, "step": step_done, "cursor": self.cursor})

    def run(self) -> dict:
        import jax
        import numpy as np

        cfg, is_main = self.cfg, jax.process_index() == 0
        tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.backward_passes
        # line-buffered: each step's record is on disk as soon as it is known (tail -f works)
        metrics = open(cfg.metrics, "a" if self.start else "w", buffering=1) if cfg.metrics and is_main else None
        stop = {"now": False}

        def on_sigint(signum, frame):
            if stop["now"]:
                raise KeyboardInterrupt
            stop["now"] = True

        old_handler = signal.signal(signal.SIGINT, on_sigint)
        progress = Progress(cfg.progress if is_main else "none", cfg.steps, self.start)
        in_flight: collections.deque = collections.deque()
        last_done = t0 = time.perf_counter()
        last = {"loss": float("nan"), "eval_loss": None, "tokens_per_s": 0.0}
        tps_window: collections.deque = collections.deque(maxlen=20)
        lr_at = self.opt.schedule(cfg.batch_size * cfg.backward_passes)
        # --timeline: the steps profiled, fixed at the first step of the final setting;
        # host phases are annotations that cost nothing outside the profile
        rec, window = self.recorder, None
        phase = rec.phase if rec is not None else (lambda _: contextlib.nullcontext())

        def write(row):
            if metrics:
                metrics.write(json.dumps(row) + "\n")

        def retire():
            nonlocal last_done
            step_i, loss, extra = in_flight.popleft()
            with phase("host_wait"):
                loss = float(loss)  # waits for the step
            now = time.perf_counter()
            dt, last_done = now - last_done, now
            tps_window.append(tokens_per_step / dt)
            last.update(loss=loss, tokens_per_s=float(np.median(tps_window)))
            write({"step": step_i, "loss": loss, "step_time": dt, "tokens_per_s": tokens_per_step / dt,
                   "lr": float(lr_at(step_i)), **extra})
            progress.update(step_i, loss, last["tokens_per_s"])

        def drain():
            while in_flight:
                retire()

        def record_eval(step_i):
            last["eval_loss"] = self.evaluate()
            write({"step": step_i, "eval_loss": last["eval_loss"]})

        step_i = self.start
        try:
            for step_i in range(self.start, cfg.steps):
                trial = self.tuner.ask() if self.tuner is not None else None  # (setting, timed) while tuning
                if self.tuner is not None and trial is None:  # nothing left to compare (one candidate)
                    self._tuned(write, step_i)
                step = self.step if trial is None else self.step_for(trial[0])
                if rec is not None and window is None and trial is None:
                    window = range(step_i + 1, min(cfg.steps, step_i + 1 + cfg.timeline_steps))
                profiled = window is not None and step_i in window
                if profiled and step_i == window.start:
                    drain()
                    jax.block_until_ready((self.params, self.opt_state))  # no earlier step's tail in the trace
                    rec.start()
                host = contextlib.ExitStack()
                if profiled:
                    host.enter_context(rec.step(step_i))
                with phase("data"):
                    batch = self.batch()
                args, began = (self.params, self.opt_state, batch), time.perf_counter()
                with phase("dispatch"):
                    self.params, self.opt_state, loss = step.train(*args)
                extra = {"trial": str(trial[0])} if trial is not None else {}
                if metrics:
                    extra["comm_bytes"] = self._comm_bytes(step, args)
                in_flight.append((step_i, loss, extra))
                if trial is not None or profiled:  # autotuned and profiled steps run alone, to their end
                    retire()
                    with phase("host_wait"):
                        jax.block_until_ready((self.params, self.opt_state))
                elif len(in_flight) > MAX_IN_FLIGHT:
                    retire()
                if trial is not None:
                    self.tuner.tell(trial[0], time.perf_counter() - began, trial[1])
                    if self.tuner.done:
                        self._tuned(write, step_i)
                done = step_i + 1
                if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                    drain()
                    with phase("eval"):
                        record_eval(step_i)
                    last_done = time.perf_counter()  # evaluating is not the next step's time
                if self.ckpt and (done % cfg.ckpt_every == 0 or done == cfg.steps or stop["now"]):
                    drain()
                    with phase("checkpoint"):
                        self.save(done)
                    last_done = time.perf_counter()  # nor is saving
                host.close()
                if profiled and step_i == window[-1]:
                    self._write_timeline(args, write, window)
                    last_done = time.perf_counter()  # reading the trace is not the next step's time
                if stop["now"]:
                    break
            drain()
            if not stop["now"]:
                record_eval(cfg.steps - 1)
        finally:
            if rec is not None and rec.active:
                rec.stop()  # interrupted inside the profiled steps
            progress.close()
            signal.signal(signal.SIGINT, old_handler)
            if metrics:
                metrics.close()
            if self.ckpt:
                self.ckpt.close()
        return {"steps": step_i + 1, "interrupted": stop["now"], "loss": last["loss"],
                "eval_loss": last["eval_loss"], "tokens_per_s": last["tokens_per_s"],
                "seconds": time.perf_counter() - t0, "mesh": dict(self.mesh.shape)}


def run(cfg: TrainConfig) -> dict:
    """Trains per `cfg`; returns the summary."""
    return Trainer(cfg).run()


def summary_line(s: dict) -> str:
    ev = "n/a" if s["eval_loss"] is None else f"{s['eval_loss']:.4f}"
    positional = tuple(s["mesh"]) in (("data", "model"), ("node", "data", "model"))
    mesh = ("x" if positional else ",").join(str(v) if positional else f"{k}={v}" for k, v in s["mesh"].items())
    head = "interrupted" if s["interrupted"] else "done"
    return (f"{head}: {s['steps']} steps on mesh {mesh}, train loss {s['loss']:.4f}, eval loss {ev}, "
            f"{s['tokens_per_s']:,.0f} tokens/s, {s['seconds']:.1f} s")


def main(argv=None) -> int:
    cfg = parse_args(argv)
    try:
        summary = run(cfg)
    except UserError as e:  # usage, data, checkpoint, mesh, model options: one line
        if os.environ.get("DPJAX_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary_line(summary), flush=True)
    return 130 if summary["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
