"""`python -m dpjax.timeline FILE [--png OUT]` (`dpjax.timeline.cli`)."""

import sys

from dpjax.timeline.cli import main

sys.exit(main())
