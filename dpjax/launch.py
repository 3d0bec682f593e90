"""`python -m dpjax.launch -n 2 [--devices-per-process 4] -- python -m dpjax.train ...`

Starts N processes of one command on this host, joined by `jax.distributed` through a
coordinator on a free 127.0.0.1 port (see dpjax.distributed.initialize). Each line a
process prints comes out prefixed with its rank. When one process fails, or on
Ctrl-C, the launcher stops the others by escalating, as torchrun does: SIGINT (a
training run finishes its step and saves), then SIGTERM after a grace period, then
SIGKILL after another (DPJAX_LAUNCH_GRACE seconds, default 10; a second Ctrl-C kills at
once), so that no process is left behind however it is stuck; it exits non-zero,
naming the failed rank and its last error line. On a cluster the same training
command runs under `srun` or `mpirun` instead, without this launcher (see the README).

`--shape-mbit R` (Linux, as root) runs all the processes in a private network
namespace whose loopback is shaped to R Mbit/s with a token bucket (`tc ... tbf`), so
that the real traffic between them (gloo on CPU) is bandwidth-limited. Latency cannot
be added this way (netem is not available everywhere); `dpjax.train --link` emulates
both, inside the program.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from dpjax import distributed

GRACE_S = 10  # between the steps of the escalation (DPJAX_LAUNCH_GRACE overrides it)
SHAPED = "DPJAX_SHAPED_MBIT"  # set inside the shaped namespace: the launcher there does not shape again
ESCALATION = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(rank: int, n: int, port: int, devices_per_process: int | None) -> dict:
    env = dict(os.environ)
    env.update({distributed.COORDINATOR: f"127.0.0.1:{port}", distributed.NUM_PROCESSES: str(n),
                distributed.PROCESS_ID: str(rank), distributed.LOCAL_RANK: str(rank),
                "PYTHONUNBUFFERED": "1"})
    if devices_per_process:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
    return env


def _pump(rank: int, stream, out, last_lines: dict, lock: threading.Lock):
    for line in iter(stream.readline, ""):
        if line.strip():
            last_lines[rank] = line.rstrip()
        with lock:
            out.write(f"[{rank}] {line}")
            out.flush()
    stream.close()


def _stop(procs, sig=signal.SIGTERM):
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass


def launch(command: list[str], n: int, devices_per_process: int | None = None, port: int | None = None) -> int:
    """Runs `command` in n processes; returns the exit status the launcher should exit with."""
    port = port or free_port()
    lock = threading.Lock()
    last_out: dict[int, str] = {}
    last_err: dict[int, str] = {}
    procs, pumps = [], []
    for rank in range(n):
        p = subprocess.Popen(command, env=process_env(rank, n, port, devices_per_process),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        procs.append(p)
        for stream, out, last in ((p.stdout, sys.stdout, last_out), (p.stderr, sys.stderr, last_err)):
            t = threading.Thread(target=_pump, args=(rank, stream, out, last, lock), daemon=True)
            t.start()
            pumps.append(t)

    grace = float(os.environ.get("DPJAX_LAUNCH_GRACE", GRACE_S))
    interrupted = {"n": 0}
    ladder = {"step": -1, "at": 0.0}  # the last signal of ESCALATION sent, and when

    def escalate(step=None):
        ladder["step"] = ladder["step"] + 1 if step is None else step
        ladder["at"] = time.time()
        if ladder["step"] > 0:
            alive = [r for r, p in enumerate(procs) if p.poll() is None]
            print(f"dpjax.launch: ranks {alive} still running {grace:g} s after "
                  f"{ESCALATION[ladder['step'] - 1].name}; sending {ESCALATION[ladder['step']].name}",
                  file=sys.stderr, flush=True)
        _stop(procs, ESCALATION[ladder["step"]])

    def on_sigint(signum, frame):
        interrupted["n"] += 1
        escalate(0 if interrupted["n"] == 1 else len(ESCALATION) - 1)

    old = signal.signal(signal.SIGINT, on_sigint)
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            for rank, p in enumerate(procs):
                if failed is None and p.poll() not in (None, 0) and not interrupted["n"]:
                    failed = rank
                    escalate(0)
            if 0 <= ladder["step"] < len(ESCALATION) - 1 and time.time() - ladder["at"] >= grace:
                escalate()
            time.sleep(0.1)
    finally:
        signal.signal(signal.SIGINT, old)
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=5)
    if failed is None:
        failed = next((r for r, p in enumerate(procs) if p.returncode != 0), None)
    if failed is None:
        return 0
    code = procs[failed].returncode
    why = last_err.get(failed) or last_out.get(failed) or "no output"
    how = f"signal {-code}" if code < 0 else f"exit code {code}"
    print(f"dpjax.launch: rank {failed} failed ({how}): {why}", file=sys.stderr, flush=True)
    return code if code > 0 else 1


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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    else:
        command = []
    p = argparse.ArgumentParser(
        prog="python -m dpjax.launch",
        description="Run a command in N processes on this host, joined by jax.distributed "
                    "(gloo on CPU, NCCL on GPU). Example: python -m dpjax.launch -n 2 "
                    "-- python -m dpjax.train --mesh 2x2x2",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-n", "--nproc", type=int, default=2, help="processes to start")
    p.add_argument("--devices-per-process", type=int,
                   help="simulated CPU devices per process (sets XLA_FLAGS; GPUs are not affected). Default: "
                        "dpjax.train simulates its mesh's size / the process count")
    p.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--shape-mbit", type=float,
                   help="shape the loopback the processes talk over to this many Mbit/s (tc tbf in a private "
                        "network namespace; Linux, root)")
    args, rest = p.parse_known_args(argv)
    command = rest + command
    if not command:
        p.error("no command given; put it after '--', e.g. -- python -m dpjax.train --mesh 2x2x2")
    if args.nproc < 1:
        p.error("-n must be at least 1")
    if args.shape_mbit is not None and args.shape_mbit <= 0:
        p.error("--shape-mbit must be positive")
    if args.shape_mbit is not None and not os.environ.get(SHAPED):
        unshaped = [a for i, a in enumerate(argv) if a != "--shape-mbit" and not a.startswith("--shape-mbit=")
                    and (i == 0 or argv[i - 1] != "--shape-mbit")]
        return shaped(unshaped + ["--", *command], args.shape_mbit)
    return launch(command, args.nproc, args.devices_per_process, args.port)


if __name__ == "__main__":
    sys.exit(main())
