"""The serving engine: continuous batching over the paged latent cache, driven by a host event loop
that plans step n+1 while the device runs step n (JAX's asynchronous dispatch, no threads for the
model). Design: docs/serving.md.

    engine = Engine(model, ...)         # on every process
    if jax.process_index() == 0:
        request = engine.submit(prompt)
        engine.run()
        engine.close()                  # releases the followers
    else:
        engine.follow()
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ..api import Model
from ..core.cache import pool_axes
from ..core.config import outside_vocabulary
from ..core.eplb import ExpertPlacement
from ..core.sharding import to_host
from ..generation.output import Prompt, encode_prompt, needs_tokenizer, opens_thinking, request_sampling
from ..generation.sampling import Sampling
from ..generation.tokenizer import Tokenizer, load_tokenizer
from ..programs.draft_step import unpack_verified
from ..programs.sampling import TOP_LOGPROBS
from ..programs.step import Sampled
from .disaggregate import runner_for
from .grammar import Grammar, grammar_tokenizer
from .page_pool import PageLog, warm_up_ops
from .plan import Lane, StepPlan, reserved_pages
from .prefix_cache import PrefixCacheStats
from .processes import CONTROLS, Processes
from .rebalancing import Rebalancing, check_rebalance
from .request import Request, TextCallback
from .rows import lane_masks, lane_rows, rank_rows, wants_prompt_logprobs
from .scheduler import Scheduler
from .shapes import SchedulerConfig
from .work import Admission, StepWork, host_rules, host_sampling

__all__ = ["CONTROLS", "Engine", "EngineStats"]



@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine. Times are per step, averaged over the steps so far: `host_ms_per_step`
    is the host's own work (planning, dispatch, handing out tokens); `wait_ms_per_step` the time it
    waited for the device; `device_ms_per_step` the device's time per step, measured between the
    moments successive steps' tokens were ready (exact while the host waits; an upper bound when
    the host is the bottleneck, i.e. when `wait_ms_per_step` is about 0)."""

    running: int
    waiting: int
    finished: int
    pages_used: int
    pages_free: int
    pages_cached: int  # device pages held by the prefix cache (some also used by running requests)
    prompt_tokens: int  # of admitted requests
    prefix_hit_tokens: int  # prompt tokens served from the prefix cache instead of recomputed
    offloaded_pages: int  # pages copied to host memory by evictions, in total
    reloaded_pages: int  # pages brought back from host memory, in total
    host_pages: int  # pages held in host memory now
    host_bytes: int
    generated_tokens: int
    steps: int
    tokens_per_second: float  # generated tokens per second of stepping
    host_ms_per_step: float
    wait_ms_per_step: float
    device_ms_per_step: float
    drafted_tokens: int = 0  # MTP drafts verified (draft_tokens > 0)
    accepted_drafts: int = 0  # ... and accepted
    draft_acceptance: float | None = None  # accepted / drafted (None without drafts or before any)
    running_per_rank: tuple[int, ...] = ()  # running requests on each data-parallel rank
    pages_used_per_rank: tuple[int, ...] = ()  # pages in use in each rank's share of the pool


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A dispatched step whose tokens are not read yet: each call's lanes and sampled tokens."""

    calls: tuple[tuple[tuple[Lane, ...], jax.Array], ...]
    dispatched_at: float


@dataclasses.dataclass
class _Timing:
    steps: int = 0
    busy: float = 0.0  # wall time inside step()
    host: float = 0.0
    wait: float = 0.0
    device: float = 0.0
    last_ready: float = 0.0  # when the previous read step's tokens were ready


