"""`python -m dsr1.train`: see `dsr1.train.cli`."""

import sys

from .cli import main

sys.exit(main())
