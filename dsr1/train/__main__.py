"""`python -m dsr1.train`: see `dsr1.train.cli`."""

import sys

try:
    from .cli import main
except ModuleNotFoundError as e:  # optax is the `train` extra, not a dependency of the model
    if e.name != "optax":
        raise
    sys.exit("python -m dsr1.train needs the train extra: pip install 'dsr1[train]'")

if __name__ == "__main__":
    sys.exit(main())