class Engine:
    """Serve many requests at once on `model`; see docs/serving.md.

    With a model on layout dp (`dsr1.layout_rules("dp")`: rows split over `rules.batch`'s devices, the
    data-parallel ranks), `max_seqs`, `prefill_rows` and `num_pages` are split evenly over the ranks,
    each with its own allocator and prefix cache, and each request runs on one rank (docs/serving.md,
    "Data-parallel ranks").

    Args:
      max_seqs: decode rows (requests decoding at once).
      page_size: tokens per page of the latent cache.
      num_pages: pages in the device pool (page 0 is scratch); with `page_size`, the cache's size.
      prefill_chunk: prompt tokens a request prefills per step at most.
      prefill_rows: requests prefilling in one step at most (the prefill call is at most
        `prefill_rows x prefill_chunk` tokens; see `SchedulerConfig.prefill_shapes`); as many more
        requests than `max_seqs` hold batch slots, prefilled ahead of a free decode row.
      host_cache_bytes: host memory for prefix-cache pages evicted from the device (0: no offload).
      decode_steps: decode steps per decode call (docs/serving.md, "Multi-step decode"): fewer
        dispatches and read-backs, coarser streaming and admission.
      max_seq_len: the longest prompt + output (default: the model's limit, or the pool's size).
      prefix_caching: reuse cached prefixes (False: every prompt is prefilled in full).
      tokenizer: for text and chat prompts and output text (default: the model's own, `Model.tokenizer`;
        else R1's, loaded on the first text prompt).
      draft_tokens: MTP speculative decoding with k drafts per decode iteration (0: off); the model
        needs its MTP module (`dsr1.load(..., mtp=True)`, `dsr1.init_random(..., mtp=True)`).
      control: with several JAX processes, how process 0's step work reaches the others: "host"
        (sockets, `dsr1.serving.control`: the devices run only the steps, and the others dispatch
        step n+1 while step n runs) or "device" (device broadcasts, `dsr1.serving.broadcast`: no
        port to open between hosts).
      batch_invariant: one shape per call kind, `max_seqs` decode rows and `prefill_rows x
        prefill_chunk` prompt tokens, and products whose per-row sums never depend on the other rows
        (`ShardingRules.batch_invariant`: on CPU the routed experts by XLA's loop, not the backend's
        kernels), so a request's tokens do not depend on what else runs; what that makes
        deterministic, per platform, is in docs/serving.md, "Draft numerics". A lone request pays
        for the full shapes.
      disaggregate: `(p, d)`: prefill on the first `p` devices of the model's mesh and decode on the
        next `d`, each side with its own copy of the weights and of the page pool, prefilled pages
        moved to the decode side as they are written (`dsr1.serving.disaggregate`; one process).
      rebalance_every: with a model that holds redundant experts (`Model.with_expert_placement`), the
        steps count the (token, expert) pairs each MoE layer routes to each expert (`expert_load()`)
        and every `rebalance_every` steps the engine places the copies again from them (`rebalance()`;
        0: only when asked). Tokens never change: a copy holds its expert's weights. The experts move in
        place: after a rebalance the model given here has no routed experts left; use `engine.model`.
    """

    def __init__(self, model: Model, *, max_seqs: int = 8, page_size: int = 16, num_pages: int = 512,
                 prefill_chunk: int = 64, prefill_rows: int = 2, host_cache_bytes: int = 0, decode_steps: int = 4,
                 max_seq_len: int | None = None, prefix_caching: bool = True, tokenizer: Tokenizer | None = None,
                 draft_tokens: int = 0, control: str = "host", batch_invariant: bool = False,
                 disaggregate: tuple[int, int] | None = None, rebalance_every: int = 0):
        model.check_draft_tokens(draft_tokens)
        check_sparse_serving(model, draft_tokens)
        check_rebalance(model.params, rebalance_every, disaggregate)
        model = serving_model(model, batch_invariant, disaggregate)
        max_seq_len = _max_seq_len(model, max_seq_len, num_pages * page_size - page_size)
        self.config = SchedulerConfig(max_seqs, page_size, num_pages, prefill_chunk, prefill_rows, max_seq_len,
                                      decode_steps, draft_tokens, batch_invariant, data_parallel_ranks(model))
        self.model, self.tokenizer = model, tokenizer or model.tokenizer
        self._runner = runner_for(model, self.config, disaggregate)
        self._processes = Processes(control)  # several processes: process 0 decides, the others follow
        self.is_leader = self._processes.is_leader
        self._log = PageLog(self._runner.pool.page_bytes)
        self.scheduler = Scheduler.over_ranks(self.config, self._log, host_cache_bytes, prefix_caching)
        self._submitted: deque[Request] = deque()
        self._submit_lock = threading.Lock()
        self._step_lock = threading.RLock()  # an on_text callback may ask for stats() inside a step
        self._next_id = 0
        self._in_flight: deque[_InFlight] = deque()
        self._timing = _Timing()
        self._last_step_time: float | None = None
        self._ll_tokenizer: tuple[Tokenizer, object] | None = None  # llguidance's form of the tokenizer
        self._rebalancing = Rebalancing(rebalance_every)

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, *, sampling: Sampling | None = None, max_new_tokens: int | None = None,
               chat: bool = False, on_text: TextCallback | None = None, logprobs: int | None = None,
               grammar: str | None = None, prompt_logprobs: int | None = None,
               chat_template_kwargs: dict[str, Any] | None = None) -> Request:
        """Queue a prompt (token ids, text, or chat messages, as `dsr1.generate` takes them) and return its
        `Request`. Thread-safe. `max_new_tokens` overrides `sampling.max_new_tokens`; the model's EOS
        always stops; a request without a seed gets a random one now. `on_text(piece)` receives the
        output text as it streams, on the engine's thread. `logprobs=k` (0 to `TOP_LOGPROBS`) records
        each output token's log-probability and the k most likely tokens (`Request.logprobs`);
        `prompt_logprobs=k` the same for each prompt token (`Request.prompt_logprobs`, computed while
        the prompt is prefilled; such a prompt is prefilled in full, never read from the prefix cache).
        `grammar`: an llguidance grammar (`llguidance.LLMatcher.grammar_from_json_schema`, `..._regex`,
        `..._lark`) the output must follow; the request stops when the grammar is complete.
        Raises ValueError for a prompt that could never run (bad token, longer than `max_seq_len`,
        more pages than the pool holds), a bad `logprobs` or `prompt_logprobs`, or a bad grammar.
        `chat_template_kwargs`: the chat template's switches, as `dsr1.generate` takes them."""
        self._require_leader("submit")
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= TOP_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {TOP_LOGPROBS}], got {value!r}")
        tokenizer = self._tokenizer_for(prompt, sampling)
        tokens = encode_prompt(prompt, tokenizer, chat, chat_template_kwargs)
        eos = tokenizer.eos_id if tokenizer else self.model.cfg.eos_token_id
        settings = request_sampling(sampling or Sampling(), eos, max_new_tokens)
        if settings.seed is None:
            settings = dataclasses.replace(settings, seed=secrets.randbits(64))
        self._check_fits(tokens, settings.max_new_tokens)
        host_rules([settings])  # refuses what the slot state cannot hold
        if prompt_logprobs is not None and self.config.draft_tokens:
            raise ValueError("prompt_logprobs needs an engine without draft_tokens")
        matcher = None if grammar is None else self._grammar(grammar, tokenizer)
        with self._submit_lock:
            request = Request(self._next_id, tokens, settings, tokenizer, thinking=opens_thinking(tokens, tokenizer),
                              on_text=on_text, top_logprobs=logprobs, prompt_top_logprobs=prompt_logprobs,
                              matcher=matcher)
            self._next_id += 1
            self._submitted.append(request)
        return request

    def _grammar(self, grammar: str, tokenizer: Tokenizer | None) -> Grammar:
        """A matcher of `grammar` on the engine's tokenizer (its llguidance form built once)."""
        if tokenizer is None:
            tokenizer = self.tokenizer = self.tokenizer or load_tokenizer()
        if self._ll_tokenizer is None or self._ll_tokenizer[0] is not tokenizer:
            self._ll_tokenizer = (tokenizer, grammar_tokenizer(tokenizer, self.model.cfg.vocab_size))
        return Grammar(self._ll_tokenizer[1], grammar)

    def _tokenizer_for(self, prompt: Prompt, sampling: Sampling | None) -> Tokenizer | None:
        """The engine's tokenizer, loaded on the first text prompt (as `dsr1.generate` does)."""
        if self.tokenizer is None and needs_tokenizer(prompt):
            self.tokenizer = load_tokenizer()
        if self.tokenizer is None and sampling is not None and sampling.stop_strings:
            raise ValueError("stop strings need a tokenizer")
        return self.tokenizer

    def _check_fits(self, tokens: list[int], max_new_tokens: int) -> None:
        if (problem := outside_vocabulary(tokens, self.model.cfg.vocab_size)) is not None:
            raise ValueError(problem)
        total = len(tokens) + max_new_tokens - 1
        if total > self.config.max_seq_len:
            raise ValueError(f"prompt ({len(tokens)}) + max_new_tokens ({max_new_tokens}) exceeds the engine's "
                             f"max_seq_len={self.config.max_seq_len}")
        pages = reserved_pages(len(tokens), max_new_tokens, self.config.page_size)
        capacity = self.scheduler.ranks[0].allocator.capacity
        if pages > capacity:
            ranks = self.config.ranks
            where = "the pool" if ranks == 1 else f"each of the {ranks} ranks' shares of the pool"
            raise ValueError(f"the request needs {pages} pages of {self.config.page_size} tokens; {where} has "
                             f"{capacity}")

    # ---- the loop ------------------------------------------------------------------------------
    @property
    def kv_cache_usage(self) -> float:
        """The share of the pool's pages in use (0..1): held by requests or by the prefix cache."""
        used, capacity = self._pages()
        return used / max(capacity, 1)

    def _pages(self) -> tuple[int, int]:
        """Pages in use, and pages that can be handed out, over every rank."""
        allocators = [rank.allocator for rank in self.scheduler.ranks]
        return sum(a.used_count for a in allocators), sum(a.capacity for a in allocators)

    @property
    def last_step_time(self) -> float | None:
        """`time.monotonic()` when the last step completed (None before any)."""
        return self._last_step_time

    @property
    def has_work(self) -> bool:
        """Requests are waiting, running, or have tokens not read yet."""
        return bool(self._submitted or self.scheduler.waiting or self.scheduler.running or self._in_flight)

    def step(self) -> bool:
        """Plan and dispatch one step, then read the previous step's tokens. Returns `has_work`.
        Call from one thread at a time (submit and cancel may come from any thread)."""
        self._require_leader("step")
        with self._step_lock:
            start = time.perf_counter()
            with self._submit_lock:
                while self._submitted:
                    self.scheduler.add(self._submitted.popleft())
            plan = self.scheduler.schedule()
            # Page operations recorded outside planning (host copies released while reading tokens)
            # go out with the next step that runs anything.
            work, lanes = self._work(plan) if not plan.empty else (StepWork(), ())
            if not work.empty:
                tokens = self._launch(work)
                if tokens:
                    self._in_flight.append(_InFlight(tuple(zip(lanes, tokens)), time.perf_counter()))
            waited = 0.0
            # Read the step before this one (the device is busy with this one meanwhile); with nothing
            # new dispatched, read everything.
            while len(self._in_flight) > (0 if plan.empty else 1):
                waited += self._read(self._in_flight.popleft())
            self._runner.pool.settle(everything=not self._in_flight)
            self._record(time.perf_counter() - start, waited, counted=not plan.empty or waited > 0)
            self._last_step_time = time.monotonic()
            if self._rebalancing.due(self._timing.steps):
                self.rebalance()
            return self.has_work

    def run(self) -> None:
        """Step until no work is left."""
        while self.step():
            pass

    def follow(self) -> None:
        """(Processes other than 0) Dispatch the steps process 0 decides, until it calls `close()`."""
        def run(work: StepWork) -> None:
            self._runner.pool.begin_step()
            self._runner.run(work)
            self._runner.pool.settle()
            self.model = self._runner.model  # a rebalance moves the experts

        self._processes.follow(run)
        self._runner.pool.settle(everything=True)

    def close(self) -> None:
        """(Process 0) Release the processes in `follow()`; the engine cannot step afterwards. A no-op in
        a single process."""
        self._require_leader("close")
        with self._step_lock:
            self._processes.close()

    def _require_leader(self, action: str) -> None:
        self._processes.require_leader(action)

    def _work(self, plan: StepPlan) -> tuple[StepWork, tuple[tuple[Lane | None, ...], ...]]:
        """The plan's device work: the page copies recorded while planning, the admissions, then
        the prefill call (the smallest shape that holds it) and the decode call, idle rows padding
        each to its shape; and each call's lanes by row (`rank_rows`), as its results come back."""
        cfg = self.config
        admissions = tuple(Admission(seq.slot, host_sampling([seq.request.sampling]),
                                     np.asarray(seq.request.prompt, np.int32), host_rules([seq.request.sampling]))
                           for seq in plan.admitted)
        shapes = self._call_shapes(plan)
        groups = tuple(rank_rows(lanes, rows, cfg.ranks) for lanes, (rows, _) in zip(_lane_groups(plan), shapes))
        calls = tuple(lane_rows(lanes, *shape, cfg.slots) for lanes, shape in zip(groups, shapes))
        masks = tuple(lane_masks(lanes, len(rows.slots)) for lanes, rows in zip(groups, calls))
        # Page ids as the devices holding them number them: each rank's share starts at its scratch page 0.
        table = plan.page_table % cfg.rank_pages if calls else None
        return StepWork(self._log.take(), admissions, calls, table, masks), groups

    def _call_shapes(self, plan: StepPlan) -> tuple[tuple[int, int], ...]:
        """Each call's `(rows, chunk)`: the prefill call's (the smallest shape that holds it), then the
        decode call's."""
        cfg, shapes = self.config, []
        if plan.prefill:
            shapes.append(_widened(cfg.prefill_shape(plan.prefill), cfg, plan.prefill))
        if plan.decode:
            shapes.append((cfg.decode_shape(plan.decode), 1))
        return tuple(shapes)


    def _launch(self, work: StepWork) -> tuple[jax.Array, ...]:
        """Send the work to the other processes (if any), then dispatch it here; each call's tokens
        start their copy to the host."""
        self._processes.send(work)
        self._runner.pool.begin_step()
        tokens = self._runner.run(work)
        for out in tokens:
            out.copy_to_host_async()
        return tokens

    def _read(self, step: _InFlight) -> float:
        """Wait for a dispatched step's tokens and hand them out; returns the seconds waited."""
        start = time.perf_counter()
        results = [[self._unpack(s) for s in to_host(out)] for _, out in step.calls]
        ready = time.perf_counter()
        self._timing.device += ready - max(step.dispatched_at, self._timing.last_ready)
        self._timing.last_ready = ready
        for (lanes, _), steps in zip(step.calls, results):
            sampled, accepted = zip(*steps)
            if wants_prompt_logprobs(lanes) and not self.config.draft_tokens:  # then one entry per position
                self.scheduler.complete_prompt(lanes, sampled[1:])
                sampled = sampled[:1]
            self.scheduler.complete(lanes, sampled, accepted if self.config.draft_tokens else None)
        return ready - start

    def _unpack(self, packed: np.ndarray) -> tuple[Sampled, np.ndarray | None]:
        """One step of a call's output: what was sampled, and (with drafts) which tokens are accepted drafts."""
        if self.config.draft_tokens:
            return unpack_verified(packed)
        return Sampled.unpack(packed), None

    def _record(self, elapsed: float, waited: float, counted: bool) -> None:
        if counted:
            t = self._timing
            t.steps += 1
            t.busy += elapsed
            t.host += elapsed - waited
            t.wait += waited

    # ---- redundant experts ---------------------------------------------------------------------
    def expert_load(self) -> np.ndarray | None:
        """(Process 0) The (token, expert) pairs each MoE layer routed to each logical expert since the
        last placement, `[L_moe, E]` (waits for the steps dispatched); None unless the model holds
        redundant experts (`Model.with_expert_placement`)."""
        self._require_leader("expert_load")
        with self._step_lock:
            return self._rebalancing.since(self._runner.expert_load())

    def rebalance(self) -> ExpertPlacement:
        """(Process 0) Place the model's redundant experts again from `expert_load()`
        (`dsr1.core.eplb.balance`: the hottest experts get the copies, dealt to the least-loaded
        devices) and move their weights there on every process; the counts start again. Returns the
        new placement. Tokens are unchanged (a copy holds its expert's weights)."""
        self._require_leader("rebalance")
        with self._step_lock:
            total = self._runner.expert_load()
            placement = self._rebalancing.placement(self.model.params, total)
            self._launch(StepWork(placement=placement.physical))
            self._runner.pool.settle(everything=not self._in_flight)
            self.model = self._runner.model
            self._rebalancing.placed(self._timing.steps, total)
            return placement

    # ---- warm-up, checks, stats ----------------------------------------------------------------
    def warm_up(self) -> None:
        """Compile every program the loop runs (idle rows and out-of-range slots: nothing changes), so
        that serving never compiles. With several processes, the others must be in `follow()`."""
        self._require_leader("warm_up")
        cfg = self.config
        with self._step_lock:
            warm_up_ops(self._log)
            idle = [Sampling(seed=0)]
            admit = Admission(cfg.slots, host_sampling(idle), np.zeros(1, np.int32), host_rules(idle))  # dropped
            shapes = (*(_widened(shape, cfg) for shape in cfg.prefill_shapes),
                      *((rows, 1) for rows in cfg.decode_shapes))
            calls = [lane_rows((), rows, chunk, cfg.slots) for rows, chunk in shapes]
            for rows in cfg.decode_shapes if cfg.decode_steps > 1 else ():
                calls.append(lane_rows((), rows, 1, cfg.slots))  # multi-step: idle rows ask for every step
                calls[-1].steps[:] = cfg.decode_steps
            table = np.zeros((cfg.slots, cfg.table_width), np.int32)
            for out in self._launch(StepWork(self._log.take(), (admit,), tuple(calls), table)):
                to_host(out)
            self._runner.warm_up()
            self._runner.pool.settle(everything=True)

    def check(self) -> None:
        """Verify the page allocator against every holder (running requests, the prefix cache);
        raises `PageError` on a leak, a double free or a broken free list."""
        with self._step_lock:
            for r, rank in enumerate(self.scheduler.ranks):
                rank.allocator.check(self.scheduler.holders(r))

    def stats(self) -> EngineStats:
        with self._step_lock:
            t, s = self._timing, self.scheduler
            ranks = [rank.prefix_cache.stats() for rank in s.ranks]
            cache = PrefixCacheStats(*(sum(values) for values in zip(*(dataclasses.astuple(r) for r in ranks))))
            per_step = 1000.0 / max(t.steps, 1)
            used, capacity = self._pages()
            return EngineStats(
                running=s.running, waiting=s.waiting + len(self._submitted), finished=s.finished,
                pages_used=used, pages_free=capacity - used,
                pages_cached=cache.device_pages, prompt_tokens=s.prompt_tokens, prefix_hit_tokens=cache.hit_tokens,
                offloaded_pages=cache.offloaded, reloaded_pages=cache.reloaded, host_pages=cache.host_pages,
                host_bytes=cache.host_bytes, generated_tokens=s.generated_tokens, steps=t.steps,
                tokens_per_second=s.generated_tokens / t.busy if t.busy else 0.0,
                host_ms_per_step=t.host * per_step, wait_ms_per_step=t.wait * per_step,
                device_ms_per_step=t.device * per_step, drafted_tokens=s.drafted_tokens,
                accepted_drafts=s.accepted_drafts,
                draft_acceptance=s.accepted_drafts / s.drafted_tokens if s.drafted_tokens else None,
                running_per_rank=s.running_per_rank(),
                pages_used_per_rank=tuple(rank.allocator.used_count for rank in s.ranks))


