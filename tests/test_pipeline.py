"""Pipeline parallelism over a `stage` axis (dpjax.pipeline), against independent references.

- the timetables, walked tick by tick in plain Python: every forward and backward once,
  in dependency order, stash slots never overwritten while live, the bubble as the
  papers state it, 1F1B's live inputs bounded by the stages;
- training on stage=2,data=4, stage=4,data=2, stage=2,data=2,model=2 and stage=8 with
  every schedule, against plain JAX on one device (the unpipelined GPT, no dpjax step):
  the first step's gradients, then 10 SGD steps' losses (no clipping: a wrong scale
  shows). One case per schedule runs always (one of them with FSDP inside the stages),
  the other 13 are slow-marked;
- composition (slow-marked but the checkpoint): local SGD between pipelined workers
  against plain JAX, every --allreduce, a checkpoint resumed on another stage count (and
  evaluated by the forward-only pipeline);
- memory from compiled programs: parameters and optimizer state 1/S of the layers' per
  device, 1F1B's temporaries flat in M where GPipe's grow; the bubble from FLOPs;
- bad input: one line, exit 2.

Tests that train the same configuration share its compiled step (`built`).
"""
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.mesh import data_axes
from dpjax.models import get_model
from dpjax.pipeline import SCHEDULES, Pipeline, bubble_formula, cost, timetable
from dpjax.sharding import make_layout
from dpjax.train import main

# ---------------------------------------------------------------------------------------
# Timetables


def walk(tt):
    """{(kind, m, r, s): tick} of every valid slot, checking each is in a phase that runs
    its kind and that none is scheduled twice."""
    events = {}
    for ph in tt.phases:
        for t, s in itertools.product(range(ph.start, ph.start + ph.ticks), range(tt.stages)):
            for kind, run, index in (("F", ph.forward, tt.forward), ("B", ph.backward, tt.backward)):
                m, r, ok = index(t, s)
                if ok:
                    assert run, (tt.name, kind, t, s, "a valid slot in a phase that does not run it")
                    assert (kind, m, r, s) not in events, (tt.name, kind, m, r, s)
                    events[kind, m, r, s] = t
    # outside the phases no slot is valid
    for t, s in itertools.product(range(tt.ticks, tt.ticks + 2 * tt.stages * tt.chunks), range(tt.stages)):
        assert not tt.forward(t, s)[2] and not tt.backward(t, s)[2], (tt.name, t, s)
    return events


def check_timetable(tt):
    S, M, V = tt.stages, tt.microbatches, tt.chunks
    ev = walk(tt)
    assert len(ev) == 2 * M * V * S  # every micro-batch, chunk and stage: one forward, one backward
    live_max = 0
    for m, r, s in itertools.product(range(M), range(V), range(S)):
        f, b = ev["F", m, r, s], ev["B", m, r, s]
        # the input arrives from the previous virtual stage, one tick earlier (one ppermute)
        if (r, s) != (0, 0):
            prev = (r, s - 1) if s else (r - 1, S - 1)
            assert f == ev["F", m, *prev] + 1, (tt.name, m, r, s)
        # the gradient arrives from the next virtual stage, one tick earlier
        if (r, s) != (V - 1, S - 1):
            nxt = (r, s + 1) if s < S - 1 else (r + 1, 0)
            assert b == ev["B", m, *nxt] + 1, (tt.name, m, r, s)
            assert b > f
        else:  # the last chunk: its backward starts from the loss, no earlier than its forward
            assert b >= f
            seed = m % tt.seed_slots  # no other micro-batch's seed lands in the slot meanwhile
            for m2 in range(M):
                if m2 != m and m2 % tt.seed_slots == seed:
                    assert not f <= ev["F", m2, V - 1, S - 1] <= b, (tt.name, m, m2)
        # the stashed input survives until the backward (a tick runs its forward first)
        slot = tt.stash_slot(m, r, s)
        assert 0 <= slot < tt.stash_slots
        for m2, r2 in itertools.product(range(M), range(V)):
            if (m2, r2) != (m, r) and tt.stash_slot(m2, r2, s) == slot:
                assert not f < ev["F", m2, r2, s] <= b, (tt.name, m, r, s, m2, r2)
        # inputs held when this one is stored (a backward in this tick still needs its own)
        live = sum(1 for m2, r2 in itertools.product(range(M), range(V)) if ev["F", m2, r2, s] <= f <= ev["B", m2, r2, s])
        live_max = max(live_max, live)
    assert live_max <= tt.stash_slots
    assert tt.bubble() == pytest.approx(bubble_formula(tt.name, S, M, V), abs=1e-12)
    return live_max


