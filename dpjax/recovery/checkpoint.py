"""Checkpoints with orbax: the training state as global arrays, plus a JSON record.

The state (parameters, optimizer state, RNG key data) is saved as global arrays, so
it can be restored onto any mesh: the restore target's shardings decide the layout.
The JSON record holds the step, the data position and the configuration that must
match for a resume to be meaningful (the model and the optimizer); a checkpoint made
with another configuration is refused with the differences named. It also keeps what a
run chose for itself and a resumed run should keep rather than choose again: the
autotuned exchange (`"autotune"`: the allreduce algorithm, the fusion cap, the measured
gain; `dpjax.train.autotune`), which need not match and is not checked.
"""

from __future__ import annotations

import os

from dpjax.errors import UserError

CKPT_FIELDS_THAT_MUST_MATCH = ("model", "optimizer")
WHY = {  # a field whose difference needs its reason said
    "optimizer.compression_model_split": "the compression state is shaped by these axes (PowerSGD keeps one Q "
                                          "per tensor-parallel or pipeline shard; under FSDP each device keeps a "
                                          "full-size error buffer; per shard, each device keeps its shard's): "
                                          "resume with the same axis sizes, or compress with --compress-whole",
}


RUN_FILE = "run.json"  # a run's record beside its checkpoints (dpjax.train.record writes it; hf export reads it)


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message says why and what to do."""


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: int = 3):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = os.path.abspath(directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint path {directory!r} is a file, not a folder; pass a folder")
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def clear(self) -> None:
        """Removes every checkpoint here (--overwrite: a fresh run replacing another's)."""
        for step in self._manager.all_steps():
            self._manager.delete(step)

    def save(self, step: int, state, record: dict) -> None:
        ocp = self._ocp
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)), force=True)

    def read_record(self, step: int | None = None) -> dict:
        ocp = self._ocp
        step = self._pick(step)
        try:
            return self._manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore())).record
        except Exception as e:  # orbax raises many kinds; all mean the same to a user
            raise CheckpointError(self._unreadable(step, e)) from None

    def restore(self, abstract_state, step: int | None = None, expect: dict | None = None):
        """(state, record) of `step` (default: the latest), laid out like `abstract_state`.

        `expect`: the current run's record; a saved record whose model or optimizer
        differs is refused before any array is read.
        """
        ocp = self._ocp
        step = self._pick(step)
        record = self.read_record(step)
        if expect is not None:
            check_compatible(record, expect, f"{self.directory}/{step}")
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))
        except Exception as e:
            raise CheckpointError(self._unreadable(step, e)) from None
        return out.state, record

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def _pick(self, step):
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        return step

    def _unreadable(self, step, e: Exception) -> str:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return (f"checkpoint {self.directory}/{step} cannot be read ({type(e).__name__}: {first}); "
                "it may be corrupt or from another configuration: delete it or pass another --ckpt-dir")


def compression_split(compression, mesh, fsdp: bool = False, shards=None) -> dict:
    """The mesh axis sizes the compression state's shapes depend on, {} for none: the
    model and stage sizes for a method with state of its own (PowerSGD's Q, one per
    shard); under FSDP with error feedback, every axis (one full-size buffer a device);
    in the per-shard form (`shards`), the axes of its slots (a device's own shard)."""
    from dpjax.compression import parse
    from dpjax.mesh import NOT_DATA

    spec = parse(compression)
    if spec is None:
        return {}
    if fsdp and spec.method.stateful and spec.ef:
        return dict(mesh.shape)
    if shards is not None and spec.method.stateful:
        return {a: mesh.shape[a] for a in shards.slot}
    if spec.method.init is None:
        return {}
    return {a: n for a, n in mesh.shape.items() if a in NOT_DATA and n > 1}


# Record keys added after checkpoints were made without them, and the value those runs had:
# a checkpoint that lacks one resumes where the current run has that value.
ADDED_LATER = {"optimizer": {"lr_schedule": "constant", "min_lr": 0.0, "decay_start": None, "decay_steps": 0}}


def check_compatible(saved: dict, now: dict, where: str) -> None:
    diffs = []
    for field in CKPT_FIELDS_THAT_MUST_MATCH:
        a, b = saved.get(field), now.get(field)
        if isinstance(a, dict) and field in ADDED_LATER:
            a = {**ADDED_LATER[field], **a}
        if a != b:
            if isinstance(a, dict) and isinstance(b, dict):
                diffs += [f"{field}.{k}: saved {a.get(k)!r}, now {b.get(k)!r}"
                          + (f" ({WHY[f'{field}.{k}']})" if f"{field}.{k}" in WHY else "")
                          for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            else:
                diffs.append(f"{field}: saved {a!r}, now {b!r}")
    if diffs:
        raise CheckpointError(f"checkpoint {where} was made with another configuration "
                              f"({'; '.join(diffs)}); resume with the same settings or pass another --ckpt-dir")

