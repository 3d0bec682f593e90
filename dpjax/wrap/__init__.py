"""`shard_step` for research code, and what it carries: the wrapper (`wrapper`), how a call binds
its static, keyword and donated arguments (`call`) and how it reads them (`arguments`), the program
it builds (`program`), its checks (`checks`), per-rank state (`per_rank`), the replica checks
(`replicas`), the check against one device (`reference`), per-device random keys (`rng`), sums over
the global batch (`global_batch`), the model's own layout annotations (`annotations`) and sharding
constraints (`constraints`); `jit`, a drop-in for `jax.jit` built on `shard_step`.

It stands on `dpjax.mesh` and `dpjax.errors` alone, so the data-parallel code below the
step (`dpjax.data_parallel`, `dpjax.compression`) can use its per-rank and rng helpers.
The package imports nothing itself; `dpjax.shard_step` and `dpjax.jit` are the public names.
"""