GRID = [(S, M) for S in (1, 2, 3, 4, 8) for M in (1, 2, 3, 4, 8, 16)]


@pytest.mark.parametrize("schedule", [n for n, s in SCHEDULES.items() if not s.virtual_stages])
def test_timetables(schedule):
    for S, M in GRID:
        live = check_timetable(timetable(Pipeline(schedule, M), S))
        assert live == SCHEDULES[schedule].stash(S, M, 1)  # 1f1b: bounded by the stages; else every input


def test_interleaved_timetable():
    for S, V in itertools.product((1, 2, 3, 4), (1, 2, 3, 4)):
        live = {}
        for g in (1, 2, 4):
            tt = timetable(Pipeline("interleaved", g * S, V), S)
            assert tt.ticks == V * g * S + V * S + S - 2
            live[g] = check_timetable(tt)
        assert live[2] == live[4] <= SCHEDULES["interleaved"].stash(S, 2 * S, V)  # by the stages and chunks, not M
    for S, M in GRID:  # one chunk per stage is 1F1B, slot for slot
        a, b = timetable(Pipeline("interleaved", M, 1), S), timetable(Pipeline("1f1b", M), S)
        assert a.phases == b.phases and walk(a) == walk(b)
        assert all(a.stash_slot(m, 0, s) == b.stash_slot(m, 0, s) for m in range(M) for s in range(S))


def test_a_registered_schedule_is_known_everywhere(mesh_of):
    """A schedule is one file and one registration: a copy of GPipe registered under a new
    name is dispatched by `timetable`, checked by `check`, costed by `bubble_formula`;
    unregistered, it is gone."""
    from dpjax import pipeline
    from dpjax.pipeline import gpipe

    copy = pipeline.Schedule("gpipe-copy", gpipe.timetable, bubble=lambda S, M, V: (S - 1) / (M + S - 1))
    with SCHEDULES.registered(copy):
        tt = timetable(Pipeline("gpipe-copy", 3), 2)
        assert walk(tt) == walk(gpipe.timetable(2, 3)) and check_timetable(tt) == 3
        assert bubble_formula("gpipe-copy", 2, 3) == pytest.approx(1 / 4)
        assert pipeline.check(tiny(4), mesh_of("stage=2,data=4", 8), Pipeline("gpipe-copy")).microbatches == 2
        with pytest.raises(pipeline.UserError, match="choose one of naive, gpipe, 1f1b, interleaved, gpipe-copy"):
            pipeline.check(tiny(4), mesh_of("stage=2,data=4", 8), Pipeline("nope"))
        with pytest.raises(ValueError, match="registered already"):
            pipeline.register(pipeline.SCHEDULES["gpipe"])
    assert "gpipe-copy" not in SCHEDULES


# ---------------------------------------------------------------------------------------
# Training on each mesh with every schedule against the unpipelined model on one device:
# the first step's gradients, then 10 SGD steps' losses


