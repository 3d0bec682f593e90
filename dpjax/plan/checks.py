"""The plan's checks that need no devices (`dpjax.plan.check`, run before JAX starts),
and the device count a run fits. Part of `dpjax.plan`: the one place settings are
checked; nothing else imports this module directly."""

from __future__ import annotations

import dataclasses
import math
import os

from dpjax import compression
from dpjax.compression import Exchange, Form
from dpjax.collectives import ALGORITHMS, ALL_TO_ALL_ALGORITHMS, REDUCE_SCATTER_ALGORITHMS
from dpjax.collectives.registry import nested
from dpjax.compute.context import CONTEXT_ATTENTIONS
from dpjax.compute.policy import ATTENTIONS, DTYPES, PARAM_DTYPES, REMATS
from dpjax.data.tokenizer import vocab_of
from dpjax.distributed import COLLECTIVES, transport
from dpjax.errors import UserError
from dpjax.hf import model_of
from dpjax.models import MODELS, model_options, presets
from dpjax.optim import LR_SCALINGS, LR_SCHEDULES, OPTIMIZERS
from dpjax.pipeline import SCHEDULES
from dpjax.plan.task import CHAT, PREF, check_chat
from dpjax.settings import Settings
from dpjax.updates import parse_update
from dpjax.updates.onebit_adam import default_compression


class UsageError(UserError):
    """Settings that do not make sense; printed as one line."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_AT_LEAST_1 = ("steps", "batch_size", "seq_len", "backward_passes", "ckpt_every", "eval_batches", "timeline_steps",
               "autotune_samples", "pack_window")
_NOT_NEGATIVE = ("eval_every", "warmup_steps", "weight_decay", "clip_norm", "lr", "min_lr")


def settled(s: Settings) -> Settings:
    """`s` with what it leaves to dpjax filled in: `--optimizer onebit_adam` without a
    --compression runs 1-bit Adam's default for its --steps
    (`dpjax.updates.onebit_adam.default_compression`). `check` and `resolve` see these."""
    if s.task is None:  # chat data trains on its answers; anything else on every token
        task = ("sft" if s.data.startswith(CHAT) else "dpo" if s.data.startswith(PREF) else
                "grpo" if s.prompts is not None else "lm")
        s = dataclasses.replace(s, task=task)
    if s.optimizer == "onebit_adam" and s.compression in (None, "none"):
        return dataclasses.replace(s, compression=default_compression(s.steps))
    return s


def check(s: Settings) -> None:
    """Every check that needs no devices; run before JAX starts, so a bad flag costs
    nothing. Raises UsageError (one line). The parts run in this order, so that a
    command with several mistakes is told the first of them."""
    _check_finite(s)
    s = settled(s)
    _check_model(s)
    _check_choices(s)
    _check_compression(s)
    _check_exchange(s)
    _check_numbers(s)
    _check_run(s)
    for name, check_path in (("metrics", _check_output_file), ("timeline", _check_output_file),
                             ("ckpt_dir", _check_output_dir), ("commit_dir", _check_output_dir),
                             ("profile_dir", _check_output_dir), ("tensorboard", _check_output_dir)):
        if getattr(s, name):
            check_path(flag(name), getattr(s, name))


def _one_of(what, value, known) -> None:
    if value not in known:
        raise UsageError(f"unknown {what} {value!r}; choose one of {', '.join(map(str, known))}")


def _check_model(s: Settings) -> None:
    """The model, and that its options are its own (--init-from brings its own model)."""
    _one_of("model", s.model, MODELS)
    if s.init_from is not None and s.model == Settings.model:
        return  # the checkpoint names its model: model_choice holds the flags given to it once it is read
    name = s.model if s.init_from is not None else model_choice(s)[0]
    wrong = [o for o in s.model_options if o not in model_options()[name]]
    if wrong:
        has = ", ".join(flag(o) for o in model_options()[name])
        raise UsageError(f"{', '.join(flag(o) for o in wrong)} does not apply to --model {name} "
                         f"(its options: {has})")


def _check_choices(s: Settings) -> None:
    """Each flag that names a registry's entry names one it has."""
    _one_of("--optimizer", s.optimizer, OPTIMIZERS)
    _one_of("--lr-scaling", s.lr_scaling, LR_SCALINGS)
    _check_lr_schedule(s)
    if s.allreduce is not None:  # None: the platform's default (dpjax.plan.default_allreduce)
        _one_of("--allreduce algorithm", s.allreduce, (*ALGORITHMS, "auto"))
    _one_of("--dtype", s.dtype, ("auto", *DTYPES))
    _one_of("--param-dtype", s.param_dtype, PARAM_DTYPES)
    _one_of("--remat", s.remat, ("auto", *REMATS))
    _one_of("--attention", s.attention, ("auto", *ATTENTIONS))
    _one_of("--tp-allreduce algorithm", s.tp_allreduce, ALGORITHMS)
    _one_of("--context-attention", s.context_attention, CONTEXT_ATTENTIONS)
    _one_of("--expert-alltoall", s.expert_alltoall, ALL_TO_ALL_ALGORITHMS)


