"""`python -m dpjax.timeline FILE [--png OUT]`, `python -m dpjax.timeline build CAPTURE_DIR -o OUT.json`
(`dpjax.timeline.cli`)."""

import sys

from dpjax.timeline.cli import main

sys.exit(main())