STEPS, B, LR = 10, 16, 0.1
MESHES = {"stage=2,data=4": 8, "stage=4,data=2": 8, "stage=2,data=2,model=2": 8, "stage=8": 8}
# Run always (the rest is slow-marked): one case per schedule, the first with
# FSDP inside the stages (parameters split over `data` too, gathered once a step).
CHEAP = {("naive", "stage=2,data=4"): {"fsdp": True}, ("gpipe", "stage=4,data=2"): {},
         ("1f1b", "stage=2,data=2,model=2"): {}, ("interleaved", "stage=2,data=4"): {}}


def tiny(n_layers):
    return get_model("gpt", seq_len=8, d_model=16, n_layers=n_layers, n_heads=2, d_ff=32)


@functools.cache
def initial(n_layers):
    """The tiny GPT's initial parameters on the host, placed in each layout's sharding (run
    op by op: a jitted init takes seconds to compile on CPU, for every model)."""
    return jax.tree.map(np.asarray, tiny(n_layers).init(jax.random.key(0)))


def placed(layout, n_layers):
    return jax.device_put(layout.store(initial(n_layers)), layout.shardings())


def train_batches(steps=STEPS):
    return np.random.default_rng(7).integers(0, 256, (steps, B, 9)).astype(np.int32)


@functools.cache
def one_device(n_layers):
    """Plain JAX on one device, no dpjax step: the unpipelined GPT's gradient at the first
    step, and the losses of SGD (lr 0.1, no clipping: a wrong scale shows)."""
    model = tiny(n_layers)

    @jax.jit
    def step(params, batch):
        loss, g = jax.value_and_grad(model.loss)(params, batch)
        return jax.tree.map(lambda p, d: p - LR * d, params, g), loss, g

    params, losses, first = initial(n_layers), [], None
    for batch in train_batches():
        params, loss, g = step(params, batch)
        first = jax.tree.map(np.asarray, g) if first is None else first
        losses.append(float(loss))
    return first, losses


class RecordingSGD:
    """An OptimizerConfig for `dpjax.step.for_model`: SGD that also keeps the gradient it
    was given in its state (the first state holds the step's averaged gradient)."""

    def make(self, global_batch, specs=None):
        keep = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, s, p=None: (g, g))
        return optax.chain(keep, optax.sgd(LR))


@functools.cache
def built(mesh, n_layers, pipe, update="sync", workers=(), fsdp=False, algorithm="ring"):
    """(layout, step) of the sync (or `update`) step with RecordingSGD, built once per
    configuration: tests that train the same configuration share its compiled program."""
    from dpjax import step as S

    model = tiny(n_layers)
    layout = make_layout(model, mesh, pipeline=pipe, fsdp=fsdp, workers=workers, fsdp_algorithm=algorithm)
    step = S.for_model(model, layout, global_batch=B, opt=RecordingSGD(), donate=False, update=update,
                       exchange=S.Exchange(algorithm))
    return layout, step


def train(layout, step, params, state, batches):
    losses, first = [], None
    for batch in batches:
        on_mesh = jax.device_put(batch[None], NamedSharding(layout.mesh, P(None, data_axes(layout.mesh) or None)))
        params, state, loss = step.train(params, state, on_mesh)
        if first is None and not step.rule.per_worker:
            first = layout_to_model(jax.tree.map(np.asarray, state[0]), layout.pipeline)
        losses.append(float(loss))
    return params, state, first, losses


def pipelined_run(mesh, n_layers, pipe, steps=STEPS, **kw):
    """(gradient of the first step, losses) of the step on `mesh`, from the initial parameters."""
    layout, step = built(mesh, n_layers, pipe, **kw)
    _, _, first, losses = train(layout, step, *step.init(placed(layout, n_layers)), train_batches(steps))
    return first, losses


def layout_to_model(tree, pipe):
    """A stored tree back in the model's shapes (interleaved: V x L/V -> L)."""
    if pipe is None or pipe.virtual_stages == 1:
        return tree
    return {**tree, "blocks": jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), tree["blocks"])}


