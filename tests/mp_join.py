"""Run as one of several processes under a launcher's environment (dpjax.launch, or
Open MPI's, MPICH's or SLURM's variables set by a test): joins through
dpjax.distributed.initialize, then sums each process's index + 1 across the processes.
With `fail`, rank 1 then raises. With `forever`, the others stay, as a process stuck in a collective whose peer died does
(deaf to SIGINT, which in dpjax.train finishes the step): a job to kill a rank of."""

import signal
import sys
import time

from dpjax import distributed

joined = distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

distributed.ready()
total = multihost_utils.process_allgather(np.array([jax.process_index() + 1.0], np.float32)).sum()
print(f"joined={joined} process {jax.process_index()} of {jax.process_count()} local {distributed.local_rank()} "
      f"sum={total:g}", flush=True)
if "fail" in sys.argv and jax.process_index() == 1:
    raise ValueError("rank 1 gives up")
if "forever" in sys.argv:
    signal.signal(signal.SIGINT, lambda *_: None)
    while True:
        time.sleep(1)
