"""A notebook kernel's first cell on a harness cluster's host 0, for tests/test_netns.py.

``python -m tests.netns.kernel_worker READY GO``: ``connect()`` (claims the cluster and numbers the
processes), then writes the engines' count to the file READY, waits for the file GO and prints
"engines answered N" after one call on every engine. A connect that is refused prints
"refused: MESSAGE" and exits with status 3.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from dsr1.workbench.notebook import connect
from dsr1.workbench.process import ClusterError


def main() -> int:
    ready, go = Path(sys.argv[1]), Path(sys.argv[2])
    try:
        cluster = connect(namespace={})
    except ClusterError as e:
        print(f"refused: {e}", flush=True)
        return 3
    ready.write_text(str(len(cluster.client.ids)))
    while not go.exists():
        time.sleep(0.2)
    pids = cluster.client[:].apply_sync(os.getpid)
    print(f"engines answered {len(pids)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