def check_sparse_serving(model: Model, draft_tokens: int) -> None:
    """ValueError for what the engine cannot serve a sparse-attention (V3.2) model with: MTP drafts (the
    draft programs' MTP pool holds no indexer keys), and a page pool split over each row's positions
    (the indexer reads all of a row's keys on one device)."""
    if not model.cfg.sparse_attention:
        return
    if draft_tokens:
        raise ValueError("draft_tokens > 0: the engine serves no MTP drafts for a sparse-attention (V3.2) model "
                         "(its draft pool holds no indexer keys); use draft_tokens=0 (dsr1.generate drafts for it)")
    if pool_axes(model.mesh, model.rules)[1] is not None:
        raise ValueError(f"a sparse-attention (V3.2) model reads each row's pages on one device: the engine cannot "
                         f"split a row's pages over mesh axis {model.rules.positions!r} (layout dp on a mesh whose "
                         f"{model.rules.positions!r} axis is larger than 1); use a mesh without it")


def data_parallel_ranks(model: Model) -> int:
    """The attention data-parallel ranks of `model`'s layout: the devices of its rows' mesh axis
    (`ShardingRules.batch`), 1 when rows are not split."""
    return model.rules.devices(model.mesh, "batch")


def serving_model(model: Model, batch_invariant: bool, disaggregate: tuple[int, int] | None) -> Model:
    """`model` as the engine runs it: a rank's pages whole on each of its devices (the positions not
    split over `tensor`: a row's pages dealt out over a rank's devices would need an allocator per
    device, docs/limits.md), and with `batch_invariant` its products' per-row sums independent of
    the other rows. Data-parallel ranks do not run disaggregated."""
    rules = dataclasses.replace(model.rules, positions=None, batch_invariant=model.rules.batch_invariant
                                or batch_invariant)
    ranks = data_parallel_ranks(model)
    if ranks > 1 and disaggregate is not None:
        raise ValueError(f"attention data parallelism ({ranks} ranks over mesh axis {model.rules.batch!r}) "
                         "does not run disaggregated yet: use layout 'tp' with disaggregate")
    return model if rules == model.rules else dataclasses.replace(model, rules=rules)


def _max_seq_len(model: Model, asked: int | None, pool_tokens: int) -> int:
    """The engine's longest prompt + output: as asked, else the model's limit or the pool's size."""
    if asked is None:
        return min(model.cfg.max_position_embeddings, pool_tokens)
    if asked > model.cfg.max_position_embeddings:
        raise ValueError(f"max_seq_len={asked} exceeds max_position_embeddings={model.cfg.max_position_embeddings}")
    return asked


def _widened(shape: tuple[int, int], cfg: SchedulerConfig, lanes: Sequence[Lane] = ()) -> tuple[int, int]:
    """A prefill call's `(rows, chunk)` as its rows' width: with drafts, or when a lane wants prompt
    log-probabilities, one lookahead token more (the prompt's token after the chunk)."""
    rows, chunk = shape
    return rows, chunk + max(cfg.prefill_width, int(wants_prompt_logprobs(lanes)))


def _lane_groups(plan: StepPlan) -> tuple[tuple[Lane, ...], ...]:
    """The lanes of each call `Engine._work` makes, in call order."""
    return tuple(lanes for lanes in (plan.prefill, plan.decode) if lanes)
