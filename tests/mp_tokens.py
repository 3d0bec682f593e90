"""Run under `python -m dpjax.launch -n 2 --devices-per-process 4` with a token file:
each process reads, through the loop's `put_batch`, only the rows of the global batch
its devices hold (each once), and `dpjax.shard_batch(..., process_local=True)` of its
`process_rows` builds the same global array. Prints one JSON line per process."""

import json
import sys

import dpjax
from dpjax import distributed

dpjax.cpu_guards()  # the launcher's XLA_FLAGS simulate this process's devices: guard their collectives
distributed.initialize()

import jax  # noqa: E402
import jax.experimental.multihost_utils as mh  # noqa: E402
import numpy as np  # noqa: E402

from dpjax.data import make_streams  # noqa: E402
from dpjax.step import put_batch  # noqa: E402

B, T = 16, 8
stream, _ = make_streams(sys.argv[1], T, seed=5, vocab_size=256)
read = []  # (cursor, row) of every row this process read
whole = stream.batch


def counted(cursor, batch_size, rows=slice(None)):
    read.extend((cursor, r) for r in range(batch_size)[rows])
    return whole(cursor, batch_size, rows)


stream.batch = counted
mesh = dpjax.make_mesh("2x2x2")  # node x data x model: 4 row blocks, each held by 2 devices
x = put_batch(stream, 32, B, mesh)
got = np.asarray(mh.process_allgather(x, tiled=True))
assert np.array_equal(got, whole(32, B)), "the global batch differs from the stream's"
mine = dpjax.process_rows(mesh, B)
y = dpjax.shard_batch(mesh, whole(32, B)[mine], process_local=True)
assert np.array_equal(np.asarray(mh.process_allgather(y, tiled=True)), got)
held = sorted({r for d, idx in x.sharding.addressable_devices_indices_map(x.shape).items()
               for r in range(B)[idx[0]]})
print(json.dumps({"process": jax.process_index(), "read": sorted(read), "held": held,
                  "rows": [mine.start, mine.stop]}), flush=True)
