"""`python -m dpjax.launch -n 2 [--devices-per-process 4] [--collectives gloo|mpi] -- python -m dpjax.train ...`

Starts N processes of one command on this host, joined by `jax.distributed` through a
coordinator on a free 127.0.0.1 port (see dpjax.distributed.initialize). Each line a
process prints comes out prefixed with its rank.

When a process dies, the others cannot go on (every step is collective): the launcher
sends them SIGTERM at once and SIGKILL DPJAX_LAUNCH_KILL_GRACE seconds later (default 2),
and exits non-zero with a last line naming the rank, how it died (exit code or signal)
and its own last error line (not a library's status line). On Ctrl-C it escalates as
torchrun does: SIGINT (a training run finishes its step and saves), then SIGTERM after a
grace period, then SIGKILL after another (DPJAX_LAUNCH_GRACE seconds, default 10; a second
Ctrl-C kills at once), so that no process is left behind however it is stuck. On a
cluster the same training command runs under `srun` or `mpirun` instead, without this
launcher (see the README's "Running on a cluster").

`--shape-mbit R` (Linux, as root) runs all the processes in a private network
namespace whose loopback is shaped to R Mbit/s with a token bucket (`tc ... tbf`), so
that the real traffic between them (gloo on CPU) is bandwidth-limited. Latency cannot
be added this way (netem is not available everywhere); `dpjax.train --link` emulates
both, inside the program.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from dpjax import distributed
from dpjax.agent.cli import main as agent_main
from dpjax.distributed import transport
from dpjax.distributed.output import NOISE, RankOutput, log_dir

GRACE_S = 10  # between the steps of the Ctrl-C escalation (DPJAX_LAUNCH_GRACE overrides it)
KILL_GRACE_S = 2  # after a rank died: SIGTERM, then SIGKILL this much later (DPJAX_LAUNCH_KILL_GRACE)
SHAPED = "DPJAX_SHAPED_MBIT"  # set inside the shaped namespace: the launcher there does not shape again
ESCALATION = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
ON_FAILURE = (signal.SIGTERM, signal.SIGKILL)  # survivors cannot finish a step without the dead rank


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(rank: int, n: int, port: int, devices_per_process: int | None, collectives: str | None = None) -> dict:
    env = dict(os.environ)
    env.update({distributed.COORDINATOR: f"127.0.0.1:{port}", distributed.NUM_PROCESSES: str(n),
                distributed.PROCESS_ID: str(rank), distributed.LOCAL_RANK: str(rank),
                "PYTHONUNBUFFERED": "1"})
    if collectives:
        env[transport.ENV] = collectives
    if devices_per_process:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
    return env


def _pump(rank: int, stream, shown: RankOutput, last_lines: dict):
    for line in iter(stream.readline, ""):
        if line.strip() and not NOISE.match(line):
            last_lines[rank] = line.rstrip()
        shown.line(line)
    stream.close()
    shown.close()


def _stop(procs, sig=signal.SIGTERM):
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass


def _how(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"


class Stopper:
    """Stops processes by escalation: the first signal of a ladder now, each next one
    `grace` seconds after the last while any process is still running."""

    def __init__(self, procs):
        self.procs, self.signals, self.grace, self.step, self.at = procs, (), 0.0, -1, 0.0

    def start(self, signals, grace: float, step: int = 0) -> None:
        self.signals, self.grace = signals, grace
        self._send(step)

    def tick(self) -> None:
        if 0 <= self.step < len(self.signals) - 1 and time.time() - self.at >= self.grace:
            alive = [r for r, p in enumerate(self.procs) if p.poll() is None]
            print(f"dpjax.launch: ranks {alive} still running {self.grace:g} s after {self.signals[self.step].name}; "
                  f"sending {self.signals[self.step + 1].name}", file=sys.stderr, flush=True)
            self._send(self.step + 1)

    def _send(self, step: int) -> None:
        self.step, self.at = step, time.time()
        _stop(self.procs, self.signals[step])


def launch(command: list[str], n: int, devices_per_process: int | None = None, port: int | None = None,
           collectives: str | None = None, verbose: bool = False) -> int:
    """Runs `command` in n processes; returns the exit status the launcher should exit with.
    verbose: every line the processes print (`dpjax.distributed.output`)."""
    port = port or free_port()
    ranks = _Ranks(log_dir("launch", port), verbose)
    for rank in range(n):
        try:
            ranks.start(rank, command, process_env(rank, n, port, devices_per_process, collectives))
        except OSError as e:
            _stop(ranks.procs, signal.SIGKILL)
            return _refuse(f"cannot run {command[0]!r}: {e.strerror}")
    try:
        failed = _watch(ranks.procs, ranks.exits)
    finally:
        ranks.join()
    if failed is None:
        failed = next((r for r, p in enumerate(ranks.procs) if p.returncode != 0), None)
    if failed is None:
        return 0
    code = ranks.procs[failed].returncode
    why = ranks.last_err.get(failed) or (f"killed by {signal.Signals(-code).name}, no error output" if code < 0 else
                                         ranks.last_out.get(failed) or "no output")
    print(f"dpjax.launch: rank {failed} failed ({_how(code)}): {why}", file=sys.stderr, flush=True)
    return code if code > 0 else 1


class _Ranks:
    """The launched processes and their threads: one each that waits for its exit (`exits`:
    ranks in the order they exit, so the first failure is seen first) and two that pump its
    stdout and stderr, keeping its last lines for the launcher's own last line."""

    def __init__(self, logs, verbose: bool):
        self.logs, self.verbose, self.lock = logs, verbose, threading.Lock()
        self.last_out: dict[int, str] = {}
        self.last_err: dict[int, str] = {}
        self.exits: queue.Queue = queue.Queue()
        self.procs, self.pumps = [], []

    def start(self, rank: int, command: list[str], env: dict) -> None:
        p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.procs.append(p)
        threading.Thread(target=lambda: (p.wait(), self.exits.put(rank)), daemon=True).start()
        for stream, out, last in ((p.stdout, sys.stdout, self.last_out), (p.stderr, sys.stderr, self.last_err)):
            shown = RankOutput(rank, out, self.lock, self.logs, self.verbose)
            t = threading.Thread(target=_pump, args=(rank, stream, shown, last), daemon=True)
            t.start()
            self.pumps.append(t)

    def join(self) -> None:
        for p in self.procs:
            p.wait()
        for t in self.pumps:
            t.join(timeout=5)


