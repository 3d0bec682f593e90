"""The agent's command line. `add_arguments` and `run` are what `dpjax.launch` calls to
delegate to the agent when it is given --nnodes or --rdzv."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile

from dpjax.agent.rendezvous_etcd import parse
from dpjax.agent.supervisor import Agent
from dpjax.errors import UserError


def _nnodes(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def _rdzv(text: str) -> str:
    if text.startswith("etcd://"):
        try:
            parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT or etcd://HOST:PORT,HOST:PORT,...[/JOB], got {text!r}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=_nnodes, default=(1, 1), metavar="MIN:MAX",
                   help="hosts the job runs on: at least MIN (fewer ends it), at most MAX (more wait for a restart)")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="K", help="processes this agent runs")
    p.add_argument("--rdzv", type=_rdzv, default="127.0.0.1:29400", metavar="HOST:PORT",
                   help="where the agents meet; the first agent that can listen there runs the rendezvous. Or "
                        "etcd://H1:P,H2:P,H3:P[/JOB]: an etcd cluster keeps it (it survives any one host; JOB "
                        "names the job, default dpjax)")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N", help="failures survived before giving up")
    p.add_argument("--hang-timeout", type=float, default=60.0, metavar="S",
                   help="a process with no step for this many seconds, or whose heartbeat (a thread of its own, "
                        "every second) is this old, has hung")
    p.add_argument("--start-timeout", type=float, default=1800.0, metavar="S",
                   help="a process with no first step (start, compile, restore) for this many seconds, or busy "
                        "between steps (a checkpoint's save, an evaluation, the run's end) this long, has hung")
    p.add_argument("--host-timeout", type=float, default=10.0, metavar="S",
                   help="an agent not heard from for this many seconds has lost its host (each agent says it is "
                        "alive from a thread of its own, every second)")
    p.add_argument("--host-id", default=socket.gethostname(),
                   help="this host's name (unique among the agents; its commits' folder)")
    p.add_argument("--commit-dir", default=None,
                   help="the root of the per-step commits and heartbeats (fast local storage; dpjax.train's "
                        "--commit-dir wins where given). Default: /dev/shm/dpjax-<rdzv port>")
    p.add_argument("--devices-per-process", type=int, default=None,
                   help="simulated CPU devices per process (sets XLA_FLAGS); the mesh's data axis is then resized "
                        "to the devices a round has")
    p.add_argument("--rdzv-last-call", type=float, default=1.0, metavar="S",
                   help="after a failure, a round starts once every live host has rejoined and none for S seconds")
    p.add_argument("--rdzv-wait", type=float, default=300.0, metavar="S",
                   help="the first round waits this long for MAX hosts, then starts with MIN or more; after a failure "
                        "that leaves fewer than MIN live hosts, the agents wait this long for hosts to come back "
                        "(restarted or replaced) before they give up")
    p.add_argument("--spares", action="store_true",
                   help="once a round trains, start the next round's processes of a `python -m MODULE` command "
                        "(Python started, MODULE's package imported, waiting for their ranks): a restart skips "
                        "starting Python and JAX, at the cost of their memory while the job trains")
    p.add_argument("--verbose", action="store_true",
                   help="show every line the processes print: gloo's connection lines, glog's, whole tracebacks "
                        "(by default a traceback shows as its last line and the log file that holds it)")


def run(args, command: list[str]) -> int:
    if args.nproc_per_node < 1 or args.max_restarts < 0 or min(args.hang_timeout, args.start_timeout,
                                                                  args.host_timeout) <= 0:
        print("dpjax.agent: --nproc-per-node must be >= 1, --max-restarts >= 0, --hang-timeout, --start-timeout "
              "and --host-timeout > 0", file=sys.stderr)
        return 2
    try:
        agent = Agent(args, command)  # an etcd rendezvous none of whose endpoints answers: one line, nothing started
    except UserError as e:
        print(f"dpjax.agent: {e}", file=sys.stderr, flush=True)
        return 2
    if args.commit_dir is not None:
        return agent.run()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    args.commit_dir = os.path.join(shm, f"dpjax-{agent.rdzv.tag}")
    try:
        return agent.run()
    finally:
        remove_own(args.commit_dir, args.host_id)


def remove_own(root: str, host: str) -> None:
    """At the agent's exit, what it kept in the folder it chose itself (/dev/shm: memory):
    its host's commits and programs, its heartbeats; the folder with them once no other
    host's (an agent of the same job on this machine) is left in it."""
    for path in (os.path.join(root, host), os.path.join(root, "heartbeat", host)):
        shutil.rmtree(path, ignore_errors=True)
    shared, heartbeats = {"heartbeat", "jit-cache"}, os.path.join(root, "heartbeat")  # the job's, not a host's
    try:
        others = set(os.listdir(root)) - shared
        if not others and not (os.path.isdir(heartbeats) and os.listdir(heartbeats)):
            shutil.rmtree(root, ignore_errors=True)
    except FileNotFoundError:
        pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as dpjax.launch's: the command line is the user's
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
        sys.exit(2)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    argv, command = argv[:cut], argv[cut + 1:]
    p = _Parser(prog="python -m dpjax.agent", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="Run a training command on this host under a supervising agent that "
                                            "restarts the job on any failure (see dpjax.agent). Example: python -m "
                                            "dpjax.agent --nnodes 1:2 --nproc-per-node 2 --rdzv 127.0.0.1:29400 -- "
                                            "python -m dpjax.train --mesh 4x2")
    add_arguments(p)
    args = p.parse_args(argv)
    if not command:
        p.error("no command given; put it after '--', e.g. -- python -m dpjax.train --mesh 4x2")
    return run(args, command)
