"""Checkpoints with orbax: the training state as global arrays, plus a JSON record.

The state (parameters, optimizer state, RNG key data) is saved as global arrays, so
it can be restored onto any mesh: the restore target's shardings decide the layout.
The JSON record holds the step, the data position and the configuration that must
match for a resume to be meaningful (the model and the optimizer); a checkpoint made
with another configuration is refused with the differences named. It also keeps what a
run chose for itself and a resumed run should keep rather than choose again: the
autotuned exchange (`"autotune"`: the allreduce algorithm, the fusion cap, the measured
gain; `dpjax.train.autotune`), which need not match and is not checked.

Every step is sealed once orbax has finalised it: a manifest of its files' checksums
(`dpjax.recovery.sums`), written by process 0 on a thread of its own after the save's
background write ends, so the steps never wait for it. A restore verifies a step before
orbax reads it: a corrupt or cut-short newest step is named in one line (stderr) and the
one before it is used. A save the filesystem refuses (full, read-only) stops the run
with one line; the steps saved before it stay as they were.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading

import jax

from dpjax.errors import UserError
from dpjax.recovery import sums

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


class Unreadable(CheckpointError):
    """A step orbax could not read."""


class NoneGood(CheckpointError):
    """Every checkpoint in the folder is corrupt (each fails its checksums)."""


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: int = 3):
        # here, not at the top: orbax's import takes seconds, and `import dpjax` (whose
        # dpjax.hf names this module) should not pay it before a checkpoint is opened
        import orbax.checkpoint as ocp

        self._ocp = ocp
        for name in ("absl", "asyncio"):  # orbax's loggers, and asyncio's for its writer's futures
            if _QUIET not in logging.getLogger(name).filters:
                logging.getLogger(name).addFilter(_QUIET)
        self.directory = os.path.abspath(directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint path {directory!r} is a file, not a folder; pass a folder")
        try:
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
            )
        except OSError as e:
            raise CheckpointError(f"checkpoint folder {directory!r} cannot be used ({_why(e)})") from None
        self._sealer: threading.Thread | None = None
        self._failed: tuple | None = None  # (step, error) of a save that failed on the sealing thread
        self._saving: int | None = None  # the step of the newest save asked for
        self._refusal: CheckpointError | None = None  # a write the filesystem refused, once said

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def clear(self) -> None:
        """Removes every checkpoint here (--overwrite: a fresh run replacing another's)."""
        for step in self._manager.all_steps():
            self._manager.delete(step)

    def save(self, step: int, state, record: dict) -> None:
        ocp = self._ocp
        self._settle()
        self._saving = step
        try:
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)), force=True)
        except Exception as e:
            raise self._refused(step, e) from None
        if jax.process_index() == 0:  # the others' files are in the same folder (orbax needs that)
            self._sealer = threading.Thread(target=self._seal, args=(step,), daemon=True, name="dpjax-ckpt-seal")
            self._sealer.start()

    def _seal(self, step: int) -> None:
        """Waits for orbax to finalise the save, then writes the manifests it lacks."""
        try:
            self._manager.wait_until_finished()
            steps = sorted(int(n) for n in os.listdir(self.directory)  # its own list has the step asked for
                           if n.isdigit() and os.path.isdir(os.path.join(self.directory, n)))
            if step not in steps:  # orbax logged a refused write from one of its threads and went on
                _probe(self.directory)
                raise CheckpointError(f"checkpoint {self.directory}/{step} was not finished by orbax")
            for s in steps:
                if not sums.sealed(self.directory, s):
                    sums.seal(self.directory, s)
            sums.prune(self.directory, steps)
        except BaseException as e:  # said by the loop's thread, at the next save or close
            self._failed = (step, e)

    def _settle(self) -> None:
        """Joins the previous save's sealing; its failure stops the run with one line."""
        if self._sealer is not None:
            self._sealer.join()
            self._sealer = None
        if self._failed is not None:
            (step, e), self._failed = self._failed, None
            raise self._refused(step, e)

    def _refused(self, step: int, e: BaseException) -> Exception:
        """A save that failed: one line for a filesystem's refusal, else the error itself (a bug)."""
        if _errno(e) is None:
            return e
        if self._refusal is not None:
            return self._refusal
        good = [s for s in self._manager.all_steps() if s != step and sums.problem(self.directory, s) is None]
        kept = f"the last good one is {self.directory}/{max(good)}" if good else "no earlier checkpoint was kept"
        self._refusal = CheckpointError(f"checkpoint {self.directory}/{step} cannot be written ({_why(e)}); {kept}")
        return self._refusal

    def read_record(self, step: int | None = None) -> dict:
        ocp = self._ocp
        step = self._pick(step)
        try:
            return self._manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore())).record
        except Exception as e:  # orbax raises many kinds; all mean the same to a user
            raise Unreadable(self._unreadable(step, e)) from None

    def restore(self, abstract_state, step: int | None = None, expect: dict | None = None):
        """(state, record) of `step` (default: the latest), laid out like `abstract_state`.

        `expect`: the current run's record; a saved record whose model or optimizer
        differs is refused before any array is read.
        """
        if step is not None:
            return self._restore(abstract_state, step, expect)
        good = self.good_steps()
        for i, s in enumerate(good):
            try:
                return self._restore(abstract_state, s, expect)
            except Unreadable as e:  # an unverified step orbax cannot read: the one before it
                if sums.problem(self.directory, s) != sums.UNSEALED or i + 1 == len(good):
                    raise
                print(f"dpjax.recovery: {e}; passed over", file=sys.stderr, flush=True)
        return self._restore(abstract_state, self._pick(None), expect)  # the one line for none

    def _restore(self, abstract_state, step: int, expect: dict | None):
        ocp = self._ocp
        record = self.read_record(step)
        if expect is not None:
            check_compatible(record, expect, f"{self.directory}/{step}")
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))
        except Exception as e:
            raise Unreadable(self._unreadable(step, e)) from None
        return out.state, record

    def restore_part(self, step: int, part: dict) -> dict:
        """The part of `step`'s saved state that `part` names (a sub-tree of abstract arrays
        with their shardings), the rest left on disk: `--init-from`'s parameters without the
        optimizer state. Raises what orbax raises."""
        ocp = self._ocp
        part_args = ocp.args.PyTreeRestore(part, restore_args=ocp.checkpoint_utils.construct_restore_args(part),
                                           partial_restore=True)
        return self._manager.restore(step, args=ocp.args.Composite(state=part_args)).state

    def stored_metadata(self, step: int, key: str):
        """The metadata (shapes, dtypes) of `step`'s saved state under `key`, read without
        its arrays; None where the step has none (an older layout)."""
        absl = logging.getLogger("absl")
        level = absl.level
        absl.setLevel(logging.ERROR)  # orbax warns that a step's own metadata file is absent (dpjax writes none)
        try:
            state = os.path.join(self.directory, str(step), "state")
            return self._ocp.StandardCheckpointer().metadata(state).item_metadata[key]
        except Exception:
            return None
        finally:
            absl.setLevel(level)

    def close(self) -> None:
        """Waits for the last save and its seal. A refused write is said once: closing
        after it (the run stopping on its line) says nothing more."""
        try:
            said = self._refusal is not None  # before this close
            self._settle()
            self._manager.wait_until_finished()
        except CheckpointError:
            raise
        except Exception as e:
            err = self._refused(self._saving, e)
            if not (said and err is self._refusal):
                raise err from None
        finally:
            if self._refusal is None:  # after a refusal orbax's closing races its writer's callbacks
                self._manager.close()  # into a closed event loop (tracebacks): the process ends anyway

    def _pick(self, step):
        if step is not None:
            return step
        if self.latest_step() is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        return self.good_steps(1)[0]

    def newest_good(self) -> int:
        """The newest step that verifies (a corrupt newer one named and passed over)."""
        return self._pick(None)

    def good_steps(self, want: int | None = None) -> list:
        """The steps here, newest first, that verify (or carry no checksums: said in one
        line); a corrupt one is named in one line (stderr) and passed over; none left: one
        CheckpointError line naming the newest. want: stop once that many are found."""
        out, corrupt = [], []
        for step in sorted(self._manager.all_steps(), reverse=True):
            why = sums.problem(self.directory, step)
            if why == sums.UNSEALED:
                print(f"dpjax.recovery: checkpoint {self.directory}/{step} is not verified: {why}",
                      file=sys.stderr, flush=True)
            elif why is not None:
                corrupt.append(f"checkpoint {self.directory}/{step} is corrupt: {why}")
                continue
            out.append(step)
            if want is not None and len(out) >= want:
                break
        if not out and corrupt:
            raise NoneGood(f"{corrupt[0]}; no good checkpoint is left in {self.directory} "
                                  f"({len(corrupt)} corrupt: python -m dpjax.recovery verify lists them)")
        for line in corrupt:
            print(f"dpjax.recovery: {line}; passed over", file=sys.stderr, flush=True)
        return out

    def _unreadable(self, step, e: Exception) -> str:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return (f"checkpoint {self.directory}/{step} cannot be read ({type(e).__name__}: {first}); "
                "it may be corrupt or from another configuration: delete it or pass another --ckpt-dir")


