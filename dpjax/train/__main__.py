import sys

from dpjax.train.cli import main

sys.exit(main())
