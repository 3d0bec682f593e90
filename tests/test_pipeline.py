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
import itertools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.models import get_model
from dpjax.pipeline import SCHEDULES, Pipeline, bubble_formula, timetable
from dpjax.plan import pipeline_cost as cost
from dpjax.sharding import make_layout
from dpjax.train import main

from pipeline_harness import (B, LR, MESHES, assert_gradients_equal, built, check_timetable, initial, microbatches,
                              one_device, pipelined_run, placed, tiny, train, train_batches, training_cases, walk)

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
    pytest.param(a, "stage=2,data=4", id=a, marks=pytest.mark.slow)
    for a in ("psum", "ring", "butterfly", "tree", "ps")]


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
    from dpjax.recovery.checkpoint import Checkpointer

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
