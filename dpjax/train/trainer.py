"""The training loop: a `Trainer` built from one plan, then `run()`.

    settings -> dpjax.plan.resolve -> Trainer (steps from dpjax.step, parameters,
    data streams, checkpoint restore) -> run(): data -> step -> hooks

The loop itself is `loop.py`; everything beside the step is a hook (`hooks.py`, the
protocol a run's own hooks follow too; the built-in ones in `builtin.py`: metrics,
progress, evaluation, checkpoints, commits, the NaN stop, Ctrl-C, the autotune, the
timeline). Beside them: the autotune's glue (`tuning.py`), what a run measures about
itself (`observe.py`), starting fresh or resuming and the metrics file (`resume.py`),
the stop on a NaN or Inf (`nonfinite.py`).
"""

from __future__ import annotations

import dataclasses
import sys

import jax

from dpjax import distributed, step as S
from dpjax.plan import check, devices_per_process, resolve, settled, warnings, UsageError, memory_refusal
from dpjax.settings import Settings
from dpjax.train import builtin, elastic, hardware, observe, record, restart, resume, tuning, preference, rollout
from dpjax.train.checkpoints import Checkpoints
from dpjax.train.streams import epochs_clause, streams
from dpjax.collectives.cpu_runtime import simulate_cpu_devices  # and the guards their collectives need
from dpjax.compression import accounting
from dpjax.hf import params_of
from dpjax.mesh import mesh_size, recommended_xla_flags, dp_size
from dpjax.step import put_batch
from dpjax.train.autotune import Setting
from dpjax.train.loop import run_loop
from dpjax.train.plan_table import plan_lines, compiling_line
from dpjax.train.rollout import Rollouts
from dpjax.wrap.replicas import check_always, checked


def setup_devices(cfg: Settings):
    """Starts jax.distributed if launched as one of several processes and simulates the
    CPU devices this process contributes to the mesh (before JAX starts); the devices
    the mesh is made of."""
    recommended_xla_flags()  # GPU: collectives overlapped with compute (before JAX starts; the user's flags win)
    distributed.initialize(collectives=cfg.collectives)
    per_process = devices_per_process(cfg, distributed.launched_processes())
    simulate_cpu_devices(per_process or 8)
    devices = jax.devices()
    distributed.ready()  # the transport's first collective, now that the devices are set
    want = mesh_size(cfg.mesh) if cfg.mesh else None
    if want is not None and want < len(devices) and jax.process_count() == 1:
        devices = devices[:want]  # e.g. --mesh 1x1 on a machine with several GPUs
    return devices