def _check_lr_schedule(s: Settings) -> None:
    """The schedule is one the registry has, its decay options go with a decay, and wsd's
    decay fits after the warm-up."""
    _one_of("--lr-schedule", s.lr_schedule, LR_SCHEDULES)
    shape = LR_SCHEDULES[s.lr_schedule]
    given = [flag(k) for k in ("min_lr", "decay_steps") if getattr(s, k) != getattr(Settings, k)]
    if shape.keep is None and given:
        decaying = ", ".join(n for n, sh in LR_SCHEDULES.items() if sh.keep is not None)
        raise UsageError(f"{' and '.join(given)} shape a decay; --lr-schedule {s.lr_schedule} has none (choose "
                         f"{decaying})")
    if s.decay_steps is not None and s.decay_steps < 1:
        raise UsageError(f"--decay-steps must be at least 1, got {s.decay_steps}")
    peak = s.lr * s.batch_size * s.backward_passes / 256 if s.lr_scaling == "linear" else s.lr
    if shape.keep is not None and s.min_lr > peak:
        raise UsageError(f"--min-lr {s.min_lr} is above the peak rate {peak:g}: a decay goes down")
    start, _ = shape.window(s.steps, s.warmup_steps, s.decay_steps)
    if shape.tail and start < s.warmup_steps:
        raise UsageError(f"--lr-schedule {s.lr_schedule}: --warmup-steps {s.warmup_steps} and a decay of "
                         f"{s.steps - start} steps do not fit in --steps {s.steps}")


def _check_compression(s: Settings) -> None:
    """--compression parses, fits FSDP's reduce-scatter where it runs there, and 1-bit
    Adam's options go with 1-bit Adam."""
    try:  # its form as the plan will set it: FSDP's when no --workers or --compress-axes take the exchange
        ex = Exchange(compression=None if s.compression == "none" else s.compression).placed(
            s.fsdp, s.workers or s.compress_axes)
    except ValueError as e:
        raise UsageError(f"--compression: {e}") from None
    spec = ex.spec
    if ex.unfit:
        linear = [n for n in compression.names() if (m := compression.registry.get(n)) and m.reduce_scatter is not None]
        raise UsageError(f"--compression {s.compression} cannot run inside FSDP's reduce-scatter, it is not linear: "
                         f"{ex.unfit}; compress only between sites (--workers node --compress-axes "
                         f"node, exact FSDP inside) or use a linear method ({', '.join(linear)})")
    if s.optimizer == "onebit_adam":
        _check_onebit_adam(s, ex)
    elif spec is not None and (spec.refresh or spec.bound):
        raise UsageError(f"--compression {s.compression}: {'refresh=R' if spec.refresh else 'bound=C'} is 1-bit Adam's "
                         f"(Adam's variance, frozen), with --optimizer onebit_adam only (this run's is {s.optimizer})")
    if s.compress_whole and s.compress_axes is None:
        raise UsageError("--compress-whole chooses the form of the exchange --compress-axes compresses: give "
                         "--compress-axes too (e.g. node)")


def _check_exchange(s: Settings) -> None:
    """The schedule, the transport between processes and the algorithms each layout needs."""
    if s.schedule is not None:
        _one_of("--schedule", s.schedule, SCHEDULES)
    collectives = transport.chosen(s.collectives)
    _one_of("--collectives", collectives, COLLECTIVES)
    if transport.problem(collectives):  # e.g. mpi without MPItrampoline's library
        raise UsageError(transport.problem(collectives))
    if nested(s.tp_allreduce):
        raise UsageError(f"--tp-allreduce {s.tp_allreduce} needs two axes; the model axis is one")
    if s.fsdp and s.allreduce not in (*REDUCE_SCATTER_ALGORITHMS, "auto", None):
        raise UsageError(f"--fsdp all-gathers and reduce-scatters with the --allreduce algorithm; "
                         f"{s.allreduce!r} has none: choose one of {', '.join(REDUCE_SCATTER_ALGORITHMS)}")


