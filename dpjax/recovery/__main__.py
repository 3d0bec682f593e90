"""`python -m dpjax.recovery verify DIR`: checks a folder of commits or checkpoints
against their checksums (`dpjax.recovery.verify`; exit 0: the newest is good, 1: a
restore would pass over it to an older good one, 2: nothing good, or not such a folder)."""

from __future__ import annotations

import argparse
import sys

from dpjax.errors import UserError
from dpjax.recovery.verify import verify


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpjax.recovery", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="check a --commit-dir or a --ckpt-dir against its checksums")
    v.add_argument("dir")
    args = p.parse_args(argv)

    try:
        lines, code = verify(args.dir)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    sys.exit(main())
