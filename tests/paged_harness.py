"""Drive `dsr1.programs.extend` over prompts the way a serving loop would, and a mesh worker.

`run_chunks` places the prompts' rows in batch slots among idle ones, allocates pages on demand
from a fragmented `PageAllocator` (so rows own interleaved, out-of-order pages), feeds each row
its tokens in chunks (rows join late and finish early), and returns the logits predicted at every
position. Run as `python -m tests.paged_harness` it does the same on a mesh in a subprocess
(the fake device count must be set before JAX starts).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

import numpy as np

PAGE_SIZE = 6  # no prompt length of the fixtures (40, 29, 17) is a multiple of it
WIDTH = 11  # pages per row: 66 positions, enough for a 64-token chunk after a short first one
SLOTS = 5  # batch slots: the fixtures' 3 rows and 2 idle slots
ROW_SLOTS = (3, 0, 2)  # the slot of each row; slots 1 and 4 stay idle
NUM_PAGES = 40


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the rows are fed: `chunk` tokens per step (the bucket T); row r joins at step `join[r]`
    and its first step feeds at most `first[r]` tokens; `absorbed` and `block_pages` as in extend."""

    chunk: int
    absorbed: bool
    block_pages: int | None
    first: tuple[int, ...] = (5, 11, 3)
    join: tuple[int, ...] = (0, 0, 1)


def fragmented_allocator():
    """An allocator whose free list is out of order: every other one of the first pages is held."""
    from dsr1.serving.pages import PageAllocator

    allocator = PageAllocator(NUM_PAGES)
    held = allocator.allocate(12)
    allocator.free(held[::2])
    return allocator, held[1::2]


def idle_inputs(tables: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Page tables and starts that idle slots carry: real pages of other rows and a nonzero start,
    so a wrong read or write through an idle slot would corrupt a live row."""
    from dsr1.serving.pages import page_table_array

    decoy = tables[0] if tables and tables[0] else [1]
    return page_table_array([decoy] * SLOTS, WIDTH), np.full(SLOTS, 7, np.int32)


def run_chunks(model, cache, tokens: np.ndarray, lengths: np.ndarray, plans: Sequence[Plan],
               steps_per_plan: Sequence[int] | None = None):
    """Feed every row's tokens through `programs.extend`, step by step, using `plans[i]` for the
    steps of phase i (`steps_per_plan[i]` steps; the last plan runs until every row is done).

    Returns `(logits {(row, position): [V]}, hidden {(row, position): [D]}, cache, zero_ok)`:
    logits and hidden predicted at each fed position; `zero_ok` tells whether every output at an
    index past a slot's count was exactly zero.
    """
    from dsr1 import programs
    from dsr1.core.sharding import put_replicated, to_host
    from dsr1.serving.pages import check_extend_batch, page_table_array, pages_needed

    allocator, pinned = fragmented_allocator()
    rows = len(lengths)
    tables: list[list[int]] = [[] for _ in range(rows)]
    done = np.zeros(rows, np.int64)
    logits_out, hidden_out, zero_ok, step = {}, {}, True, 0
    while (done < lengths).any():
        phase = _phase(step, steps_per_plan, len(plans))
        plan = plans[phase]
        counts = np.array([_count(plan, r, step, done[r], lengths[r]) for r in range(rows)])
        for r in range(rows):  # pages on demand, rows interleaved
            tables[r] += allocator.allocate(pages_needed(int(done[r] + counts[r]), PAGE_SIZE) - len(tables[r]))
        page_table, starts = idle_inputs(tables)
        slot_counts = np.zeros(SLOTS, np.int32)
        slot_tokens = np.zeros((SLOTS, plan.chunk), np.int32)
        for r, s in enumerate(ROW_SLOTS):
            page_table[s] = page_table_array([tables[r]], WIDTH)[0]
            starts[s], slot_counts[s] = done[r], counts[r]
            slot_tokens[s, :counts[r]] = tokens[r, done[r]:done[r] + counts[r]]
        logits_at = np.broadcast_to(np.arange(plan.chunk, dtype=np.int32), (SLOTS, plan.chunk))
        check_extend_batch(slot_tokens, starts, slot_counts, page_table, logits_at, page_size=PAGE_SIZE,
                           num_pages=NUM_PAGES)
        args = put_replicated((slot_tokens, starts, slot_counts, page_table, logits_at), model.mesh)
        logits, hidden, cache = programs.extend(model.params, cache, *args, **model.program_kwargs,
                                                absorbed=plan.absorbed, block_pages=plan.block_pages)
        logits, hidden = to_host(logits), to_host(hidden)
        for r, s in enumerate(ROW_SLOTS):
            for k in range(counts[r]):
                logits_out[r, int(done[r]) + k] = logits[s, k]
                hidden_out[r, int(done[r]) + k] = hidden[s, k]
        past = np.arange(plan.chunk)[None, :] >= slot_counts[:, None]
        zero_ok &= not logits[past].any() and not hidden[past].any()
        done += counts
        step += 1
    for table in tables:
        allocator.free(table)
    allocator.check([pinned])
    return logits_out, hidden_out, cache, zero_ok


def _phase(step: int, steps_per_plan: Sequence[int] | None, n_plans: int) -> int:
    if steps_per_plan is None:
        return 0
    ends = np.cumsum(steps_per_plan)
    return min(int(np.searchsorted(ends, step, side="right")), n_plans - 1)


def _count(plan: Plan, row: int, step: int, done: int, length: int) -> int:
    if step < plan.join[row]:
        return 0
    limit = plan.first[row] if done == 0 else plan.chunk
    return int(min(plan.chunk, limit, length - done))


def new_cache(model, kv_cache_dtype: str | None = None):
    from dsr1 import programs

    return programs.paged_cache(cfg=model.cfg, mesh=model.mesh, num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                                dtype=model.dtype, kv_cache_dtype=kv_cache_dtype)


MESH_PLANS = (Plan(chunk=7, absorbed=True, block_pages=3), Plan(chunk=64, absorbed=False, block_pages=3))


def mesh_logits(model, tokens: np.ndarray, lengths: np.ndarray) -> dict:
    """One step of 7-token chunks (absorbed), then 64-token chunks (expanded, reading the pages)."""
    logits, _, _, _ = run_chunks(model, new_cache(model), tokens, lengths, MESH_PLANS, steps_per_plan=[2])
    return logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", required=True)
    ap.add_argument("--inputs", required=True, help="npz with tokens, lengths")
    ap.add_argument("--out", required=True)
    ap.add_argument("--expert", type=int, required=True)
    ap.add_argument("--tensor", type=int, required=True)
    args = ap.parse_args()

    import dsr1

    inputs = np.load(args.inputs)
    mesh = dsr1.make_mesh(expert=args.expert, tensor=args.tensor)
    model = dsr1.load(args.folder, mesh=mesh, dtype="float32", progress=False)
    logits = mesh_logits(model, inputs["tokens"], inputs["lengths"])
    keys = sorted(logits)
    heads = model.params["moe_layers"]["q_b"]
    np.savez(args.out, keys=np.array(keys), logits=np.stack([logits[k] for k in keys]),
             devices=len(mesh.devices.flat), local_head_shard=np.array(heads.addressable_shards[0].data.shape))


if __name__ == "__main__":
    main()
