"""`python -m dpjax.train`: `dpjax.train.cli.main` as a process.

Ctrl-C at any moment exits 130 with one line (`dpjax.interrupt`): while the package
imports (`interrupt.while_starting`), while the run starts and compiles (a
KeyboardInterrupt, here), while it trains (the loop's first Ctrl-C finishes the step and
saves, `dpjax.train.run`). An interrupted process leaves by `interrupt.leave`, never
through the interpreter's teardown, which crashed under a compile still running in XLA's
threads."""

import signal
import sys

from dpjax import interrupt

try:
    from dpjax.train.cli import main

    code = main()
except KeyboardInterrupt:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # leaving: another Ctrl-C does not interrupt the line
    interrupt.leave(interrupt.BEFORE["dpjax.train"])
if code == interrupt.STATUS:
    interrupt.leave()
sys.exit(code)