def assert_gradients_equal(got, want):
    # float32 round-off: micro-batch means and the ranks' gradients summed in another order
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        assert g.shape == w.shape, jax.tree_util.keystr(path)
        err = np.max(np.abs(g - w))
        assert err <= 2e-6 * np.max(np.abs(w)), (jax.tree_util.keystr(path), err, np.max(np.abs(w)))


def microbatches(mesh):
    S, rows = mesh.shape["stage"], B // math.prod(mesh.shape[a] for a in data_axes(mesh))
    return 2 * S if rows % (2 * S) == 0 else S


def training_cases():
    for schedule, spec in itertools.product(SCHEDULES, MESHES):
        cheap = CHEAP.get((schedule, spec))
        yield pytest.param(schedule, spec, cheap or {}, marks=() if cheap is not None else (pytest.mark.slow,),
                           id=f"{schedule}|{spec}" + ("|fsdp" if cheap and cheap.get("fsdp") else ""))
    for schedule, spec in CHEAP:  # the always-run ones' plain variant
        if CHEAP[schedule, spec]:
            yield pytest.param(schedule, spec, {}, marks=pytest.mark.slow, id=f"{schedule}|{spec}")


@pytest.mark.parametrize("schedule,spec,options", list(training_cases()))
def test_pipeline_equals_one_device(mesh_of, schedule, spec, options):
    """4 layers (S*V where that is more), twice as many micro-batches as stages where the
    replica's rows allow (else one per stage): the first step's gradient (every leaf, the
    shared embedding and the stages' layers) is the unpipelined model's, and 10 steps of
    SGD give its losses."""
    mesh = mesh_of(spec, MESHES[spec])
    S, V = mesh.shape["stage"], 2 if SCHEDULES[schedule].virtual_stages else 1
    L = max(4, S * V)
    grads, losses = pipelined_run(mesh, L, Pipeline(schedule, microbatches(mesh), V), **options)
    want_grads, want_losses = one_device(L)
    assert_gradients_equal(grads, want_grads)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5, atol=0)


# ---------------------------------------------------------------------------------------
# Composition: FSDP, an update rule between workers, every allreduce, a checkpoint
# resumed on another stage count


@pytest.mark.slow
def test_update_rule_between_pipelined_workers(mesh_of):
    """Local SGD (sparse:3) between the 4 data ranks of stage=2,data=4 (each a pipeline of
    2 stages): plain JAX written out, each worker stepping on its own rows and the
    parameters averaged every 3 steps, gives the same losses."""
    steps, workers, period = 6, 4, 3
    _, losses = pipelined_run(mesh_of("stage=2,data=4", 8), 4, Pipeline("gpipe", 2), steps=steps, update="sparse:3",
                              workers=("data",))
    grad = jax.jit(jax.value_and_grad(tiny(4).loss))
    params, want, rows = [initial(4)] * workers, [], B // workers
    for t, batch in enumerate(train_batches(steps)):
        out = [grad(params[w], batch[w * rows:(w + 1) * rows]) for w in range(workers)]
        params = [jax.tree.map(lambda p, g: p - LR * g, params[w], out[w][1]) for w in range(workers)]
        if (t + 1) % period == 0:
            params = [jax.tree.map(lambda *ps: sum(ps) / workers, *params)] * workers
        want.append(np.mean([float(loss) for loss, _ in out]))
    np.testing.assert_allclose(losses, want, rtol=2e-5, atol=0)


ALLREDUCES = [pytest.param("hierarchical", "node=2,stage=2,data=2", id="hierarchical", marks=pytest.mark.slow)] + [
    pytest.param(a, "stage=2,data=4", id=a, marks=pytest.mark.slow) for a in ("psum", "ring", "butterfly", "tree", "ps")]


@pytest.mark.parametrize("algorithm,spec", ALLREDUCES)
def test_every_allreduce(mesh_of, algorithm, spec):
    """The data-parallel average (and the shared leaves' sum over `stage`) with each of
    dpjax's allreduces: the losses of one device."""
    _, losses = pipelined_run(mesh_of(spec, 8), 4, Pipeline("1f1b", 2), steps=4, algorithm=algorithm)
    np.testing.assert_allclose(losses, one_device(4)[1][:4], rtol=2e-5, atol=0)


