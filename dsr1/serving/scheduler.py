"""Host-side decisions of the serving engine, one step at a time: which requests join the batch,
which tokens each row runs, which pages it gets, and what the sampled tokens mean.

Continuous batching with `max_seqs + prefill_rows` slots (prompts prefilled ahead of a free decode
row), split evenly over the data-parallel ranks (`Rank`: each its slots, its share of the page pool
and its own prefix cache; a request is placed on the rank with the longest cached prefix, then the
fewest running requests, then the most free pages); at most two calls per step, a prefill call and
a multi-step decode call, of bucketed shapes; requests admitted only when every page they may need
is available, never preempted; a decoding row's input is its slot's last token on device, so a stop
is seen a step late and the extra token discarded. With MTP drafts the host bounds what the device
may have kept. Design: docs/serving.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.cache import SCRATCH_PAGE
from ..generation.output import TokenLogprob
from ..programs.step import Sampled
from .pages import PageAllocator, pages_needed
from .plan import Lane, Lanes, Running, StepPlan, reserved_pages
from .prefix_cache import PrefixCache, PrefixMatch
from .request import Request
from .shapes import SchedulerConfig

__all__ = ["Rank", "Scheduler", "common_pages", "sampled_logprob"]


def common_pages(a: Sequence[int], b: Sequence[int], page_size: int) -> int:
    """Tokens in the whole pages that `a` and `b` both begin with."""
    shared = 0
    while shared + page_size <= min(len(a), len(b)) and a[shared:shared + page_size] == b[shared:shared + page_size]:
        shared += page_size
    return shared


def sampled_logprob(sampled: Sampled, row: int, top: int | None) -> TokenLogprob | None:
    """Row `row`'s token of `sampled` with its log-probability and `top` alternatives (None when `top`
    is None)."""
    if top is None:
        return None
    alternatives = zip(sampled.top_ids[row, :top].tolist(), sampled.top_logprobs[row, :top].tolist())
    return TokenLogprob(int(sampled.tokens[row]), float(sampled.logprobs[row]),
                        tuple((token, logprob) for token, logprob in alternatives if token >= 0))


@dataclasses.dataclass(eq=False)
class Rank:
    """One data-parallel rank's share of the engine: its pages (`allocator`, over the rank's page ids),
    its prefix cache over them, and its free slots."""

    allocator: PageAllocator
    prefix_cache: PrefixCache
    free_slots: list[int]


class Scheduler:
    """Waiting and running requests, slots and pages; plans each step and interprets its tokens.
    Single-threaded: the engine calls it from its loop only."""

    def __init__(self, config: SchedulerConfig, ranks: Sequence[tuple[PageAllocator, PrefixCache]]):
        if len(ranks) != config.ranks:
            raise ValueError(f"{len(ranks)} ranks' pages for a config of {config.ranks} ranks")
        self.config = config
        per = config.rank_slots
        self.ranks = tuple(Rank(allocator, cache, list(range(r * per, (r + 1) * per)))
                           for r, (allocator, cache) in enumerate(ranks))
        self._waiting: deque[Request] = deque()
        self._running: list[Running] = []  # in admission order
        self._page_table = np.full((config.slots, config.table_width), SCRATCH_PAGE, np.int32)
        self.prompt_tokens = self.generated_tokens = self.finished = 0
        self.drafted_tokens = self.accepted_drafts = 0  # MTP drafts verified, and accepted (delivered)

    @classmethod
    def over_ranks(cls, config: SchedulerConfig, store: Any, host_cache_bytes: int = 0,
                   prefix_caching: bool = True) -> Scheduler:
        """A scheduler whose every data-parallel rank has its own pages, prefix cache (its pages' copies
        recorded in `store`, `page_pool.PageLog`) and share of `host_cache_bytes` for offloaded pages."""
        per = config.rank_pages
        return cls(config, [(pages, PrefixCache(pages, config.page_size, store=store,
                                                host_bytes=host_cache_bytes // config.ranks, enabled=prefix_caching))
                            for pages in (PageAllocator(per, first=r * per) for r in range(config.ranks))])

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def running_per_rank(self) -> tuple[int, ...]:
        """Running requests on each rank."""
        counts = [0] * len(self.ranks)
        for seq in self._running:
            counts[seq.rank] += 1
        return tuple(counts)

    def add(self, request: Request) -> None:
        """Queue a request (checked by the engine: it fits in a slot and in the pool)."""
        self._waiting.append(request)

    def holders(self, rank: int = 0) -> list[list[int]]:
        """Every list of `rank`'s pages that should hold a reference now (for `PageAllocator.check`)."""
        return ([seq.pages for seq in self._running if seq.rank == rank]
                + [self.ranks[rank].prefix_cache.held_pages()])

    # ---- planning ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Drop cancelled requests, admit what fits, and plan this step's prefill and decode lanes
        (allocating their pages; counted as dispatched from here on)."""
        self._drop_cancelled()
        admitted = self._admit()
        prefill = self._plan_prefill()
        # Decode several steps in one call, beside a prefill call or not (what frees a slot in the
        # meantime, a budget or a stop, waits for the call to end: at most decode_steps - 1 steps).
        decode = self._plan_decode(self.config.decode_steps)
        return StepPlan(tuple(admitted), tuple(prefill), tuple(decode), self._page_table.copy())

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._waiting if r.cancel_requested]:
            self._waiting.remove(request)
            self.finished += 1
            request.finish("abort")
        for seq in [s for s in self._running if s.request.cancel_requested]:
            self._finish(seq, "abort")

    def _outstanding(self, rank: int) -> int:
        """Pages reserved by `rank`'s running requests and not allocated yet."""
        return sum(seq.reserved - len(seq.pages) for seq in self._running if seq.rank == rank)

    def _place(self, request: Request) -> tuple[int, PrefixMatch] | None:
        """The rank to admit `request` on, and its prefix cache's match there; None if no rank has a free
        slot and the pages the request may need. Affinity first (the longest cached prefix), then
        balance: the fewest running requests, then the most free pages."""
        prompt, best, running = request.prompt, None, self.running_per_rank()
        # The last prompt token always runs; a request wanting prompt log-probabilities runs them all.
        limit = 0 if request.prompt_top_logprobs is not None else len(prompt) - 1
        reserved = reserved_pages(len(prompt), request.sampling.max_new_tokens, self.config.page_size)
        for r, rank in enumerate(self.ranks):
            if not rank.free_slots:
                continue
            match = rank.prefix_cache.match(prompt, limit)
            need = reserved - (len(match.nodes) - match.offloaded)
            # Free pages first; the rest from evicting cached pages other than the match's.
            free = rank.allocator.free_count - self._outstanding(r)
            if not rank.prefix_cache.can_evict(need - free, match):
                continue
            key = (-match.tokens, running[r], -free, r)
            if best is None or key < best[0]:
                best = (key, r, match)
        return None if best is None else best[1:]

    def _admit(self) -> list[Running]:
        admitted = []
        while self._waiting:
            request = self._waiting[0]
            prompt = request.prompt
            placed = self._place(request)
            if placed is None:
                break  # wait: first come, first served
            r, match = placed
            if self._prefix_being_written(prompt, match.tokens):
                break  # wait for the pages a running prompt is about to write, rather than compute them twice
            self._waiting.popleft()
            rank = self.ranks[r]
            reserved = reserved_pages(len(prompt), request.sampling.max_new_tokens, self.config.page_size)
            pages = rank.prefix_cache.acquire(match)
            request.cached_tokens = match.tokens
            request.scheduled_at = time.perf_counter()
            # The prompt's last token is the request's first decode input (docs/serving.md, "Two calls
            # per step"), with drafts too: its first token comes from the decode step either way.
            seq = Running(request, rank.free_slots.pop(0), r, pages, reserved, fed=match.tokens, tokens=list(prompt),
                          prefill_end=len(prompt) - 1)
            self._page_table[seq.slot, :len(pages)] = pages
            self._running.append(seq)
            self.prompt_tokens += len(prompt)
            admitted.append(seq)
        return admitted

    def _prefix_being_written(self, prompt: Sequence[int], cached: int) -> bool:
        """Whether a request still prefilling shares more whole pages with `prompt` than the `cached`
        tokens the prefix cache holds, and has not planned them yet. Requests sharing a system prompt
        often arrive together; admitted in the same step, each would prefill it. Waiting instead (a
        step per chunk) lets the pages enter the cache when the running request's chunk is planned."""
        if not self.ranks[0].prefix_cache.enabled:
            return False
        head = prompt[:len(prompt) - 1]  # the last prompt token always runs
        return any(seq.fed < shared for seq in self._running if seq.prefilling
                   and (shared := common_pages(head, seq.tokens[:seq.prefill_end], self.config.page_size)) > cached)

    def _grow(self, seq: Running, tokens: int) -> None:
        """Give `seq` pages for its first `tokens` tokens (its reservation guarantees they exist)."""
        missing = pages_needed(tokens, self.config.page_size) - len(seq.pages)
        if missing <= 0:
            return
        rank = self.ranks[seq.rank]
        rank.prefix_cache.make_room(missing)
        pages = rank.allocator.allocate(missing)
        self._page_table[seq.slot, len(seq.pages):len(seq.pages) + missing] = pages
        seq.pages += pages

    def _plan_prefill(self) -> list[Lane]:
        lanes, per_rank = [], [0] * self.config.ranks
        for seq in self._running:
            if len(lanes) == self.config.prefill_rows:
                break
            if not seq.prefilling or per_rank[seq.rank] == self.config.prefill_rows // self.config.ranks:
                continue
            per_rank[seq.rank] += 1
            start, count = seq.fed, min(self.config.prefill_chunk, seq.prefill_end - seq.fed)
            self._grow(seq, start + count)
            # The prompt's next token too: with drafts, or for prompt log-probabilities.
            lanes.append(Lane(seq, start, count, tuple(seq.tokens[start:start + count + 1]), sample=False,
                              sample_index=0, feed_last=False))
            seq.fed += count
            # Its full prompt pages are written by the call being planned: later requests may share them.
            self.ranks[seq.rank].prefix_cache.insert(seq.tokens[:seq.fed], seq.pages)
        return lanes

    def _plan_decode(self, steps: int) -> list[Lane]:
        lanes, per_rank = [], [0] * self.config.ranks
        for seq in self._running:
            if len(lanes) == self.config.max_seqs:
                break  # the oldest decode; the rest wait for a row
            if not seq.decoding or per_rank[seq.rank] == self.config.max_seqs // self.config.ranks:
                continue
            matcher = seq.request.matcher
            if matcher is not None and seq.sampled > len(seq.tokens) - seq.prompt_len:
                continue  # its grammar's next mask needs the token still in flight
            runs = 1 if matcher is not None else min(steps, seq.request.sampling.max_new_tokens - seq.sampled)
            # With drafts an iteration writes up to k+1 positions, never past the request's last one.
            fed = min(seq.fed + runs * (self.config.draft_tokens + 1),
                      seq.prompt_len + seq.request.sampling.max_new_tokens - 1)
            self._grow(seq, fed)
            per_rank[seq.rank] += 1
            lanes.append(Lane(seq, seq.fed, 1, (), sample=True, sample_index=seq.sampled, feed_last=True, steps=runs,
                              mask=None if matcher is None else matcher.mask()))
            seq.fed = fed
            seq.sampled += runs
        return lanes

    # ---- results -------------------------------------------------------------------------------
    def complete(self, lanes: Lanes, steps: Sequence[Sampled],
                 accepted: Sequence[np.ndarray] | None = None) -> None:
        """Hand a call's sampled tokens (each of its steps' rows in lane order) to their requests, with
        their log-probabilities where asked for, and finish the requests that hit a stop token or
        string or their budget. Lanes of requests finished since they were planned, or during the
        call, are ignored. With drafts, `accepted` says per step and row whether the token is an
        accepted draft, and a decode call's steps are its iterations' verified positions (k+1 each,
        token -1 where nothing was kept)."""
        k = self.config.draft_tokens
        for row, lane in enumerate(lanes):
            if lane is None or not lane.sample:
                continue
            if k and lane.feed_last:
                self._complete_drafts(lane, row, steps, accepted)
                continue
            for sampled in steps[:lane.steps]:
                if lane.seq.finished:
                    break
                logprob = sampled_logprob(sampled, row, lane.seq.request.top_logprobs)
                self._deliver(lane.seq, int(sampled.tokens[row]), logprob)

    def _complete_drafts(self, lane: Lane, row: int, steps: Sequence[Sampled], accepted: Sequence[np.ndarray]) -> None:
        """A decode lane's tokens with drafts, iteration by iteration; counts the drafts each iteration
        could verify (`min(k, budget left)`) and those accepted, and corrects `Running.sampled`."""
        seq, width = lane.seq, self.config.draft_tokens + 1
        kept = 0
        for start in range(0, lane.steps * width, width):
            tokens = [int(s.tokens[row]) for s in steps[start:start + width]]
            if seq.finished or tokens[0] < 0:
                break
            left = seq.request.sampling.max_new_tokens - (len(seq.tokens) - seq.prompt_len)
            drafted, taken = min(width - 1, left), 0
            for j, token in enumerate(tokens):
                if token < 0 or seq.finished:
                    break
                taken += bool(accepted[start + j][row])
                kept += 1
                self._deliver(seq, token, sampled_logprob(steps[start + j], row, seq.request.top_logprobs))
            seq.request.count_drafts(drafted, taken)
            self.drafted_tokens += drafted
            self.accepted_drafts += taken
        if not seq.finished:
            seq.sampled += kept - lane.steps  # the plan counted one token per iteration

    def complete_prompt(self, lanes: Lanes, positions: Sequence[Sampled]) -> None:
        """Hand a prefill call's prompt log-probabilities (`positions[t]`: each row's token after chunk
        position t) to the requests that asked for them."""
        for row, lane in enumerate(lanes):
            if lane is None:
                continue
            top = lane.seq.request.prompt_top_logprobs
            if lane.prompt_logprobs and not lane.seq.finished:
                count = min(lane.count, lane.seq.prompt_len - 1 - lane.start)
                lane.seq.request.add_prompt_logprobs([sampled_logprob(positions[t], row, top) for t in range(count)])

    def _deliver(self, seq: Running, token: int, logprob: TokenLogprob | None) -> None:
        seq.tokens.append(token)
        self.generated_tokens += 1
        matcher = seq.request.matcher
        stop_token = token in seq.request.sampling.stop_token_ids
        complete = matcher is not None and not stop_token and matcher.advance(token)
        if seq.request.add_tokens([token], None if logprob is None else [logprob]) or complete:
            self._finish(seq, "stop")
        elif len(seq.tokens) - seq.prompt_len >= seq.request.sampling.max_new_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Running, reason: str) -> None:
        """Release a request: its written full pages join the prefix cache, its pages and slot are freed."""
        seq.finished = True
        # Tokens both known here and written by a dispatched step (with drafts, the last known one may not be).
        written = min(seq.fed, len(seq.tokens) - (1 if self.config.draft_tokens else 0))
        rank = self.ranks[seq.rank]
        rank.prefix_cache.insert(seq.tokens[:written], seq.pages)
        rank.allocator.free(seq.pages)
        self._page_table[seq.slot] = SCRATCH_PAGE
        bisect.insort(rank.free_slots, seq.slot)
        self._running.remove(seq)
        self.finished += 1
        seq.request.finish(reason)