def _check_numbers(s: Settings) -> None:
    """Counts at least 1, sizes not negative, the interval and fusion's two forms."""
    for name in _AT_LEAST_1 + ("microbatches", "virtual_stages"):
        value = getattr(s, name)
        if value is not None and value < 1:
            raise UsageError(f"{flag(name)} must be at least 1, got {value}")
    if s.commit_every != "auto" and not (str(s.commit_every).isdigit() and int(s.commit_every) >= 1):
        raise UsageError(f"--commit-every takes a number of steps (at least 1) or auto, got {s.commit_every!r}")
    if s.max_lost_steps is not None and (s.max_lost_steps < 1 or s.commit_every != "auto"):
        raise UsageError(f"--max-lost-steps {s.max_lost_steps}: it takes a number of steps (at least 1) and sets "
                         "--commit-every auto's interval; with --commit-every N a failure loses at most N steps")
    if not isinstance(s.fusion_mb, (int, float)) and s.fusion_mb != "auto":
        raise UsageError(f"--fusion-mb takes MiB or auto, got {s.fusion_mb!r}")
    for name in _NOT_NEGATIVE + (() if s.fusion_mb == "auto" else ("fusion_mb",)):
        if getattr(s, name) < 0:
            raise UsageError(f"{flag(name)} cannot be negative, got {getattr(s, name)}")


def _check_run(s: Settings) -> None:
    """What the run resumes from, its schedule's chunks, its rule, its data and what it
    records."""
    if s.resume and not (s.ckpt_dir or s.commit_dir):
        raise UsageError("--resume needs --ckpt-dir (or --commit-dir)")
    chunked = [name for name, sched in SCHEDULES.items() if sched.virtual_stages]
    if s.virtual_stages is not None and s.schedule not in chunked:
        raise UsageError(f"--virtual-stages applies to --schedule {', '.join(chunked)}, not {s.schedule or '1f1b'}")
    parse_update(s.update)
    _check_data(s)
    if s.peak_tflops is not None and s.peak_tflops <= 0:
        raise UsageError(f"--peak-tflops must be positive, got {s.peak_tflops}")
    if s.profile_dir and not s.timeline:
        raise UsageError("--profile-dir keeps the capture behind --timeline: add --timeline FILE")


def model_choice(s: Settings) -> tuple[str, dict]:
    """The model a run builds and its config fields: --preset's shape (and vocabulary,
    unless --vocab-size is given), then the options given, which override it."""
    vocab = s.vocab_size
    if vocab is None and s.tokenizer is not None and s.init_from is None:
        vocab = vocab_of(s.tokenizer)
    given = {"seq_len": s.seq_len, "vocab_size": vocab, **s.model_options}
    if s.init_from is not None:  # (after JAX starts: a dpjax checkpoint's record is read by orbax)
        model, _, _ = model_of(s.init_from, s.seq_len)
        _agree(s, model, vocab)
        return model.name, dataclasses.asdict(model.config)
    if s.preset is None:
        return s.model, given
    known = presets()
    if s.preset not in known:
        raise UsageError(f"unknown --preset {s.preset!r}; choose one of {', '.join(known)}")
    name, fields = known[s.preset]
    if s.model not in (name, Settings.model):  # --preset names its model; another one given is a contradiction
        raise UsageError(f"--preset {s.preset} is a {name} model, not --model {s.model}")
    return name, {**fields, **{k: v for k, v in given.items() if v is not None}}


def _agree(s: Settings, model, vocab) -> None:
    """Flags that name the model beside --init-from (--model, --preset, --vocab-size, the
    model's options) are accepted when they say what the checkpoint holds; one that
    disagrees is refused, naming it and the checkpoint's value."""
    c, wrong = dataclasses.asdict(model.config), []
    if s.model not in (Settings.model, model.name):
        wrong.append(f"--model {s.model} (it holds {model.name})")
    given = {"vocab_size": vocab, **s.model_options}
    if s.preset is not None:
        name, fields = presets().get(s.preset, (None, {}))
        if name is None:
            raise UsageError(f"unknown --preset {s.preset!r}; choose one of {', '.join(presets())}")
        if name != model.name:
            wrong.append(f"--preset {s.preset} (a {name}; it holds a {model.name})")
        else:
            fields = dataclasses.asdict(dataclasses.replace(model.config, **fields))  # as the config stores them
            differ = [k for k in fields if k != "seq_len" and fields[k] != c[k]]
            if differ:
                wrong.append(f"--preset {s.preset} (its {', '.join(differ)} differ)")
    for k, v in given.items():
        if v is not None and (k not in c or c[k] != v):
            wrong.append(f"{flag(k)} {v} (it holds {c.get(k, 'no such option')})")
    if wrong:
        raise UsageError(f"--init-from {s.init_from} disagrees with {'; '.join(wrong)}: flags beside it must "
                         "say what it holds")