def test_checkpoint_resumes_on_another_stage_count(mesh_of, tmp_path):
    """Global arrays in the checkpoint: 5 steps on stage=4,data=2 (GPipe), saved, restored
    onto stage=2,data=2,model=2 (1F1B) for 5 more: the losses of 10 uninterrupted steps on
    one device (the two programs are the equality test's); the restored parameters'
    evaluation (the forward-only pipeline) is the loss of step 5."""
    from dpjax.checkpoint import Checkpointer

    batches, ckpt = train_batches(), str(tmp_path / "ckpt")
    mesh = mesh_of("stage=4,data=2", 8)
    layout, step = built(mesh, 4, Pipeline("gpipe", microbatches(mesh)))
    params, state, _, first = train(layout, step, *step.init(placed(layout, 4)), batches[:5])
    saver = Checkpointer(ckpt)
    saver.save(5, {"params": params, "opt_state": state}, {"model": tiny(4).describe()})
    saver.close()

    mesh = mesh_of("stage=2,data=2,model=2", 8)
    layout, step = built(mesh, 4, Pipeline("1f1b", microbatches(mesh)))
    shapes = jax.eval_shape(step.init, placed(layout, 4))
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, step.shardings())
    loader = Checkpointer(ckpt)
    restored, _ = loader.restore({"params": target[0], "opt_state": target[1]})
    loader.close()
    w1 = restored["params"]["blocks"]["mlp"]["w1_LsxDxFm"]  # 4 layers on 2 stages, F over 2 model ranks
    assert {s.data.shape for s in w1.addressable_shards} == {(2, 16, 16)}
    # the forward-only pipeline (evaluation) of the restored parameters: step 5's loss
    evaluated = step.evaluate(restored["params"], jax.device_put(batches[5], NamedSharding(mesh, P(("data",)))))
    *_, second = train(layout, step, restored["params"], restored["opt_state"], batches[5:])
    np.testing.assert_allclose(first + second, one_device(4)[1], rtol=2e-5, atol=0)
    np.testing.assert_allclose(float(evaluated), one_device(4)[1][5], rtol=2e-5)


# ---------------------------------------------------------------------------------------
# Memory and the bubble, from compiled programs


