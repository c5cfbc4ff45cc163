"""Serve a fixed workload with `dsr1.serving.Engine` in this process, or as one of several processes
(process 0 decides, the others follow), and write each process's results as JSON.

Used by test_serving_processes.py in subprocesses, because the device count (XLA_FLAGS) and
`jax.distributed` must be set up before JAX starts.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from tests.harness import TINY, join_processes

# Small pool and host cache: requests wait for pages, cached prefixes are offloaded and reloaded.
SHAPES = dict(max_seqs=3, page_size=4, num_pages=20, prefill_chunk=8, prefill_rows=2, host_cache_bytes=1 << 24)


def workload(vocab: int) -> list[tuple[int, list[int], dict]]:
    """(arrival step, prompt, submit options): requests sharing a 12-token prefix before and after
    unrelated ones that push its pages out to host memory, greedy and seeded ones."""
    from dsr1.generation.sampling import Sampling

    rng = np.random.default_rng(7)
    prefix = rng.integers(2, vocab, 12).tolist()
    other = [rng.integers(2, vocab, int(n)).tolist() for n in (19, 23, 17, 21)]
    seeded = Sampling(temperature=0.9, top_k=50, seed=11)
    return [(0, prefix + rng.integers(2, vocab, 5).tolist(), dict(max_new_tokens=8)),
            (1, other[0], dict(max_new_tokens=9)),
            (2, other[1], dict(max_new_tokens=7, sampling=seeded)),
            (3, other[2], dict(max_new_tokens=10)),
            (4, other[3], dict(max_new_tokens=6)),
            (30, prefix + rng.integers(2, vocab, 7).tolist(), dict(max_new_tokens=8)),
            (30, prefix + rng.integers(2, vocab, 3).tolist(), dict(max_new_tokens=5, sampling=seeded))]


def serve(engine) -> dict:
    """Process 0: submit each request at its step, step until done; the outputs and stats."""
    arrivals = workload(engine.model.cfg.vocab_size)
    requests = [None] * len(arrivals)
    step = 0
    while step <= max(a[0] for a in arrivals) or engine.has_work:
        for i, (at, prompt, options) in enumerate(arrivals):
            if at == step:
                requests[i] = engine.submit(prompt, **options)
        engine.step()
        step += 1
    engine.check()
    stats = engine.stats()
    return {"tokens": [r.tokens for r in requests], "cached": [r.cached_tokens for r in requests],
            "prefix_hit_tokens": stats.prefix_hit_tokens, "offloaded": stats.offloaded_pages,
            "reloaded": stats.reloaded_pages, "host_pages": stats.host_pages}


def count_broadcasts() -> list[int]:
    """Every device broadcast (`multihost_utils.broadcast_one_to_all`, what a device channel sends
    with) from now on, as the sizes broadcast."""
    from jax.experimental import multihost_utils

    calls, original = [], multihost_utils.broadcast_one_to_all

    def counted(x, *args, **kwargs):
        calls.append(int(np.size(x)))
        return original(x, *args, **kwargs)

    multihost_utils.broadcast_one_to_all = counted
    return calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="JSON path; process i writes PATH.i")
    ap.add_argument("--expert", type=int)
    ap.add_argument("--tensor", type=int)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--port", type=int)
    ap.add_argument("--control", default="host", help="Engine(control=...)")
    args = ap.parse_args()

    join_processes(args.num_processes, args.process_id, args.port)

    import dsr1
    from dsr1.serving import Engine

    mesh = dsr1.make_mesh(expert=args.expert, tensor=args.tensor)
    model = dsr1.init_random(TINY, seed=0, mesh=mesh, dtype="float32")
    engine = Engine(model, **SHAPES, control=args.control)
    broadcasts = count_broadcasts()  # from here on: the steps
    if engine.is_leader:
        engine.warm_up()
        result = serve(engine)
        engine.close()
    else:
        engine.follow()
        result = {}
    # Every process keeps its own host copies of offloaded pages, the same ones as process 0's cache.
    result.update(process=jax.process_index(), processes=jax.process_count(), devices=jax.device_count(),
                  host_copies=len(engine._runner.pool.copies), broadcasts=len(broadcasts))
    with open(f"{args.out}.{jax.process_index()}", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
