"""The harness of tests/test_pipeline.py: the timetable walk (every slot in dependency
order, stash slots never overwritten while live) and the training set-up the tests
share (the tiny GPT, its one-device reference, the pipelined step, the cases).
"""

from __future__ import annotations

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
from dpjax.pipeline import SCHEDULES, bubble_formula
from dpjax.sharding import make_layout

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
        live = sum(1 for m2, r2 in itertools.product(range(M), range(V))
                   if ev["F", m2, r2, s] <= f <= ev["B", m2, r2, s])
        live_max = max(live_max, live)
    assert live_max <= tt.stash_slots
    assert tt.bubble() == pytest.approx(bubble_formula(tt.name, S, M, V), abs=1e-12)
    return live_max



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
    from dpjax.compression import Exchange

    model = tiny(n_layers)
    layout = make_layout(model, mesh, pipeline=pipe, fsdp=fsdp, workers=workers, fsdp_algorithm=algorithm)
    step = S.for_model(model, layout, global_batch=B, opt=RecordingSGD(), donate=False, update=update,
                       exchange=Exchange(algorithm))
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
