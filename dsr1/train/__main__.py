"""`python -m dsr1.train`: see `dsr1.train.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
