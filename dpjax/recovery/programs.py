"""Compiled programs kept across restarts: a restarted process loads its programs'
executables from disk instead of tracing, lowering and compiling them again.

Why not JAX's persistent compilation cache alone (which the agent also sets): it is keyed
by the lowered module, so even a hit costs the tracing and lowering of every program, and
on CPU (jax 0.10.2) its key holds the process's own device topology while only process 0
writes entries, so processes 1.. of a multi-process CPU job never hit it and compile every
program again on each restart (measured: 30 s of each restarted process's 37 s, ranks 1-3
of the issue's 4-process job; `experiments/RESULTS.md`).

`Programs(folder, run)` keys every program by `run` (what the caller says makes the
programs: the run's settings), this process's place in the job (index, count, devices),
the software (jax, jaxlib, every dpjax source file, XLA_FLAGS, JAX's config) and the
program's name and argument shapes, dtypes and shardings; any change makes another key,
and a file that cannot be loaded is compiled again. `keep(name, jitted)` returns a
callable that behaves as `jitted` for arguments of one signature each.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pickle
import sys
import threading

import jax
import jaxlib
from jax.experimental import serialize_executable

from dpjax import distributed


_from_cache = threading.local()  # this thread's count of JAX persistent-cache hits


def _count_cache_hits(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _from_cache.n = getattr(_from_cache, "n", 0) + 1


@functools.cache
def _listen() -> None:
    jax.monitoring.register_event_listener(_count_cache_hits)


@functools.cache
def _sources() -> str:
    """A digest of dpjax's own source files (its models' among them): a changed line is another program."""
    h = hashlib.sha256()
    for base, dirs, files in sorted(os.walk(os.path.dirname(os.path.abspath(__file__)))):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                with open(os.path.join(base, f), "rb") as fh:
                    h.update(f.encode() + fh.read())
    return h.hexdigest()


def _environment() -> dict:
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": sys.version,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "dpjax": _sources(),
            "config": sorted((k, repr(v)) for k, v in jax.config.values.items()),
            "process": [jax.process_index(), jax.process_count()],
            "devices": [(d.id, d.process_index, d.platform, d.device_kind) for d in jax.devices()]}


def _signature(args) -> str:
    """What the compiled program depends on in its arguments."""
    def leaf(x):
        sharding = getattr(x, "sharding", None)
        spec = getattr(sharding, "spec", None)
        mesh = getattr(sharding, "mesh", None)
        where = repr(sharding) if mesh is None else (repr(spec), dict(mesh.shape), [d.id for d in mesh.devices.flat])
        return [getattr(x, "shape", None), str(getattr(x, "dtype", type(x).__name__)), getattr(x, "weak_type", None),
                where]

    leaves, tree = jax.tree.flatten(args)
    return json.dumps([str(tree), [leaf(x) for x in leaves]], default=str)


class Programs:
    """A folder of this process's compiled programs for one run (see the module's text).
    An executable that JAX loaded from its persistent compilation cache serialises without
    all of its code on CPU (jax 0.10.2: a kept copy fails when run, `Function ... not
    found`), so a program is kept only when it was compiled here: made before the process
    compiles anything (as `dpjax.train` does), this turns JAX's cache off in the process
    (JAX decides once, at its first compile); where the cache was already in use, a
    program that came from it is not kept (JAX's monitoring events say so)."""

    def __init__(self, folder: str, run):
        jax.config.update("jax_enable_compilation_cache", False)
        _listen()
        self.folder, self.run = folder, run
        self.loaded = self.compiled = 0  # programs loaded from the folder / compiled here

    @functools.cached_property
    def key(self) -> str:  # at the first program: after jax.distributed has started
        return hashlib.sha256(json.dumps([self.run, _environment()], default=str, sort_keys=True).encode()).hexdigest()

    def keep(self, name: str, jitted) -> "Kept":
        return Kept(self, name, jitted)

    def path(self, name: str, signature: str) -> str:
        digest = hashlib.sha256(f"{self.key}\n{name}\n{signature}".encode()).hexdigest()[:32]
        return os.path.join(self.folder, f"{name}-{digest}.bin")

    def load(self, path: str):
        try:
            with open(path, "rb") as fh:
                blob, in_tree, out_tree, device_ids = pickle.load(fh)
            by_id = {d.id: d for d in jax.devices()}
            compiled = serialize_executable.deserialize_and_load(blob, in_tree, out_tree,
                                                                 execution_devices=[by_id[i] for i in device_ids])
        except FileNotFoundError:
            return None
        except Exception as e:  # another jaxlib's bytes, a torn file: compile instead, and say so
            print(f"dpjax.recovery.programs: {os.path.basename(path)} could not be loaded ({type(e).__name__}: {e}); "
                  "compiling it again", file=sys.stderr, flush=True)
            return None
        return compiled

    def store(self, path: str, compiled) -> None:
        self.compiled += 1
        try:
            # the devices it runs on, in its device assignment's order (a program on a
            # subset of the devices must be loaded onto that subset)
            device_ids = [d.id for d in compiled._executable._unloaded_executable.device_list]
            blob = pickle.dumps((*serialize_executable.serialize(compiled), device_ids))
        except (ValueError, NotImplementedError, pickle.PicklingError):  # e.g. host callbacks: not kept
            return
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            os.makedirs(self.folder, exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(blob)
            os.replace(tmp, path)
        except OSError as e:  # a full or read-only folder: a cache, not the run's state; compiled next time
            with contextlib.suppress(OSError):
                os.remove(tmp)
            print(f"dpjax.recovery.programs: {os.path.basename(path)} not kept in {self.folder} "
                  f"({os.strerror(e.errno) if e.errno else e}); a restart compiles it again", file=sys.stderr,
                  flush=True)


class Kept:
    """`jitted`, whose executable for each argument signature is loaded from the folder
    when there, else compiled (as jit would) and written there."""

    def __init__(self, programs: Programs, name: str, jitted):
        self.programs, self.name, self.jitted = programs, name, jitted
        self._by_signature: dict = {}
        functools.update_wrapper(self, jitted)

    def compiled(self, *args):
        """The executable for these arguments (arrays or ShapeDtypeStructs)."""
        leaves, tree = jax.tree.flatten(args)
        quick = (tree, tuple((getattr(x, "shape", None), getattr(x, "dtype", type(x)), getattr(x, "sharding", None),
                              getattr(x, "weak_type", None)) for x in leaves))
        if quick not in self._by_signature:
            path = self.programs.path(self.name, _signature(args))
            compiled = self.programs.load(path)
            # loaded by every process or by none: one that traces it (its folder lost, a torn file) makes
            # its collectives' agreement (`distributed.agree`), which a process that loaded would never join
            if not distributed.every(f"{self.name}: kept program loaded", compiled is not None):
                compiled = None
            if compiled is not None:
                self.programs.loaded += 1
            else:
                hits = getattr(_from_cache, "n", 0)
                compiled = self.jitted.lower(*args).compile()
                if getattr(_from_cache, "n", 0) == hits:  # compiled here, not loaded from JAX's cache
                    self.programs.store(path, compiled)
            self._by_signature[quick] = compiled
        return self._by_signature[quick]

    def __call__(self, *args):
        return self.compiled(*args)(*args)

    def lower(self, *args):
        """As jit's `lower(...)`, for callers that read the compiled program
        (`.lower(...).compile()`): the kept executable, no tracing."""
        return _Lowered(self.compiled(*args))


class _Lowered:
    def __init__(self, compiled):
        self._compiled = compiled

    def compile(self):
        return self._compiled