def _probe(directory: str) -> None:
    """Raises the OSError the filesystem gives a small write in `directory`, if any."""
    path = os.path.join(directory, f".dpjax-probe{os.getpid()}")
    try:
        with open(path, "wb") as fh:
            fh.write(b"\0" * 65536)
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        if os.path.exists(path):
            os.remove(path)


def _errno(e: BaseException) -> int | None:
    """The filesystem's error number of a failed write: an OSError's, or the one
    tensorstore (orbax's writer) puts in its ValueError's text; None for anything else."""
    if isinstance(e, OSError):
        return e.errno or 0
    found = re.search(r"os_error_code='?(\d+)", str(e))
    return int(found.group(1)) if found else None


def _why(e: BaseException) -> str:
    """A failed write in a few words: the filesystem's reason, not its traceback."""
    n = _errno(e)
    return os.strerror(n) if n else f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"


class _QuietFilesystemErrors(logging.Filter):
    """Orbax logs a write the filesystem refused from each of its threads, with tracebacks
    (853 lines for one full disk); the run says it in one line instead (`_refused`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else "")
        return not any(mark in text for mark in FILESYSTEM_REFUSALS)


FILESYSTEM_REFUSALS = ("os_error_code=", "No space left on device", "Read-only file system", "Permission denied",
                       "Disk quota exceeded")
_QUIET = _QuietFilesystemErrors()


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

