"""`python -m dpjax.timeline FILE [--png OUT]`: a timeline's tables (`summary`) and picture (`plot`)."""

from __future__ import annotations

import argparse
import sys

from dpjax.errors import UserError
from dpjax.timeline.summary import load, render, summarize


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpjax.timeline",
                                description="Summarise a dpjax timeline: per step compute / communication / "
                                            "waiting at rendezvous, per device, per phase, per collective "
                                            "(time, bytes, nccl-tests bus bandwidth).")
    p.add_argument("file", help="a timeline written by python -m dpjax.train --timeline FILE")
    p.add_argument("--png", metavar="OUT", help="also draw one step per device and the split per device")
    args = p.parse_args(argv)
    try:
        data = load(args.file)
        summary = summarize(data)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(summary))
    if args.png:
        from dpjax.timeline.plot import plot  # matplotlib only when asked

        plot(data, summary, args.png)
        print(f"wrote {args.png}")
    return 0
