"""The environment variables dpjax.agent sets for each process it starts, besides
dpjax.distributed's (coordinator, process count and id, local rank). One table, read by
the agent that writes them and by the training loop that reads them
(`dpjax.train.elastic`, `dpjax.train.resume`); `dpjax.recovery.fault` reads DPJAX_RESTART and
DPJAX_AGENT_PID."""

import os

ENV = {
    "restart": "DPJAX_RESTART",              # 0 for a job's first attempt, n after n restarts
    "host": "DPJAX_HOST",                    # the host's name: its folder under the commit root
    "per_host": "DPJAX_LOCAL_WORLD_SIZE",    # processes per host: the neighbour is rank + this
    "devices": "DPJAX_DEVICES_PER_PROCESS",  # the mesh is resized for processes x this
    "heartbeat": "DPJAX_HEARTBEAT",          # the file the loop rewrites after every step
    "commit_dir": "DPJAX_COMMIT_DIR",        # the commit root when --commit-dir is not given
    "failure": "DPJAX_LAST_FAILURE",         # JSON: what ended the previous attempt, when, how far it got
    "agent_pid": "DPJAX_AGENT_PID",          # the host's agent (a lost host takes it down too)
}


def restart_number() -> int:
    """0 for a job's first attempt (or a run without the agent), n after n restarts."""
    return int(os.environ.get(ENV["restart"]) or "0")


def under_agent() -> bool:
    """Whether dpjax.agent started this process (it sets DPJAX_RESTART, 0 at first)."""
    return ENV["restart"] in os.environ
