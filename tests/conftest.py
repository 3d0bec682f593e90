"""Shared test setup: 8 simulated CPU devices, meshes over device subsets, compile caches.

XLA reads XLA_FLAGS once, when JAX initialises its backends, so the flag is set here,
before anything imports jax. Every test module then sees 8 CPU devices (whatever else
the machine has); tests that need more devices than exist skip.
"""

from __future__ import annotations

import os
import re

_COUNT_FLAG = "--xla_force_host_platform_device_count"
# Keep whatever flags the user set, but make the CPU device count ours: the suite is
# written for 8 devices and a second copy of the flag would make the result depend on
# XLA's parsing order.
_flags = re.sub(rf"{_COUNT_FLAG}=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
os.environ["XLA_FLAGS"] = " ".join([*_flags, f"{_COUNT_FLAG}=8"])

# A compile cache for the session, shared with the processes tests start: a resumed run
# compiles the program the interrupted one compiled (the cache key is the program, so a
# hit is the same executable). Fresh per session; removed at exit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="dpjax-test-jit-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

# Cheap machine code, the same program: the suite's models are tiny, so compiling is most of
# what a test costs, and on the CPU much of a compile is LLVM optimising the machine code.
# JAX's flag runs LLVM at -O0 and leaves every XLA pass as it is: the optimised HLO the tests
# read (collectives, bytes, fusions, memory) stays the same to the byte and losses stay
# bit-identical (no fast-math either way; checked on a tiny GPT's AdamW steps on 2x4 and 8x1),
# while a tiny GPT's step compiles in about half the CPU and runs a little slower. The
# processes tests start inherit it. Set it to 0 to test on LLVM's optimised code.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import dpjax  # noqa: E402
import tiers  # noqa: E402  (tests/tiers.py: which tests CI runs beyond the README's command)

# The 8 devices above are simulated through XLA_FLAGS, so their collectives get dpjax's guards by this
# explicit call (dpjax/collectives/cpu_runtime.py; `import dpjax` applies none): before JAX starts its CPU
# backend, which reads NPROC. The processes tests start inherit NPROC; dpjax.train applies both itself.
dpjax.cpu_guards()

NUM_DEVICES = 8


def _available_devices() -> list:
    """The devices tests run on: the default backend's if it has 8, else the CPU's."""
    devs = jax.devices()
    if len(devs) < NUM_DEVICES:
        devs = jax.devices("cpu")
    return devs


class CompileCache:
    """Memoises expensive things (jitted shard_maps, their results, compiled HLO) by key.

    Keys name what was built, e.g. ("allreduce", "ring", (("data", 5),)), so a program
    is traced and compiled once per session however many tests read it.
    """

    def __init__(self):
        self._store: dict = {}

    def get(self, key, build):
        if key not in self._store:
            self._store[key] = build()
        return self._store[key]


@pytest.fixture(scope="session")
def cache() -> CompileCache:
    return CompileCache()


@pytest.fixture(scope="session")
def devices() -> list:
    """All 8 test devices (skips the test if the machine cannot provide them)."""
    devs = _available_devices()
    if len(devs) < NUM_DEVICES:
        pytest.skip(f"needs {NUM_DEVICES} devices, have {len(devs)}")
    return devs[:NUM_DEVICES]


@pytest.fixture(scope="session")
def mesh_of(cache):
    """mesh_of(spec, count): `dpjax.make_mesh(spec, devices[:count])`, built once.

    A mesh over a subset of the devices is how the suite gets axis sizes 1..8 from
    one process with 8 devices.
    """

    def build(spec: str, count: int):
        devs = _available_devices()
        if len(devs) < count:
            pytest.skip(f"needs {count} devices, have {len(devs)}")
        return cache.get(("mesh", spec, count), lambda: dpjax.make_mesh(spec, devs[:count]))

    return build


@pytest.fixture(scope="session")
def put():
    """put(mesh, x, spec): places a host array the way shard_map's in_specs expect.

    This JAX refuses a jitted shard_map whose inputs are not already laid out to match.
    """

    def place(mesh, x, spec=P("data")):
        return jax.device_put(np.asarray(x), NamedSharding(mesh, spec))

    return place


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A 300 kB slice of the stdlib corpus as a text file, for end-to-end training runs."""
    from dpjax.data import load_corpus

    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(load_corpus("stdlib", max_bytes=300_000).tobytes())
    return str(path)


def pids_running(marker: str) -> list[int]:
    """The processes whose command line holds `marker` (a test's own temp path or script
    name): what a multi-process test checks is left behind, or picks its victim from."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if marker.encode() in fh.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def read_losses(path) -> list[float]:
    """Train losses of a `--metrics` file in step order, the last record of each step
    winning (a resumed run repeats the steps after its checkpoint)."""
    import json

    out = {}
    with open(path) as fh:
        for line in fh:
            rec = json.loads(line)
            if "loss" in rec:
                out[rec["step"]] = rec["loss"]
    return [out[s] for s in sorted(out)]


def tiny_gpt(corpus, *extra) -> list[str]:
    """`python -m dpjax.train` arguments of a tiny GPT (d_model 32, 1 layer, seq 16, batch
    16, SGD 0.1, no clipping, no evaluation, no progress) on `corpus`, then `extra`."""
    return ["--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads", "8", "--seq-len", "16",
            "--batch-size", "16", "--data", corpus, "--eval-every", "0", "--eval-batches", "1", "--progress", "none",
            "--optimizer", "sgd", "--lr", "0.1", "--clip-norm", "0", *extra]


def assert_resumes_bit_for_bit(args, tmp_path) -> None:
    """`python -m dpjax.train args`: 3 steps, a checkpoint, a restart to 6 give 6 straight
    steps' losses exactly."""
    from dpjax.train import main

    ckpt, path, straight = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "s.jsonl"
    base = [*args, "--ckpt-dir", str(ckpt), "--ckpt-every", "3", "--metrics", str(path)]
    assert main(base + ["--steps", "3"]) == 0
    assert main(base + ["--steps", "6", "--resume"]) == 0
    assert main([*args, "--steps", "6", "--metrics", str(straight)]) == 0
    assert len(read_losses(path)) == 6 and read_losses(path) == read_losses(straight)


def flat_algorithms(names) -> list[str]:
    """The algorithms of a registry view (`dpjax.collectives.ALGORITHMS`, ...) that run
    over one (flattened) axis, as the flat meshes' parametrisations need: not those
    whose axis is (outer, inner) levels ("hierarchical" has meshes of its own)."""
    from dpjax.collectives import registry

    return [a for a in names if not registry.get(a).nested_axes]


# Per-test cost, for finding what makes the suite slow: with DPJAX_TEST_COSTS=FILE, each test's
# wall seconds and CPU seconds (this process's threads plus the processes it waited for) are
# appended to FILE as JSON lines. CPU seconds are what ranks tests on a shared machine: other
# work inflates the wall time but not the CPU a test itself burns.
_COSTS = os.environ.get("DPJAX_TEST_COSTS")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _COSTS:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> float:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + kids.ru_utime + kids.ru_stime

    wall0, cpu0 = time.perf_counter(), cpu()
    yield
    rec = {"test": item.nodeid, "wall": time.perf_counter() - wall0, "cpu": cpu() - cpu0,
           "worker": os.environ.get("PYTEST_XDIST_WORKER")}
    with open(_COSTS, "a") as fh:
        fh.write(json.dumps(rec) + "\n")


def pytest_collection_modifyitems(config, items):
    """Mark the extended tier (tests/tiers.py): the README's command runs without it, CI with it."""
    for item in items:
        if tiers.extended(item.nodeid):
            item.add_marker(pytest.mark.extended)
    whole_files = not config.option.keyword and not any("::" in a for a in config.args)
    stale = tiers.stale([item.nodeid for item in items]) if whole_files else []
    if stale:
        raise pytest.UsageError(f"tests/tiers.py: {', '.join(stale)} match no collected test; "
                                "rename the pattern with its test")
