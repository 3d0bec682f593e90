"""Which tests the README's 10-minute command leaves to CI: the `extended` tier.

The suite has three tiers:

- quick (`-m "not slow and not extended"`): the README's test command, <= 10 minutes on a 2-core
  machine: the unit tests of every module, each collective on the axis sizes that exercise its
  cases (one rank, odd, even, a power of two), the cheap cases of each parametrised check.
- extended (`-m "extended and not slow"`): the wider sweeps of the same checks (every mesh size,
  every variant, every layout pair) and the runs that start processes or train for many steps.
  `.ci/run` runs them after the quick tier: the two together are the whole fast suite.
- slow (`-m slow`, decorated in place): long runs that neither the README nor CI runs.

A test is extended when its node id matches a pattern below (fnmatch, on the id pytest prints; each
pattern says what the quick tier still runs of the same behaviour) and is not one of the ids
measured cheap (QUICK in tiers_measured.py), or is one of the ids in MEASURED there (each test
measured over THRESHOLD CPU seconds, the cheapest case of every test function kept quick). A pattern
or id that names no test of a collected file stops the session, so a renamed test cannot drift
between the tiers unnoticed. The CPU seconds are what `DPJAX_TEST_COSTS=FILE` (conftest.py)
records: other work on the machine inflates a test's wall time, not the CPU it burns.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from tiers_measured import MEASURED, QUICK, THRESHOLD  # noqa: F401  (generated: see tiers_measured.py)

# Wider sweeps of the collectives' harness (tests/collectives_harness.py), by mesh: the quick tier
# keeps axis sizes 1, 3 (odd), 6 (even, not a power of two) and 8 (a power of two), the tuple meshes,
# and the hierarchical meshes node=2,data=4 (both orders), node=3,data=2 and node=1,data=1.
_FLAT = ("data2", "data4", "data5", "data7")
_HIER = ("node4_data2", "node1_data8", "node8_data1", "node2_data3")
_SWEPT = ("test_collectives", "test_ops")
# Whole files of process runs, resumes and layout-against-layout training (each test starts processes or
# compiles several training steps), left to CI but for their tests measured cheap (QUICK in
# tiers_measured.py: unit tests, refusals, arithmetic), which come back to the quick tier.
_RUNS = """pipeline train context timeline_gpu compression_shards launchers launchers_failures agent commit
commit_every commit_stage elastic elastic_sizes multiprocess max_lost_steps full_disk chaos_disk
policy onebit_adam sft_cli dpo_cli grpo_train hf_llama generate_checkpoint lm1b_example
minigpt_tutorial flax_examples flax_tutorial flax_tp_tutorial sweep autotune fp8 compression_fsdp
moe_rules lean_step gpu_check figures mpi_transport run_record models_home cpu_runtime wandb
programs step_time compression_reshard reshard_axes checksums data_parallel pack_train timeline
compression_tp pipeline_sends per_rank tokens agreement""".split()
PATTERNS: list[tuple[str, str]] = [
    *((f"tests/{f}.py::*[-[]{m}-over-*", "an axis size the quick tier's 1, 3, 6 and 8 cover") for f in _SWEPT
      for m in _FLAT),
    *((f"tests/{f}.py::*[-_[]{m}-over-*", "a hierarchical mesh beside the quick tier's three") for f in _SWEPT
      for m in _HIER),
    *((f"tests/test_cost.py::*-{n}-*", "an axis size the quick tier's n1, n3, n6 and n8 cover") for n in ("n2", "n5")),
    *((f"tests/test_{f}.py::*", "process runs and layout-against-layout training (not yet measured one by one)")
      for f in _RUNS),
    ("tests/test_experiments.py::test_smoke[*", "each script's smoke run: a process that compiles its own runs "
                                                 "(the APIs they call are tested in the quick tier)"),
]


def extended(nodeid: str) -> str | None:
    """Why `nodeid` is in the extended tier (its pattern, or its measured CPU seconds), or None."""
    if nodeid in QUICK:
        return None
    if nodeid in MEASURED:
        return f"{MEASURED[nodeid]} CPU-s"
    return next((p for p, _ in PATTERNS if fnmatchcase(nodeid, p)), None)


def stale(nodeids: list[str]) -> list[str]:
    """Patterns and ids whose file was collected but that name none of its tests."""
    files = {n.split("::", 1)[0] for n in nodeids}
    given = set(nodeids)
    return [p for p, _ in PATTERNS
            if p.split("::", 1)[0] in files and not any(fnmatchcase(n, p) for n in nodeids)] + [
        n for n in (*MEASURED, *QUICK) if n.split("::", 1)[0] in files and n not in given]
