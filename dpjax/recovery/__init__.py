"""Getting a run back: orbax checkpoints (`checkpoint`), commits (`commit`: a step's state in
each process's own file; `file_format` the file, `place` putting one back onto devices,
`peer` the processes' channel, `interval` when to commit), their checksums (a commit
file's trailer; `sums` an orbax step's manifest; `verify` and `python -m dpjax.recovery
verify DIR` a folder checked), the kept compiled programs
(`programs`), fault injection (`fault`) and the environment the agent sets for the
processes it starts (`env`).

Used by the training loop (`dpjax.train`), the agent and `dpjax.hf` (a checkpoint); it
imports nothing above the compression it saves. The package imports nothing itself.
"""