class Trainer:
    """Everything a run needs, built from its plan; `run()` then loops. Raises a
    UserError before anything is written when the settings are bad."""

    def __init__(self, cfg: Settings):
        check(cfg)  # before JAX starts: a bad flag costs nothing
        resume.check_metrics_file(cfg)  # ... nor does a metrics file that would be lost
        resume.check_commit_dir(cfg)  # ... nor commits a fresh run would remove
        user = cfg  # what must match on resume is what the user asked, whatever the size now
        # under dpjax.agent: mesh and micro-batches for the hosts there are now; what the plan fills in (1-bit Adam's
        # default compression) in the settings the record and the checkpoint see
        self.cfg = cfg = settled(restart.fit(cfg))
        # where commits are: compiled programs a restart loads (before any compile)
        self.programs = restart.programs(cfg)
        devices = setup_devices(cfg)
        restart.stamp("join")  # jax.distributed joined, devices ready (a restart's breakdown)
        self.plan = plan = resolve(cfg, devices)
        restart.stamp("plan")
        distributed.ready(plan.mesh)  # the transport's communicators for this mesh (MPI: see transport.py)
        model, opt = plan.model, plan.opt
        assert model is not None and opt is not None  # resolved from settings: a dpjax model and its optimizer
        self.mesh, self.model, self.layout, self.opt = plan.mesh, model, plan.layout, opt
        self._say_plan()
        data = streams(cfg, self.model, rows_multiple=dp_size(self.mesh))  # packed rows split over the data axes
        self.train_stream, self.val_stream, self.tokenizer, self.chat = data.train, data.val, data.tokenizer, data.chat
        self.rows = data.rows  # the rows a batch of --batch-size examples fills (--pack), None: one a row
        if self.chat is not None:
            self.say(self.chat.line() + epochs_clause(len(self.chat.train), cfg.batch_size * cfg.backward_passes,
                                                      cfg.steps))  # what was read, skipped, cut: before the compile
        self._steps: dict[Setting, S.TrainStep] = {}  # one a setting the autotune tries
        self.use(Setting(plan.exchange.algorithm, plan.exchange.fusion_mb))
        self.record = self._resume_record(user)
        self._say_exchange()
        self._init_state()
        self.online_reference = None  # --ref-logps online without LoRA: dpjax.train.preference.Online
        if cfg.task == "dpo":  # the reference's log-probs, from the starting weights: before a restore
            preference.reference(self)
        elif cfg.task == "grpo":  # the reference: a frozen copy of the starting weights, before a restore
            rollout.reference(self)
        self.start, self.cursor = 0, 0
        self.resumed: dict = {}  # the restored checkpoint's metadata (step, cursor, ...), if any
        checkpoints = Checkpoints(cfg)
        checkpoints.restore(self)
        self.run_record = record.build(cfg, plan)  # the first metrics row, and run.json beside the checkpoints
        if self.chat is not None:
            self.run_record["data"] = self.chat.record()
        commits = builtin.Commits(elastic.attach(self))  # commits, heartbeat, faults; a restart restores its commit
        resume.fresh_or_refuse(self)  # before anything is written: --resume that found nothing is an error
        checkpoints.open(self)
        self.parts = builtin.Parts(checkpoints, commits, builtin.Autotune(tuning.plan_search(self)),
                                   observe.recorder(cfg), rollouts=grpo_rollouts(self))
        if self.start >= cfg.steps:
            raise UsageError(f"the checkpoint is at step {self.start}, not before --steps {cfg.steps}; "
                             "ask for more steps")

    # --- what __init__ does, in its order ---

    def _say_plan(self) -> None:
        """The devices, the plan's notes (e.g. why the attention is not cuDNN's flash
        kernel), its warnings (process 0, to stderr)."""
        self.say(hardware.devices_line(list(self.mesh.devices.flat), jax.process_count()))
        for note in self.plan.notes:
            self.say(note)
        for warning in [hardware.cpu_but_gpu_warning(jax.devices()), *warnings(self.cfg)]:
            if warning and jax.process_index() == 0:
                print(warning, file=sys.stderr, flush=True)

    def _resume_record(self, user: Settings) -> dict:
        """What must match for a checkpoint to resume: per-worker state needs the same
        rule and the same number of workers (the mesh may change)."""
        cfg, plan = self.cfg, self.plan
        model = self.model.describe()
        optimizer = {**dataclasses.asdict(self.opt), "backward_passes": user.backward_passes,
                     "update": str(plan.update)}
        if self.step.rule.per_worker:
            optimizer["workers"] = self.layout.num_workers
        if plan.exchange.between_workers_only:  # error buffers / PowerSGD's Q in the state (issue 20)
            optimizer["compression"] = cfg.compression
            split = plan.exchange.split(self.mesh, fsdp=cfg.fsdp)
            if split:  # the state's shapes follow these axes: they must match to resume
                optimizer["compression_model_split"] = split
        if self.layout.pipeline is not None and self.layout.pipeline.virtual_stages > 1:
            # the layer stack is stored V x L/V: it resumes on any stage count, with the same V
            model["virtual_stages"] = self.layout.pipeline.virtual_stages
        return {"model": model, "data": cfg.data, "seed": cfg.seed, "batch_size": user.batch_size,
                "optimizer": optimizer}

    def _say_exchange(self) -> None:
        """One line when the cost model says the compression cannot pay, or the method
        misbehaves under the optimizer; then what compiles, and how to stop it."""
        for warning in (accounting.warning(self.plan), accounting.optimizer_warning(self.plan)):
            if warning:
                self.say(warning)
        self.say(compiling_line(self.plan))  # a large model compiles for minutes: say what, and how to stop it

    def _init_state(self) -> None:
        """Parameters (--init-from's weights read onto this layout, or fresh), the
        optimizer state, and the run's RNG state: nothing in the step draws from it yet (LoRA's
        dropout draws from the seed and a step counter the optimizer state keeps,
        `dpjax.step.builder`), but it is saved and restored with the rest so that stochastic
        steps resume exactly too."""
        cfg, plan, key = self.cfg, self.plan, jax.random.key(self.cfg.seed)
        if cfg.init_from:  # the optimizer state fresh
            initial = plan.policy.store(params_of(cfg.init_from, self.model, self.layout, adapter=cfg.adapter,
                                                   seed=cfg.seed))
            n = self.model.num_params(initial)
            trained = "" if plan.split is None else (  # LoRA: as PEFT's print_trainable_parameters
                f", {(t := self.model.num_params(plan.split.trained(initial))):,} trained: {100 * t / n:.2f}%")
            self.say(f"initialised from {cfg.init_from} ({n:,} parameters{trained})")
        else:
            initial = S.init_params(self.model, self.layout, key, plan.policy,
                                    keep=self.programs and self.programs.keep)
        self.params, self.opt_state = self.step.init(initial)
        self.rng = jax.device_put(jax.random.key_data(jax.random.fold_in(key, 1)), S.replicated(self.mesh))

    # --- the steps, one per exchange setting (an autotune tries several) ---

    def step_for(self, setting):
        """The steps with this allreduce algorithm and fusion cap, built once each."""
        if setting not in self._steps:
            plan = self.plan
            if (setting.algorithm, setting.fusion_mb) != (plan.exchange.algorithm, plan.exchange.fusion_mb):
                plan = plan.with_exchange(setting.algorithm, setting.fusion_mb)
            step = S.for_plan(plan)
            if self.programs is not None:
                step = S.kept(step, self.programs.keep, f"-{setting.algorithm}-{setting.fusion_mb}")
            if check_always():  # DPJAX_CHECK=1: every step's replicated values are checked (dpjax.wrap.replicas)
                step = dataclasses.replace(step, train=checked(step.train, ("params", "opt_state", "loss"),
                                                               "dpjax.train step"))
            self._steps[setting] = step
        return self._steps[setting]

    def use(self, setting) -> None:
        self.setting, self.step = setting, self.step_for(setting)

    # --- state ---

    def state(self) -> dict:
        """What a checkpoint or a commit saves: the parameters, the optimizer state, the RNG state."""
        return {"params": self.params, "opt_state": self.opt_state, "rng": self.rng}

    def load_state(self, state: dict, step: int, cursor: int) -> None:
        """A restored `state()` after `step` steps, the data read up to `cursor`."""
        self.params, self.opt_state, self.rng = state["params"], state["opt_state"], state["rng"]
        self.start, self.cursor = step, cursor

    def say(self, line: str) -> None:
        if jax.process_index() == 0 and self.cfg.progress != "none":
            print(line, flush=True)

    def announce(self, line: str) -> None:
        """A line said whatever --progress is (process 0): how the run starts is news."""
        if jax.process_index() == 0:
            print(line, flush=True)

    # --- data ---

    def batch(self):
        b = put_batch(self.train_stream, self.cursor, self.cfg.batch_size, self.mesh, passes=self.cfg.backward_passes,
                      rows=self.rows)
        self.cursor += self.cfg.batch_size * self.cfg.backward_passes
        return self.with_reference(b)

    def with_reference(self, batch):
        """A preference batch with its reference log-probs from the frozen copy (--ref-logps
        online without LoRA); any other batch as it is."""
        return batch if self.online_reference is None else self.online_reference(batch)

    def run(self, hooks=()) -> dict:
        """Trains to --steps (or a stop) with the built-in hooks and `hooks` (each a
        `dpjax.train.Hook`: `dpjax.train.hooks`); returns the summary."""
        return run_loop(self, hooks)


def grpo_rollouts(trainer):
    """--task grpo's generate-score loop (`dpjax.train.rollout`), None for another task."""
    if trainer.cfg.task != "grpo":
        return None
    return Rollouts(trainer)


def run(cfg: Settings, hooks=()) -> dict:
    """Trains per `cfg`, calling `hooks` (`dpjax.train.Hook`s) at each step beside the
    built-in ones; returns the summary."""
    return Trainer(cfg).run(hooks)


def dry_run(cfg: Settings) -> int:
    """--dry-run: the plan resolved on the devices here (or for --device-memory), printed,
    nothing compiled; 0 if it fits, 2 (and the one line saying why) if not."""
    check(cfg)
    plan = resolve(restart.fit(cfg), setup_devices(cfg))
    for line in plan_lines(plan):
        print(line)
    refusal = memory_refusal(plan)
    if refusal:
        raise UsageError(refusal)
    mem = plan.memory
    print("the plan fits" + (f" in {mem['device'] / 2**30:,.1f} GiB per device" if mem and mem["device"] else ""))
    return 0
