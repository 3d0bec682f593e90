"""`python -m dpjax.agent`: one supervising agent per host, as torchrun runs one per node.

    python -m dpjax.agent --nnodes MIN:MAX --nproc-per-node K --rdzv HOST:PORT \\
        --max-restarts N --hang-timeout S -- python -m dpjax.train --mesh 4x2 ...

The agents meet at a rendezvous (`rendezvous.py`: a TCP service the first agent that
can listen on HOST:PORT runs; or, with --rdzv etcd://H1:P,H2:P,H3:P[/JOB], the same state
kept in an etcd cluster, which survives any one host: `rendezvous_etcd.py`), agree on
the job's membership (at least MIN hosts, at most MAX), and each starts its host's K
processes with the job's `jax.distributed` settings (coordinator on the first host,
process count and ids) and the elastic ones (`env.py`). On any failure (a process that
exits abnormally, one stopped or without a
step for --hang-timeout, or busy between steps -- a save, an evaluation -- for
--start-timeout: `dpjax.recovery.heartbeat`; a host whose agent is silent for
--host-timeout, or whose agent's process is gone: `rendezvous.py`) every agent stops its
processes and the job starts again at the size that is left, or at the same size when
the failed host can start again; the training loop restores the newest step every
process committed (`dpjax.recovery.commit`), so at most about one step of work is lost. More
failures than --max-restarts end the job with one line and a non-zero exit. A failure
after every process committed the last step is after the job's end: exit 0, one line
saying what failed (`rendezvous.py`; a restart that finds the last step committed ends
the same way).

Files: `rendezvous.py` (membership, rounds), `rendezvous_etcd.py` and `etcd_v3.py` (the
same in etcd, and the client that speaks to it), `workers.py` (this host's processes:
start, watch, stop), `supervisor.py` (the agent's loop), `sizes.py` (which size a restart
runs at: sizes that cannot hold the run are skipped), `cli.py` (the command line),
`env.py` (what a process is told).
"""
