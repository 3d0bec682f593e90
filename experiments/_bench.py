"""Shared by the experiment scripts: devices, interleaved timing, statistics, tables,
run headers and the smoke mode. Not a library: the scripts import it as a sibling module
(`python experiments/X.py` puts experiments/ first on sys.path).

Timing is interleaved because the machines these scripts run on are shared: each round
runs one step of every variant (the starting variant rotating), every step awaited, so
load from other processes hits every variant alike within a round; the paired ratio
(the median over rounds of a variant's time over the baseline's in the same round)
cancels load that drifts between rounds. The bus-bandwidth factor is not here: it is
`dpjax.collectives.cost.bus_factor`.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def checkout_env(environ=None) -> dict:
    """The environment for a child process that imports this checkout's dpjax first (the way
    the RESULTS.md commands run it), whatever else PYTHONPATH holds."""
    env = dict(os.environ if environ is None else environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def train(args: list[str], metrics: str, timeout: float = 3600) -> None:
    """`python -m dpjax.train ARGS --metrics METRICS` as a child process on this checkout's dpjax
    (from the checkout's root), as the RESULTS.md runs of a task are made; its last line of
    output printed. A failed run raises with the command and the tail of its stderr."""
    cmd = [sys.executable, "-m", "dpjax.train", *args, "--metrics", metrics]
    r = subprocess.run(cmd, capture_output=True, text=True, env=checkout_env(), cwd=ROOT, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
    print(r.stdout.strip().splitlines()[-1], flush=True)


median = statistics.median


# ---------------------------------------------------------------------------------------
# Devices


def simulate(n: int) -> None:
    """`n` simulated CPU devices; call before anything imports jax (it only shapes the
    CPU backend: a GPU host keeps its GPUs)."""
    from dpjax.collectives.cpu_runtime import simulate_cpu_devices

    simulate_cpu_devices(n)


def mpirun(command: list[str], n: int, smoke: bool = False) -> int:
    """Runs `command` as n processes of one MPI world (Open MPI's mpirun, one simulated
    CPU device each): what `--collectives mpi` needs (dpjax.distributed.transport). Where
    MPIwrapper or mpirun is missing: one line, and exit 0 in a smoke run (skipped), 2
    otherwise."""
    import shutil

    from dpjax.distributed import transport

    why = transport.problem("mpi") or (None if shutil.which("mpirun") else
                                       "--collectives mpi starts its processes with mpirun, which is not installed "
                                       "(Debian: apt-get install openmpi-bin)")
    if why:
        print(f"{'skipped' if smoke else 'error'}: {why}", file=sys.stdout if smoke else sys.stderr)
        return 0 if smoke else 2
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")).strip()
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return subprocess.run(["mpirun", "-np", str(n), "--oversubscribe", *root, *command], env=env).returncode


def pick_devices(n: int, platform_name: str = "auto"):
    """n devices: of `platform_name`, or with "auto" the default backend's if it has
    enough (a GPU host), else the CPU ones. Exits with one line when there are too few."""
    import jax

    if platform_name == "auto":
        devs = jax.devices()
        if len(devs) < n:
            devs = jax.devices("cpu")
    else:
        try:
            devs = jax.devices(platform_name)
        except RuntimeError as e:
            raise SystemExit(f"error: no {platform_name!r} backend: {e}") from None
    if len(devs) < n:
        raise SystemExit(f"error: the run needs {n} devices, {devs[0].platform} has {len(devs)}")
    return devs[:n]


# ---------------------------------------------------------------------------------------
# Timing and statistics


def interleave(steps: dict, rounds: int, warmup: int = 0, rotate: bool = True, after_round=None) -> dict:
    """{name: [seconds per call]} of `rounds` interleaved rounds: each round calls every
    `steps[name](i)` once (i: the round, or the warm-up call's index), in order, the
    starting name rotating each round when `rotate`. Each step must await its own
    result (the CPU backend deadlocks with ~40+ collective programs in flight, and an
    awaited step is what is timed); a step that returns a float reports its own seconds
    instead (to leave out preparing its input). The garbage collector is off while
    timing. after_round(r): called after each round, untimed."""
    names = list(steps)
    for i in range(warmup):
        for name in names:
            steps[name](i)
    times = {name: [] for name in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            k = r % len(names) if rotate else 0
            for name in names[k:] + names[:k]:
                t0 = time.perf_counter()
                own = steps[name](r)
                times[name].append(own if isinstance(own, float) else time.perf_counter() - t0)
            if after_round is not None:
                after_round(r)
    finally:
        gc.enable()
    return times


def quantile(xs, q: float) -> float:
    """The q-quantile of xs, linear between the closest ranks (numpy's default)."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def paired_ratio(times, base_times) -> float:
    """The median over rounds of times[r] / base_times[r]: same-round ratios cancel load
    that drifts between rounds."""
    return median(t / b for t, b in zip(times, base_times))


def summary_ms(times, base_times=None) -> dict:
    """median, p25 and p75 in ms; with base_times also the ratio of medians and the paired ratio."""
    med = median(times)
    out = {"median_ms": med * 1e3, "p25_ms": quantile(times, 0.25) * 1e3, "p75_ms": quantile(times, 0.75) * 1e3}
    if base_times is not None:
        out["ratio"] = med / median(base_times)
        out["paired_ratio"] = paired_ratio(times, base_times)
    return out


def load_avg() -> float:
    """The 1-minute load average (recorded before and after timing: a loaded machine
    stretches every figure)."""
    return os.getloadavg()[0]


# ---------------------------------------------------------------------------------------
# Tables and run headers


def markdown_table(head, rows, right=None) -> str:
    """A markdown table; `right`: the column indices aligned right (default: all but the
    first and the last)."""
    right = set(range(1, len(head) - 1) if right is None else right)
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---:" if i in right else "---" for i in range(len(head))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def console_table(title, head, rows, right=None, console=None) -> None:
    """The same table printed with rich (wide enough when piped: rich assumes 80 columns)."""
    from rich.table import Table

    right = set(range(1, len(head) - 1) if right is None else right)
    t = Table(title=title)
    for i, h in enumerate(head):
        t.add_column(h, justify="right" if i in right else "left")
    for row in rows:
        t.add_row(*[str(c) for c in row])
    (console or make_console()).print(t)


def make_console():
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def git_state() -> dict:
    """The commit measured, and which dpjax files differed from it (results depend on them)."""
    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10, cwd=HERE).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD").strip(),
            "modified": git("status", "--porcelain", "--", "../dpjax", "../models").splitlines()}


def machine() -> str:
    """The machine in words, for RESULTS.md headers: CPU, cores, and the accelerator or
    the simulated devices JAX sees (call after jax has its devices)."""
    import jax

    devs = jax.devices()
    what = (f"{len(devs)} {devs[0].device_kind} ({devs[0].platform})" if devs[0].platform != "cpu"
            else f"{len(devs)} simulated CPU devices")
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {what}, "
            f"jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")


