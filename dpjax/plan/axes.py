"""The plan's axes: the mesh the settings name, what runs on its named axes (the pipeline
on `stage`, emulated slow links on theirs), and the checks of the axes that split a
sequence (`context`) and a mixture's experts (`expert`). Part of `dpjax.plan`, made once
the devices are known. Each refusal is one line saying what to change."""

from __future__ import annotations

import jax

from dpjax.collectives.registry import nested
from dpjax.compression import Exchange, Form
from dpjax.links import parse_link
from dpjax.mesh import CONTEXT, EXPERT, STAGE, make_mesh
from dpjax.models.registry import MODELS
from dpjax.pipeline import SCHEDULES, Pipeline
from dpjax.pipeline import check as check_pipeline
from dpjax.plan.checks import UsageError, flag
from dpjax.settings import Settings


def check_context(s: Settings, model, mesh) -> None:
    """A context axis of C devices splits each sequence into 2C chunks (`dpjax.compute.context`):
    the sequence must divide, the model must be one whose loss splits its tokens (it says
    so with `CONTEXT = True`), and the axis composes with data, FSDP, tensor, worker and
    stage axes (a pipeline's stages send each device's chunks, `dpjax.pipeline.staged`),
    not with an allreduce that reads two axes as levels (the gradient's mean spans the
    context axis too)."""
    C = mesh.shape.get(CONTEXT, 1)
    if C == 1:
        return
    where = f"the context axis of mesh {dict(mesh.shape)}"
    if not model.CONTEXT:
        able = " or ".join(f"--model {e.name}" for e in MODELS.values() if e.build.CONTEXT)
        raise UsageError(f"--model {model.name} has no sequence to split over {where}; "
                         f"use {able} or drop the context axis")
    T = model.config.seq_len
    if T % (2 * C):
        raise UsageError(f"--seq-len {T} does not split into 2C = {2 * C} equal chunks over {where} (device i "
                         f"holds chunks i and {2 * C - 1}-i); use a multiple of {2 * C}")
    if nested(s.allreduce):
        raise UsageError(f"--allreduce {s.allreduce} reads two data axes as levels; with {where} the gradient's "
                         f"mean spans the context axis too: choose another algorithm")


def check_expert(s: Settings, model, mesh, update, exchange: Exchange, workers: tuple = ()) -> None:
    """An expert axis of n devices is a data axis (the batch's rows split over it) that
    also splits a mixture's E experts, E/n on each (`dpjax.models.moe`): the model must
    have E experts, n must divide E, and the experts, which differ along the axis, must
    not be averaged or gathered over it (FSDP splits and gathers only the other leaves,
    `dpjax.sharding`; the mean inside a worker skips `expert` for them, `dpjax.step`).
    An update rule whose workers diverge averages every leaf over the worker axes
    `workers` (its state is a worker's, per leaf): it composes when the workers leave
    `expert` out (e.g. --workers node), where each worker holds all E experts across its
    expert axis and the experts are replicas between workers. Refused: such a rule with
    workers spanning `expert` (its default workers are every data axis), --workers or
    --compress-axes naming it, compression with error feedback (its fused buckets would
    mix each device's own experts with the replicated leaves: a selection or scale per
    bucket then differs between replicas), --compress-axes' per-shard form (it splits a
    worker's gradient over its other data axes as if it were the same on each), and a
    stage or context axis beside it (none of these is built for experts yet)."""
    n = mesh.shape.get(EXPERT, 1)
    E = model.experts
    if E and (STAGE in mesh.axis_names or mesh.shape.get(CONTEXT, 1) > 1):
        raise UsageError(f"--experts {E} with a {'stage' if STAGE in mesh.axis_names else 'context'} axis in mesh "
                         f"{dict(mesh.shape)}: a mixture of experts does not run in a pipeline or over split "
                         f"sequences yet; drop one of them")
    if n == 1:
        return
    where = f"the expert axis of mesh {dict(mesh.shape)}"
    if not E:
        raise UsageError(f"{where} splits a mixture of experts: give the model experts (--experts E, a multiple "
                         f"of {n}) or name the axis data")
    if E % n:
        raise UsageError(f"--experts {E} do not split over the {n} devices of {where}; use a multiple of {n}")
    if EXPERT in str(s.workers or "") or EXPERT in str(s.compress_axes or ""):
        raise UsageError(f"{where} with --workers/--compress-axes naming it: each device's experts are its own, and "
                         f"workers over it would average them as replicas; name the other data axes")
    if exchange.form is not Form.PLAIN:
        raise UsageError(f"{where} with --compression {s.compression}: error feedback selects and scales over fused "
                         f"buckets holding each device's own experts beside the replicated leaves, so the replicas "
                         f"would diverge; drop one of them")
    if EXPERT in tuple(workers) and not update.is_sync:
        raise UsageError(f"{where} with --update {s.update}: its workers are every data axis, and averaging between "
                         f"them would average each device's own experts as replicas; give --workers without expert "
                         f"(e.g. the other data axes)")
    if s.compress_axes is not None and not (s.compress_whole or s.fsdp):  # plan.per_shard's form
        raise UsageError(f"{where} with --compress-axes {s.compress_axes}: the per-shard exchange splits a worker's "
                         f"gradient over the expert axis as if its devices held the same experts; add "
                         f"--compress-whole")


def mesh_of(s: Settings, devices=None):
    """The mesh settings `s` name on `devices` (default: every device; no --mesh: all data)."""
    devs = list(jax.devices() if devices is None else devices)
    return make_mesh(s.mesh or f"{len(devs)}x1", devs)


def pipeline_of(s: Settings, model, mesh, exchange: Exchange):
    """The pipeline a stage axis runs (its schedule, micro-batches and chunks), or None;
    the pipeline's flags without a stage axis are refused."""
    given = [flag(n) for n in ("schedule", "microbatches", "virtual_stages") if getattr(s, n) is not None]
    if STAGE not in mesh.axis_names:
        if given:
            raise UsageError(f"{', '.join(given)} needs a stage axis: name one in --mesh, e.g. "
                             f"--mesh stage=2,data={max(1, mesh.size // 2)}")
        return None
    schedule = s.schedule or "1f1b"  # a chunked schedule (interleaved) defaults to 2 chunks a stage
    chunks = s.virtual_stages or (2 if SCHEDULES[schedule].virtual_stages else 1)
    pipeline = check_pipeline(model, mesh, Pipeline(schedule, s.microbatches, chunks))
    if exchange.form is Form.FSDP:
        raise UsageError(f"--fsdp with --compression {s.compression} and a stage axis: the pipeline gathers the "
                         "stage's parameters itself; compress only between sites (--workers node "
                         "--compress-axes node)")
    return pipeline


def links_of(s: Settings, mesh) -> tuple:
    """The emulated slow links, each on an axis the mesh has."""
    links = tuple(parse_link(text) for text in s.link or ())
    for link in links:
        if link.axis not in mesh.axis_names:
            raise UsageError(f"--link {link}: mesh {dict(mesh.shape)} has no axis {link.axis!r}")
    return links