def _watch(procs, exits: queue.Queue) -> int | None:
    """Waits until every process has exited, stopping the others when one fails (unless a
    Ctrl-C stopped them) and escalating on Ctrl-C; returns the rank that failed first, if
    any did before a Ctrl-C."""
    grace = float(os.environ.get("DPJAX_LAUNCH_GRACE", GRACE_S))
    kill_grace = float(os.environ.get("DPJAX_LAUNCH_KILL_GRACE", KILL_GRACE_S))
    stopper, interrupted = Stopper(procs), {"n": 0}

    def on_sigint(signum, frame):  # the first Ctrl-C lets a run save; the second kills
        interrupted["n"] += 1
        stopper.start(ESCALATION, grace, 0 if interrupted["n"] == 1 else len(ESCALATION) - 1)

    old = signal.signal(signal.SIGINT, on_sigint)
    failed, running = None, len(procs)
    try:
        while running:
            try:
                rank = exits.get(timeout=0.1)
            except queue.Empty:
                rank = None
            if rank is not None:
                running -= 1
                if failed is None and procs[rank].returncode != 0 and not interrupted["n"]:
                    failed = rank
                    alive = [r for r, p in enumerate(procs) if p.poll() is None]
                    if alive:
                        print(f"dpjax.launch: rank {rank} failed ({_how(procs[rank].returncode)}); sending SIGTERM "
                              f"to ranks {alive}", file=sys.stderr, flush=True)
                        stopper.start(ON_FAILURE, kill_grace)
            stopper.tick()
    finally:
        signal.signal(signal.SIGINT, old)
    return failed


def shaped(argv: list[str], mbit: float) -> int:
    """Runs `python -m dpjax.launch argv` again inside a new network namespace whose
    loopback is shaped to `mbit` Mbit/s; returns its exit status."""
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        return _refuse(f"--shape-mbit needs {', '.join(missing)} (Linux iproute2 and util-linux)")
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["refused"])[-1]
        return _refuse(f"--shape-mbit needs a private network namespace, which this user may not create ({why}); "
                       "run as root, or use dpjax.train --link to emulate the link inside the program")
    rate = mbit * 1e6 / 8
    burst = int(max(2 * 65536, rate / 100))  # at least two loopback MTUs, or big packets never pass
    script = (f"ip link set lo up && tc qdisc add dev lo root tbf rate {mbit:g}mbit burst {burst} latency 2s "
              '&& exec "$@"')
    env = {**os.environ, SHAPED: f"{mbit:g}"}
    return subprocess.run(["unshare", "--net", "sh", "-c", script, "sh", sys.executable, "-m", "dpjax.launch",
                           *argv], env=env).returncode


