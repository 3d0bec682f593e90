"""Pipeline parallelism over a `stage` axis (dpjax.pipeline), against independent references.

- the timetables, walked tick by tick in plain Python: every forward and backward once,
  in dependency order, stash slots never overwritten while live, the bubble as the
  papers state it;
- the pipelined loss and gradients against `jax.value_and_grad` of the unpipelined GPT;
- training: 10 SGD steps (no clipping: a wrong scale shows) on stage=2,data=4,
  stage=4,data=2, stage=2,data=2,model=2 and stage=8 equal `--mesh 1x1`, for every
  schedule; with an update rule, FSDP, every allreduce; resume on another stage count;
- memory from compiled programs: parameters and optimizer state 1/S of the layers' per
  device, 1F1B's temporaries flat in M where GPipe's grow; the bubble from FLOPs;
- bad input: one line, exit 2.
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
from dpjax.pipeline import SCHEDULES, Pipeline, bubble_formula, cost, staged, timetable
from dpjax.sharding import make_layout
from dpjax.train import main

from conftest import read_losses

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


@pytest.mark.parametrize("schedule", ["naive", "gpipe", "1f1b"])
def test_timetables(schedule):
    for S, M in GRID:
        live = check_timetable(timetable(Pipeline(schedule, M), S))
        if schedule == "1f1b":
            assert live == min(M, 2 * S - 1)  # bounded by the stages, not by M
        else:
            assert live == M  # every micro-batch's input, until the backwards begin


def test_interleaved_timetable():
    for S, V in itertools.product((1, 2, 3, 4), (1, 2, 3, 4)):
        live = {}
        for g in (1, 2, 4):
            tt = timetable(Pipeline("interleaved", g * S, V), S)
            assert tt.ticks == V * g * S + V * S + S - 2
            live[g] = check_timetable(tt)
        assert live[2] == live[4] <= 2 * S * V - 1  # bounded by the stages and chunks, not by M
    for S, M in GRID:  # one chunk per stage is 1F1B, slot for slot
        a, b = timetable(Pipeline("interleaved", M, 1), S), timetable(Pipeline("1f1b", M), S)
        assert a.phases == b.phases and walk(a) == walk(b)
        assert all(a.stash_slot(m, 0, s) == b.stash_slot(m, 0, s) for m in range(M) for s in range(S))


# ---------------------------------------------------------------------------------------
# Training on each mesh with every schedule against the unpipelined model on one device:
# the first step's gradients, then 10 SGD steps' losses


STEPS, B, LR = 10, 16, 0.1
MESHES = {"stage=2,data=4": 8, "stage=4,data=2": 8, "stage=2,data=2,model=2": 8, "stage=8": 8}
CHEAP = {("naive", "stage=2,data=4"), ("gpipe", "stage=4,data=2"), ("1f1b", "stage=2,data=2,model=2"),
         ("interleaved", "stage=2,data=4")}


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


def pipelined_run(mesh, n_layers, pipe, steps=STEPS, **kw):
    """(gradient of the first step, losses) of the pipelined sync step on `mesh`."""
    from dpjax import step as S

    model = tiny(n_layers)
    layout = make_layout(model, mesh, pipeline=pipe, **{k: v for k, v in kw.items() if k in ("fsdp", "workers")})
    step = S.for_model(model, layout, global_batch=B, opt=RecordingSGD(), donate=False,
                       **{k: v for k, v in kw.items() if k in ("update", "exchange")})
    params, state = step.init(placed(layout, n_layers))
    losses, first = [], None
    for batch in train_batches(steps):
        on_mesh = jax.device_put(batch[None], NamedSharding(mesh, P(None, data_axes(mesh) or None)))
        params, state, loss = step.train(params, state, on_mesh)
        if first is None:
            first = layout_to_model(jax.tree.map(np.asarray, state[0]), pipe)
        losses.append(float(loss))
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


def training_cases():
    for schedule, spec in itertools.product(SCHEDULES, MESHES):
        marks = () if (schedule, spec) in CHEAP else (pytest.mark.slow,)
        yield pytest.param(schedule, spec, marks=marks, id=f"{schedule}|{spec}")


@pytest.mark.parametrize("schedule,spec", training_cases())
def test_pipeline_equals_one_device(mesh_of, schedule, spec):
    """One layer per chunk (S*V layers), twice as many micro-batches as stages where the
    replica's rows allow (else one per stage): the first step's gradient (every leaf, the
    shared embedding and the stages' layers) is the unpipelined model's, and 10 steps of
    SGD give its losses."""
    mesh = mesh_of(spec, MESHES[spec])
    S, V = mesh.shape["stage"], 2 if schedule == "interleaved" else 1
    rows = B // math.prod(mesh.shape[a] for a in data_axes(mesh))
    M = 2 * S if rows % (2 * S) == 0 else S
    grads, losses = pipelined_run(mesh, S * V, Pipeline(schedule, M, V))
    want_grads, want_losses = one_device(S * V)
    assert_gradients_equal(grads, want_grads)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5, atol=0)