MEMORY_MODEL = dict(seq_len=32, d_model=32, n_layers=2, n_heads=2, d_ff=32)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_memory_of_the_stages(mesh_of, schedule):
    """From the compiled AdamW step on stage=2, micro-batches of 2 sequences, M = 4 and 16:
    per device, the arguments are the layers' parameters and both moments halved, the
    shared leaves whole, Adam's step counts and the device's rows (numpy arithmetic on the
    shapes); 1F1B's temporaries do not change with M, GPipe's grow by its stash and its
    loss gradients, 2 x b x T x D floats a micro-batch. (M = 8 too: experiments/bench_train.py.)"""
    from dpjax import step as steps
    from dpjax.optim import OptimizerConfig

    model, b, S, T, D = get_model("gpt", **MEMORY_MODEL), 2, 2, MEMORY_MODEL["seq_len"], MEMORY_MODEL["d_model"]
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    layers = sum(x.size * 4 for x in jax.tree.leaves(shapes["blocks"]))
    shared = sum(x.size * 4 for k, v in shapes.items() if k != "blocks" for x in jax.tree.leaves(v))
    scalars = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(OptimizerConfig().make(8).init,
                                                                                   shapes)) if x.ndim == 0)
    temp = {}
    for M in (4, 16):
        layout = make_layout(model, mesh_of(f"stage={S}", S), pipeline=Pipeline(schedule, M))
        step = steps.for_model(model, layout, global_batch=b * M, opt=OptimizerConfig(), donate=False)
        ma = cost.train_memory(step, model, b * M)
        assert ma.argument_size_in_bytes == 3 * (layers // S + shared) + scalars + b * M * (T + 1) * 4
        temp[M] = ma.temp_size_in_bytes
    stash = SCHEDULES[schedule].stash
    if stash(S, 16, 1) == stash(S, 4, 1):  # a stash bounded by the stages (1f1b)
        assert temp[16] == temp[4]
    else:
        assert temp[16] - temp[4] >= 12 * 2 * b * T * D * 4, temp


BUBBLES = [pytest.param("gpipe", 2, 2, 1, id="gpipe-S2-M2")] + [
    pytest.param(s, 4, 4, v, id=f"{s}-S4-M4-V{v}", marks=pytest.mark.slow)
    for s, v in ((name, 2 if sch.virtual_stages else 1) for name, sch in SCHEDULES.items())]


@pytest.mark.parametrize("schedule,stages,M,V", BUBBLES)
def test_bubble_from_flops(schedule, stages, M, V):
    """Executed FLOPs of the S-stage program against the one-stage program over the same
    layers: 1 - useful/executed within 5% of the papers' bubble; and the one-stage program
    does the unpipelined model's work (value_and_grad per micro-batch) plus at most the
    re-materialised forward of its layers and, with V chunks, V - 1 more passes of the
    model's ends (embedding, head) a micro-batch: XLA drops what of the recomputed forward
    the backward does not need, and its fusions differ (observed 0.95 to 1.01 of it)."""
    model = get_model("gpt", seq_len=16, d_model=32, n_layers=stages * V, n_heads=4, d_ff=128)
    r = cost.measure_bubble(model, stages, Pipeline(schedule, M, V), rows=2 * M)
    assert r["formula"] == pytest.approx(bubble_formula(schedule, stages, M, V))
    assert abs(r["bubble"] - r["formula"]) <= 0.05 * r["formula"], r
    assert 0.9 <= r["useful_vs_expected"] <= 1.05, r


# ---------------------------------------------------------------------------------------
# Bad input: one line, exit 2


def _cli(corpus, *extra):
    model = [] if "mlp" in extra else ["--model", "gpt", "--d-model", "16", "--n-heads", "2", "--d-ff", "32"]
    return [*model, "--seq-len", "8", "--batch-size", "16", "--data", corpus, "--steps", "2", "--eval-every", "0",
            "--progress", "none", *extra]


@pytest.mark.parametrize("extra,needle", [
    (["--mesh", "stage=4,data=2", "--n-layers", "6"],
     "gpt has 6 layers, which do not split evenly into the 4 stages of mesh {'stage': 4, 'data': 2}: use a multiple "
     "of 4 layers"),
    (["--mesh", "stage=2,data=4", "--n-layers", "2", "--microbatches", "3"],
     "--microbatches 3 does not divide the per-replica batch of 4 sequences (--batch-size 16 over 4 data-parallel "
     "ranks)"),
    (["--mesh", "2x4", "--schedule", "gpipe"], "--schedule needs a stage axis: name one in --mesh, e.g. --mesh "
                                               "stage=2,data=4"),
    (["--mesh", "8x1", "--microbatches", "4"], "--microbatches needs a stage axis"),
    (["--mesh", "stage=2,data=4", "--virtual-stages", "2"], "--virtual-stages applies to --schedule interleaved"),
    (["--mesh", "stage=2,data=4", "--n-layers", "4", "--schedule", "interleaved", "--microbatches", "3"],
     "--microbatches 3 is not a multiple of 2"),
    (["--mesh", "stage=2,data=4", "--n-layers", "2", "--schedule", "interleaved"],
     "do not split evenly into the 2 stages x 2 virtual stages"),
    (["--mesh", "stage=2,data=4", "--model", "mlp"], "model mlp has no stack of layers to split over the stage axis"),
])
def test_bad_input_one_line(corpus, capsys, extra, needle):
    assert main(_cli(corpus, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
