"""`shard_step` for research code, and what it carries: the wrapper (`wrapper`), how it reads its
arguments (`arguments`), the program it builds (`program`), its checks (`checks`), per-rank state
(`per_rank`), the replica checks (`replicas`), per-device random keys (`rng`), the model's own
layout annotations (`annotations`) and sharding constraints (`constraints`).

It stands on `dpjax.mesh` and `dpjax.errors` alone, so the data-parallel code below the
step (`dpjax.data_parallel`, `dpjax.compression`) can use its per-rank and rng helpers.
The package imports nothing itself; `dpjax.shard_step` is the public name.
"""