# ---------------------------------------------------------------------------------------
# Smoke mode


def add_smoke(parser, what: str) -> None:
    """--smoke: `what` (the fewest devices, steps, sizes and variants that still run
    every code path), outputs written to a temporary directory."""
    parser.add_argument("--smoke", action="store_true",
                        help=f"a seconds-long run of every code path ({what}); outputs go to a temporary "
                             "directory, never into experiments/")


def smoke_outputs(args, *names) -> str | None:
    """Under --smoke, every output path among args.<names> that is set moves into a fresh
    temporary directory (its file name kept), so that a smoke run exercises the writers
    without touching experiments/ or RESULTS.md. Returns that directory (None otherwise)."""
    if not getattr(args, "smoke", False):
        return None
    tmp = tempfile.mkdtemp(prefix="dpjax-smoke-")
    for name in names:
        path = getattr(args, name)
        if path:
            setattr(args, name, os.path.join(tmp, os.path.basename(os.path.normpath(path))))
    print(f"smoke run: outputs in {tmp}", flush=True)
    return tmp


def pyplot(path):
    """matplotlib's pyplot drawing to files (the Agg backend), or None after saying that
    `path` is not written because matplotlib is not installed (an optional extra: `.[plot]`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"not writing {path}: matplotlib is not installed (pip install -e '.[plot]')", flush=True)
        return None
    return plt


def finish_plot(fig, axes, path) -> None:
    """A grid and the legend on `axes` (one Axes or several), and the figure written to
    `path` (the experiments' plots alike)."""
    import matplotlib.pyplot as plt

    for ax in axes if isinstance(axes, (list, tuple)) else (axes,):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
