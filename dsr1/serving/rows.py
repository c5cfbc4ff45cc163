"""A step's calls as the devices take them: each call's lanes by row (`rank_rows`, the data-parallel
ranks' blocks of rows) and their host arrays (`lane_rows`: `StepRows`, the wire form of a call;
`lane_masks`: the grammars' bitmasks)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..programs.step import StepRows
from .plan import Lane, Lanes

__all__ = ["lane_masks", "lane_rows", "rank_rows", "wants_prompt_logprobs"]


def wants_prompt_logprobs(lanes: Lanes) -> bool:
    """Some lane of a call wants prompt log-probabilities: the call carries each prompt's next token."""
    return any(lane.prompt_logprobs for lane in lanes if lane is not None)


def rank_rows(lanes: Sequence[Lane], rows: int, ranks: int) -> tuple[Lane | None, ...]:
    """A call's `lanes` by row: each rank's lanes in order at the start of its block of `rows / ranks`
    rows (the block of the call's rows that the rank's devices hold), None in the idle rows between.
    One rank: the lanes themselves (the idle rows follow them)."""
    if ranks == 1:
        return tuple(lanes)
    out: list[Lane | None] = [None] * rows
    filled = [r * (rows // ranks) for r in range(ranks)]
    for lane in lanes:
        out[filled[lane.seq.rank]] = lane
        filled[lane.seq.rank] += 1
    return tuple(out)


def lane_masks(lanes: Lanes, rows: int) -> np.ndarray | None:
    """The grammar bitmasks of a call `[rows, words]` (row i: lane i's), or None when no lane has one."""
    masks = [lane.mask for lane in lanes if lane is not None and lane.mask is not None]
    if not masks:
        return None
    out = np.full((rows, masks[0].shape[0]), -1, np.int32)
    for i, lane in enumerate(lanes):
        if lane is not None and lane.mask is not None:
            out[i] = lane.mask
    return out


def lane_rows(lanes: Lanes, rows: int, chunk: int, idle_slot: int) -> StepRows:
    """The host arrays of one call: lane i in row i, the other rows idle (slot `idle_slot`, count 0)."""
    out = StepRows(slots=np.full(rows, idle_slot, np.int32), tokens=np.zeros((rows, chunk), np.int32),
                   starts=np.zeros(rows, np.int32), counts=np.zeros(rows, np.int32),
                   feed_last=np.zeros(rows, bool), sample=np.zeros(rows, bool), sample_index=np.zeros(rows, np.int32),
                   logprobs=np.zeros(rows, bool), steps=np.ones(rows, np.int32),
                   prompt_logprobs=np.zeros(rows, bool), mask_row=np.full(rows, -1, np.int32))
    for i, lane in enumerate(lanes):
        if lane is None:
            continue
        out.slots[i], out.starts[i], out.counts[i] = lane.seq.slot, lane.start, lane.count
        tokens = lane.tokens[:chunk]  # a prompt's next token only when the call carries it
        out.tokens[i, :len(tokens)] = tokens
        out.prompt_logprobs[i] = lane.prompt_logprobs
        out.mask_row[i] = i if lane.mask is not None else -1
        out.feed_last[i], out.sample[i], out.sample_index[i] = lane.feed_last, lane.sample, lane.sample_index
        out.logprobs[i] = lane.sample and lane.seq.request.top_logprobs is not None
        out.steps[i] = lane.steps
    return out
