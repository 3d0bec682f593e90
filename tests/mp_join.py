"""Run as one of several processes under a launcher's environment (dpjax.launch, or
Open MPI's, MPICH's or SLURM's variables set by a test): joins through
dpjax.distributed.initialize, then sums each process's index + 1 across the processes.
With `forever`, it keeps summing (a job to kill a rank of)."""

import sys

from dpjax import distributed

joined = distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

distributed.ready()
total = multihost_utils.process_allgather(np.array([jax.process_index() + 1.0], np.float32)).sum()
print(f"joined={joined} process {jax.process_index()} of {jax.process_count()} local {distributed.local_rank()} "
      f"sum={total:g}", flush=True)
while "forever" in sys.argv:
    multihost_utils.process_allgather(np.ones(1, np.float32))
