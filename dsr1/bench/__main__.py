"""`python -m dsr1.bench`: see `dsr1.bench.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
