"""Two real processes on 127.0.0.1 (`tests/mp_disagree.py` under `python -m dpjax.launch`) whose
collective calls disagree, or whose kept compiled programs differ: each disagreement is one error on
every process, never garbage or a hang. Outside the slow tier (test_multiprocess.py's): the check a
lost host's restart depends on."""

import os
import re
import sys
import time

from conftest import pids_running
from test_multiprocess import HERE, _launch

DISAGREE_CASES = ["dtype-allreduce", "dtype-all_gather", "dtype-reduce_scatter", "dtype-broadcast", "reshape",
                  "shorter-message", "roots-psum", "roots-tree", "roots-ring"]


def test_ranks_that_disagree_get_an_error_each(tmp_path):
    """Each disagreement of mp_disagree.py (a dtype, a same-size reshape, a shorter
    message, different roots) is one ValueError on both processes, naming what each
    passed; a call both make alike still runs, and so does a kept program one process lost;
    one that process 1 never makes times out on process 0 with an error naming it. No hang,
    nothing left running."""
    t0 = time.time()
    r = _launch(sys.executable, os.path.join(HERE, "mp_disagree.py"), timeout=60,
                env={**os.environ, "DPJAX_COLLECTIVE_TIMEOUT": "4", "DPJAX_LAUNCH_GRACE": "2", "MP_TMP": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert time.time() - t0 < 45
    for case in DISAGREE_CASES:
        for rank in (0, 1):
            line = next((s for s in r.stdout.splitlines() if s.startswith(f"[{rank}] case {case}:")), "")
            assert "ValueError: processes disagree on collective call" in line, (case, rank, line)
            assert f"process {rank} has" in line and f"process {1 - rank} has" in line, line
    assert "[0] case agree: ok" in r.stdout and "[1] case agree: ok" in r.stdout
    # a kept program one process lost: traced by both (loaded by neither), so its collectives agree
    assert "[0] case kept: ok, loaded 0, compiled 1" in r.stdout and "[1] case kept: ok, loaded 0, compiled 1" \
        in r.stdout, r.stdout[-2000:]
    assert re.search(r"\[0\] case absent: TimeoutError after [45] s: allreduce .* process 1 did not reach it",
                     r.stdout), r.stdout[-2000:]
    assert pids_running("mp_disagree.py") == []
