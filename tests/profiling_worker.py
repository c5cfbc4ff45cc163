"""Profile the tiny model's decode (`profile_decode`: step latencies, throughput by batch, device
time by block from a `jax.profiler` trace, bandwidth) and plot it; prints the figures as JSON.

Used by test_profiling.py in a subprocess: a fresh process keeps earlier tests' programs out of the
trace, and XLA:CPU has crashed compiling this decode step in a pytest process that had compiled many
earlier tests' programs, while it passes in a fresh one (not root-caused).
"""

from __future__ import annotations

import argparse
import json

import dsr1
from dsr1.workbench import profiling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--logdir", help="where to keep the trace (default: a temporary folder, removed)")
    args = parser.parse_args()
    model = dsr1.init_random(dsr1.Config.preset("tiny"))
    p = profiling.profile_decode(model, batch=2, batches=(1, 2), context=16, steps=4, copy_bytes=32 * 2**20,
                                 logdir=args.logdir)
    fig = profiling.plot_profile(p)
    head = model.params["lm_head"]  # its bf16 bytes (on CPU it also holds a float32 copy for one-row steps)
    print(p.summary())
    print(json.dumps({"step_ms": p.step_ms.tolist(), "tokens_per_second": p.tokens_per_second,
                      "block_ms": p.block_ms, "traced_step_ms": p.traced_step_ms, "achieved_gbs": p.achieved_gbs,
                      "peak_gbs": p.peak_gbs, "bytes_per_step": p.bytes_per_step,
                      "lm_head_bytes": head.size * head.dtype.itemsize,
                      "axes": len(fig.axes)}))


if __name__ == "__main__":
    main()
