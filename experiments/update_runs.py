"""Shared by staleness.py, wan.py and large_batch.py: short training runs under an update rule.

One `Bench` holds the model, the mesh, the inner optimizer's config and pre-placed
train/validation batches, so every run of a sweep sees the same data in the same
order from the same initial parameters; only the rule (and its compiled step) changes.
Not a library: the experiments import it as a sibling module.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field

from _bench import finish_plot, pyplot
from dpjax.collectives.cpu_runtime import simulate_cpu_devices

simulate_cpu_devices(8)  # before jax starts: 8 simulated workers on a CPU-only machine

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dpjax import step as S  # noqa: E402
from dpjax.data import make_streams  # noqa: E402
from dpjax.mesh import dp_size, make_mesh, parse_axes  # noqa: E402
from dpjax.models import get_model  # noqa: E402
from dpjax.compression import Exchange  # noqa: E402
from dpjax.plan import per_shard, resolve  # noqa: E402
from dpjax.settings import Settings  # noqa: E402

DATE = time.strftime("%Y-%m-%d")
MACHINE = "2-core CPU VM, 8 simulated devices (XLA host platform), jax 0.10.2"


@dataclass
class Run:
    spec: str
    losses: list  # mean train loss of the workers, per step
    evals: list = field(default_factory=list)  # (steps done, validation loss of the consensus)

    @property
    def final_eval(self) -> float:
        return self.evals[-1][1]

    def steps_to(self, target: float) -> int | None:
        """Steps done at the first evaluation whose loss is at or below `target`."""
        return next((s for s, v in self.evals if v <= target), None)


def parameter_count(model) -> int:
    """How many values `model` has (what a gradient exchange carries)."""
    return sum(x.size for x in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))))


class Bench:
    """One model, mesh and data for a sweep of rules. workers: the data axes a rule's
    workers span ('node': one worker per node, synchronous inside; None: the rule's
    default, every data-parallel rank a worker)."""

    def __init__(self, *, model="mlp", mesh="8x1", batch_size=64, seq_len=32, steps=200, optimizer="momentum",
                 lr=0.05, warmup_steps=0, lr_scaling="none", clip_norm=0.0, algorithm="ring", eval_every=20,
                 eval_batches=4, seed=0, data="stdlib", d_model=None, workers=None, options=None,
                 compression="none", compress_axes=None, compress_whole=False):
        self.mesh = make_mesh(mesh)
        self.options = dict(options or {})  # more allreduce arguments (e.g. op="adasum")
        self.workers = workers
        options = {"d_model": d_model, "n_layers": 2, "n_heads": 4} if model == "gpt" else {}
        self.settings = Settings(mesh=mesh, model=model, batch_size=batch_size, seq_len=seq_len, steps=steps,
                                 optimizer=optimizer, lr=lr, warmup_steps=warmup_steps, lr_scaling=lr_scaling,
                                 clip_norm=clip_norm, allreduce=algorithm, seed=seed, data=data, workers=workers,
                                 model_options={k: v for k, v in options.items() if v is not None})
        self.model = get_model(model, seq_len=seq_len, **options)
        self.batch_size, self.steps, self.seed, self.algorithm = batch_size, steps, seed, algorithm
        self.eval_every = eval_every
        train, val = make_streams(data, seq_len, seed)
        self.train = [S.put_batch(train, i * batch_size, batch_size, self.mesh, passes=1) for i in range(steps)]
        self.val = [S.put_batch(val, i * batch_size, batch_size, self.mesh) for i in range(eval_batches)]
        self.inner = None  # an optax optimizer to use instead of the settings' (large_batch.py's warmup)
        # the exchange's compression (dpjax.compression spec) and the axes it is limited to (issue 20)
        self.compression, self.compress_axes = compression, compress_axes
        self.compress_whole = compress_whole  # the whole gradient across from every device, not its shard

    def plan(self, spec: str, links=(), mesh=None):
        """The plan of the rule `spec` (dpjax.plan); links: emulated slow links (dpjax.links).
        Parameters are replicated over `model` (the benches' meshes have a model axis of 1)."""
        compression, compress_axes = (self.compression, self.compress_axes) if mesh is None else ("none", None)
        settings = dataclasses.replace(self.settings, update=spec, link=[str(x) for x in links] or None,
                                       compression=compression, compress_axes=compress_axes)
        inner = self.inner
        if mesh is not None:  # one worker's step alone: its rows, the settings' own optimizer
            inner = None
            settings = dataclasses.replace(settings, mesh="1x1", workers=None,
                                           batch_size=self.batch_size // dp_size(self.mesh))
        axes = None if compress_axes is None else parse_axes(compress_axes, self.mesh)
        exchange = Exchange(self.algorithm, options=self.options,
                            compression=None if compression == "none" else compression, compress_axes=axes,
                            shards=None if self.compress_whole or mesh is not None else per_shard(self.mesh, axes))
        return resolve(settings, mesh=mesh or self.mesh, model=self.model, optimizer=inner, exchange=exchange,
                       tensor_parallel=False)

    def step(self, spec: str, links=(), donate: bool = True):
        """(layout, TrainStep) of the rule `spec`; links: emulated slow links (dpjax.links)."""
        plan = self.plan(spec, links)
        return plan.layout, S.for_plan(plan, donate=donate)

    def run(self, spec: str, verbose: bool = True) -> Run:
        t0 = time.perf_counter()
        layout, step = self.step(spec)
        params, state = step.init(S.init_params(self.model, layout, jax.random.key(self.seed)))
        out = Run(spec if self.workers is None else f"{spec} (workers={self.workers})", [])
        for i, batch in enumerate(self.train):
            params, state, loss = step.train(params, state, batch)
            out.losses.append(loss)
            if i >= 4:  # the CPU backend deadlocks with ~40+ collective programs in flight
                out.losses[i - 4] = float(out.losses[i - 4])
            done = i + 1
            if done % self.eval_every == 0 or done == self.steps:
                ev = np.mean([float(step.evaluate(params, b)) for b in self.val])
                out.evals.append((done, float(ev)))
        out.losses = [float(x) for x in out.losses]
        if verbose:
            print(f"  {out.spec:34s} final eval {out.final_eval:.4f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
        return out

    def gradient_elements(self) -> int:
        return parameter_count(self.model)

    def compute_seconds(self, reps: int = 20) -> float:
        """Median time of one worker's step alone: its slice of the batch on one device,
        loss, gradient and the inner optimizer, no communication."""
        one = make_mesh("1x1", jax.devices()[:1])
        local = self.batch_size // dp_size(self.mesh)
        plan = self.plan("sync", mesh=one)
        layout, step = plan.layout, S.for_plan(plan, donate=False)
        params, state = step.init(S.init_params(self.model, layout, jax.random.key(self.seed)))
        batch = jax.device_put(np.asarray(self.train[0])[:, :local], S.replicated(one))
        jax.block_until_ready(step.train(params, state, batch))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(step.train(params, state, batch))
            times.append(time.perf_counter() - t)
        return statistics.median(times)


def plot(path, series, xlabel, ylabel, title, logx=False):
    """series: [(label, xs, ys)]. Returns False (and says why) without matplotlib."""
    plt = pyplot(path)
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for label, xs, ys in series:
        ax.plot(xs, ys, marker="o" if len(xs) < 12 else None, label=label)
    if logx:
        ax.set_xscale("symlog", linthresh=1)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    finish_plot(fig, ax, path)
    return True