def _refuse(message: str) -> int:
    print(f"dpjax.launch: {message}", file=sys.stderr, flush=True)
    return 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block: the command line is the user's
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m dpjax.launch",
        description="Run a command in N processes on this host, joined by jax.distributed "
                    "(gloo or MPI on CPU, NCCL on GPU). Example: python -m dpjax.launch -n 2 "
                    "-- python -m dpjax.train --mesh 2x2x2. With --nnodes MIN:MAX --nproc-per-node K --rdzv "
                    "HOST:PORT|etcd://H1:P,H2:P,H3:P [--max-restarts N] [--hang-timeout S] it is one host's "
                    "supervising agent instead, restarting the job on any failure (python -m dpjax.agent --help)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-n", "--nproc", type=int, default=2, help="processes to start")
    p.add_argument("--devices-per-process", type=int,
                   help="simulated CPU devices per process (sets XLA_FLAGS; GPUs are not affected). Default: "
                        "dpjax.train simulates its mesh's size / the process count")
    p.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--collectives", choices=tuple(transport.COLLECTIVES),
                   help="CPU collectives between the processes (sets DPJAX_COLLECTIVES). Default: the command's "
                        "own choice (dpjax.train --collectives), else gloo")
    p.add_argument("--verbose", action="store_true",
                   help="show every line the processes print: gloo's connection lines, glog's, whole tracebacks "
                        "(by default a traceback shows as its last line and the log file that holds it)")
    p.add_argument("--shape-mbit", type=float,
                   help="shape the loopback the processes talk over to this many Mbit/s (tc tbf in a private "
                        "network namespace; Linux, root)")
    # the command starts at the first word that is not one of ours; an option we do not
    # know before it is an error, never a command to run
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command (after '--', or after our options)")
    return p


# These flags make `dpjax.launch` the supervising agent of `dpjax.agent` (torchrun's
# elastic launch): rendezvous, restarts at the size left, hang detection.
AGENT_FLAGS = ("--nnodes", "--nproc-per-node", "--rdzv", "--max-restarts", "--hang-timeout")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours = argv[:argv.index("--")] if "--" in argv else argv
    if any(a.split("=")[0] in AGENT_FLAGS for a in ours):  # the supervising agent (dpjax.agent): restarts
        local = [a for a in ours if a.split("=")[0] in ("-n", "--nproc", "--shape-mbit", "--port")]
        if local:
            build_parser().error(f"{local[0]} is for processes without an agent; under the agent "
                                 f"({', '.join(a for a in ours if a.split('=')[0] in AGENT_FLAGS)}) give "
                                 "--nproc-per-node K and --nnodes MIN:MAX --rdzv HOST:PORT instead")

        return agent_main(argv)
    p = build_parser()
    if "--" in argv:
        cut = argv.index("--")
        args, command = p.parse_args(argv[:cut]), argv[cut + 1:]
        if args.command:
            p.error(f"unrecognized arguments: {' '.join(args.command)}")
    else:
        args = p.parse_args(argv)
        command = args.command
    if not command:
        p.error("no command given; put it after '--', e.g. -- python -m dpjax.train --mesh 2x2x2")
    if args.nproc < 1:
        p.error("-n must be at least 1")
    if args.shape_mbit is not None and args.shape_mbit <= 0:
        p.error("--shape-mbit must be positive")
    if args.collectives == "mpi" and args.nproc > 1:
        return _refuse(transport.no_mpi_world("dpjax.launch"))
    if args.collectives and transport.problem(args.collectives):
        return _refuse(transport.problem(args.collectives))
    if args.shape_mbit is not None and not os.environ.get(SHAPED):
        ours = argv[:argv.index("--")] if "--" in argv else argv[:len(argv) - len(command)]
        unshaped = [a for i, a in enumerate(ours) if a != "--shape-mbit" and not a.startswith("--shape-mbit=")
                    and (i == 0 or ours[i - 1] != "--shape-mbit")]
        return shaped(unshaped + ["--", *command], args.shape_mbit)
    return launch(command, args.nproc, args.devices_per_process, args.port, args.collectives, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