def warnings(s: Settings) -> list[str]:
    """Settings that are allowed but almost surely not meant: one line each, printed
    before the run starts (it runs anyway). --lr 0 trained 200 flat steps in silence."""
    out = []
    if s.lr == 0:
        out.append("warning: --lr 0: every update is zero, so the parameters and the loss stay where they start "
                   "(--lr takes the learning rate, e.g. 3e-3)")
    return out


def _check_finite(s: Settings) -> None:
    """nan and inf parse as floats (Python's float() takes them, and so do TOML and
    JSON), but no setting means anything with them: --lr nan trained to NaN and exited 0."""
    for f in dataclasses.fields(s):
        value = getattr(s, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag(f.name)} must be a finite number, got {value}")


def _check_onebit_adam(s: Settings, ex: Exchange) -> None:
    """1-bit Adam (`dpjax.updates.onebit_adam`) is its own synchronous exchange between
    workers: it needs a method with error feedback and S >= 1 exact warm-up steps."""
    example = f"e.g. --compression {default_compression(s.steps)}, the default for {s.steps} steps"
    spec = ex.spec
    if ex.form is Form.PLAIN:
        raise UsageError(f"--optimizer onebit_adam sends the momentum through a compression with error feedback after "
                         f"S exact AdamW steps, got --compression {s.compression}: leave it out for the default, or "
                         f"give one ({example})")
    assert spec is not None  # a form other than plain has a method
    if spec.start < 1:
        raise UsageError(f"--optimizer onebit_adam freezes Adam's variance after start=S exact steps, S >= 1: "
                         f"--compression {s.compression},start=S ({example})")
    if not parse_update(s.update).is_sync:
        raise UsageError(f"--optimizer onebit_adam is its own synchronous exchange (the momentum, compressed); "
                         f"--update {s.update} cannot wrap it: use --update sync")
    if s.fsdp and s.workers is None and s.compress_axes is None:
        raise UsageError("--optimizer onebit_adam with --fsdp over every data axis: FSDP's reduce-scatter exchanges "
                         "gradients, not the momentum; shard inside sites and compress between them (--workers "
                         "node --fsdp)")


def _check_data(s: Settings) -> None:
    """A token file (--data X.bin) needs its vocabulary; bytes need at least 256 ids; a
    tokenizer tokenizes text (not a token file, nor synthetic ids)."""
    tokens = s.data.endswith(".bin")  # dpjax.data.TOKEN_SUFFIX
    check_chat(s)
    if s.tokenizer is not None:
        if tokens or s.data == "synthetic":
            raise UsageError(f"--tokenizer tokenizes text; --data {s.data} is {'ids' if tokens else 'synthetic'} "
                             "already (python -m dpjax.data.prepare --tokenizer makes a token file from text)")
        n = vocab_of(s.tokenizer)
        if s.vocab_size is not None and s.vocab_size < n:
            raise UsageError(f"--vocab-size {s.vocab_size} is smaller than --tokenizer {s.tokenizer}'s {n} ids")
        return
    if tokens and s.vocab_size is None and s.init_from is None and s.preset is None:
        raise UsageError(f"--data {s.data} is a token file: give its tokenizer's --vocab-size")
    if s.vocab_size is not None and s.vocab_size < (2 if tokens or s.data == "synthetic" else 256):
        raise UsageError(f"--vocab-size {s.vocab_size} is too small for --data {s.data}")
    if s.token_dtype != "auto" and not tokens:
        raise UsageError(f"--token-dtype applies to a token file (--data FILE.bin), not {s.data}")


def _check_output_file(what: str, path: str) -> None:
    """A file the run will write: its folder must exist and be writable, now rather than
    after the run (a missing folder would lose the whole run's output at its end)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{what} {path}: is a folder; give a file name")
    if not os.path.isdir(folder):
        raise UsageError(f"{what} {path}: the folder {folder} does not exist; create it or choose another path")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{what} {path}: the folder {folder} is not writable")


def _check_output_dir(what: str, path: str) -> None:
    """A folder the run will create if need be: it must not be a file, and the nearest
    folder that exists on its way must be writable."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{what} {path}: is a file, not a folder; pass a folder")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
        raise UsageError(f"{what} {path}: cannot be created under {probe} (not a writable folder)")
