import sys

from dpjax.agent.cli import main

sys.exit(main())
