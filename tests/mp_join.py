"""Run as one of several processes under a launcher's environment (dpjax.launch, or
Open MPI's, MPICH's or SLURM's variables set by a test, or with `fake-cluster` a
cluster only JAX's own detection knows): joins through
dpjax.distributed.initialize, then sums each process's index + 1 across the processes.
With `fail`, rank 1 then raises. With `forever`, the others stay, as a process stuck in a
collective whose peer died does
(deaf to SIGINT, which in dpjax.train finishes the step): a job to kill a rank of."""

import signal
import sys
import time

from dpjax import distributed

if "fake-cluster" in sys.argv:  # a cluster only JAX's own detection knows, as Kubernetes is
    import os

    from jax._src.clusters import ClusterEnv

    class FakeCluster(ClusterEnv):  # subclasses register themselves with JAX's detection
        @classmethod
        def is_env_present(cls):
            return "FAKE_CLUSTER_RANK" in os.environ

        @classmethod
        def get_coordinator_address(cls, timeout_secs, override_coordinator_port):
            if os.environ["FAKE_CLUSTER_PORT"] == "broken":
                raise RuntimeError("the cluster's API says no")
            return f"127.0.0.1:{os.environ['FAKE_CLUSTER_PORT']}"

        @classmethod
        def get_process_count(cls):
            return 2

        @classmethod
        def get_process_id(cls):
            return int(os.environ["FAKE_CLUSTER_RANK"])

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
