"""The serving engine's programs with MTP drafts (`dsr1.serving.Engine(..., draft_tokens=k)`).

The MTP module keeps its own one-layer page pool, under the same page ids and tables as the
model's: page p of a sequence holds both pools' latents for the same positions, so whatever
shares, offloads or reloads a page moves both. Both pools always hold the same positions of a
slot, `< lengths[slot]`: MTP position i reads the model's hidden `h_i` and the token `t_{i+1}`,
so every call runs the module on the positions its model call just ran, with the token after
each (the next prompt token, or the token kept after the last one): nothing is ever pending
between calls. The module's output at the last position (`mtp_hidden`) gives the next call its
first draft.

A prompt is prefilled as without drafts, all but its last token, and that token is the request's
first decode input: the first token, like every later one, comes from a verification (`_verify`: one
`extend` of the k+1 positions, one pass over the weights). Its logits equal an engine's without drafts
up to float rounding; with `Engine(batch_invariant=True)` each position runs the decode step's own
one-token computation (`_verify_by_steps`), so greedy tokens are those of an engine without drafts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ..core import model
from ..core.attention import PagedContext, attend_extend, use_absorbed
from ..core.cache import PagedKVCache, empty_paged_cache, keep_pool_layout, token_slots, write_rank_tokens
from ..core.config import Config
from ..core.mtp import mtp_logits, mtp_module, mtp_step
from ..core.params import Params
from ..core.sharding import DEFAULT_RULES, ShardingRules, keep_replicated
from . import speculative
from .sampling import (
    TOP_LOGPROBS,
    SamplingArrays,
    TokenRuleRows,
    VocabSplit,
    apply_masks,
    token_logprobs,
    vocab_split,
)
from .step import Sampled, SlotState, StepRows, admit_slot, count_routing, slot_rows, slot_state

_MODEL = ("cfg", "mesh", "rules")  # the static arguments every program shares

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftSlotState:
    """`SlotState` plus what drafting keeps per slot. With drafts a decode call keeps 1..k+1 tokens per
    row, decided on device, so the slot's length and sample count live here (the host only bounds them)."""

    slots: SlotState
    lengths: jax.Array  # [S] int32 positions cached in both pools (the last token's position)
    generated: jax.Array  # [S] int32 tokens sampled so far (the random stream's index; the budget)
    mtp_hidden: jax.Array  # [S, D] float32 the MTP module's output at position lengths - 1


VERIFIED_WIDTH = 3 + 2 * TOP_LOGPROBS  # a draft call's packed token: `Sampled.pack`, then "an accepted draft"


def unpack_verified(packed: np.ndarray) -> tuple[Sampled, np.ndarray]:
    """(Host) one step of a draft program's output `[B, VERIFIED_WIDTH]`: the tokens (-1 where none was
    emitted) with their log-probabilities, and whether each is an accepted draft `[B]` bool."""
    packed = np.asarray(packed, np.int32)
    return Sampled.unpack(packed[:, :-1]), packed[:, -1] != 0


@functools.partial(jax.jit, static_argnames=("mesh", "vocab_size", "hidden_size", "expert_load"))
def draft_slot_state(sampling: SamplingArrays, *, mesh: Mesh, vocab_size: int, hidden_size: int,
                     expert_load: tuple[int, int] | None = None) -> DraftSlotState:
    """Fresh `DraftSlotState` for `sampling.batch_size` slots (`expert_load`: see `slot_state`)."""
    slots = sampling.batch_size
    state = DraftSlotState(slot_state(sampling, mesh=mesh, vocab_size=vocab_size, expert_load=expert_load),
                           jnp.zeros(slots, jnp.int32),
                           jnp.zeros(slots, jnp.int32), jnp.zeros((slots, hidden_size), jnp.float32))
    return jax.tree.map(lambda a: keep_replicated(a, mesh), state)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def admit_draft_slot(state: DraftSlotState, packed: jax.Array, rule_rows: TokenRuleRows, *,
                     mesh: Mesh) -> DraftSlotState:
    """`admit_slot` for a `DraftSlotState`: its length is the prompt's but the last token (the first
    decode input; prefill calls write those positions before the slot decodes), nothing sampled, no MTP
    output yet (a prompt read whole from the prefix cache drafts its first token from zeros)."""
    slot, length = packed[0], jnp.maximum(packed[1] - 1, 0)
    with jax.named_scope("admit_draft_slot"):
        state = DraftSlotState(admit_slot(state.slots, packed, rule_rows, mesh=mesh),
                               state.lengths.at[slot].set(length, mode="drop"),
                               state.generated.at[slot].set(0, mode="drop"),
                               state.mtp_hidden.at[slot].set(0, mode="drop"))
    return jax.tree.map(lambda a: keep_replicated(a, mesh), state)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def take_mtp_hidden(state: DraftSlotState, hidden: jax.Array, taken: jax.Array, *, mesh: Mesh) -> DraftSlotState:
    """`state` with the MTP outputs of the slots `taken [S]` (bool) from `hidden [S, D]` (another state's
    `mtp_hidden`: a prefill on other devices, `dsr1.serving.disaggregate`)."""
    state = dataclasses.replace(state, mtp_hidden=jnp.where(taken[:, None], hidden, state.mtp_hidden))
    return jax.tree.map(lambda a: keep_replicated(a, mesh), state)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "num_pages", "page_size", "dtype", "kv_cache_dtype",
                                             "rules"))
def mtp_paged_cache(*, cfg: Config, mesh: Mesh, num_pages: int, page_size: int, dtype: Any,
                    kv_cache_dtype: str | None, rules: ShardingRules = DEFAULT_RULES) -> PagedKVCache:
    """`paged_cache` for the MTP module: one layer, the same pages (split over the ranks as the model's)."""
    cache = empty_paged_cache(1, num_pages, page_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim, jnp.dtype(dtype),
                              kv_cache_dtype, mesh.devices.flat[0].platform)
    return keep_pool_layout(cache, mesh, rules)


def _paged_mtp(params: Params, pool: PagedKVCache, hidden: jax.Array, next_tokens: jax.Array, starts: jax.Array,
               counts: jax.Array, table: jax.Array, cfg: Config, mesh: Mesh,
               rules: ShardingRules) -> tuple[jax.Array, jax.Array, PagedKVCache]:
    """The MTP module on T positions per row from `starts` (`hidden [B, T, D]`, `next_tokens [B, T]`), attending
    to the row's positions `< starts` in the MTP pool (`table [B, P]`) and causally to each other, as
    `extend` runs the model: its logits `[B, T, V]`, its output `[B, T, D]` and the pool with the
    latents of each row's first `counts` positions written (the rest go to the scratch page)."""
    chunk = hidden.shape[1]
    cached = jnp.where(counts > 0, starts, 0)
    context = PagedContext(pool, table, cached, model.default_block_pages(pool.page_size, table.shape[1], chunk))
    positions = cached[:, None] + jnp.arange(chunk)
    layer = jnp.zeros((), jnp.int32)

    def attend(p: dict, h: jax.Array):
        return attend_extend(p, h, positions, context, layer, cfg, absorbed=use_absorbed(cfg, chunk),
                             one_device=mesh.size == 1, mesh=mesh, rules=rules)

    logits, x, (c_kv, k_pe) = mtp_step(params, hidden, next_tokens, attend, cfg=cfg, mesh=mesh, rules=rules,
                                       index=speculative.MTP_MODULE)
    with jax.named_scope("write_mtp_pages"):
        pages, slots = token_slots(table, cached, counts, chunk, pool.page_size)
        page_index = positions // pool.page_size
        pool = write_rank_tokens(pool, c_kv[None], k_pe[None], pages, slots, page_index, mesh, rules)
    return logits, x, keep_pool_layout(pool, mesh, rules)


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
    """Row b's entry `index[b]` of `x [B, T, ...]`: `[B, ...]`."""
    return jnp.take_along_axis(x, index.reshape(-1, *([1] * (x.ndim - 1))), axis=1)[:, 0]


def _verified_pack(tokens: jax.Array, logits: jax.Array, wanted: jax.Array, accepted: jax.Array,
                   split: VocabSplit | None) -> jax.Array:
    """`Sampled.pack` of `tokens [B]` (-1: none) with their log-probabilities where `wanted`, then `accepted`."""
    packed = Sampled.pack(tokens, *token_logprobs(logits, jnp.maximum(tokens, 0), wanted & (tokens >= 0), split))
    return jnp.concatenate([packed, accepted.astype(jnp.int32)[:, None]], axis=1)


@functools.partial(jax.jit, static_argnames=_MODEL, donate_argnames=("cache", "mtp_cache", "state"))
def serve_draft_prefill(params: Params, cache: PagedKVCache, mtp_cache: PagedKVCache, state: DraftSlotState,
                        packed_rows: jax.Array, page_table: jax.Array, *, cfg: Config, mesh: Mesh,
                        rules: ShardingRules) -> tuple[jax.Array, PagedKVCache, PagedKVCache, DraftSlotState]:
    """`serve_step`'s prompt chunks with drafts on: rows of `T + 1` tokens, `T` new ones and, in column
    `counts[b]`, the prompt's token after the chunk (the lookahead). The model runs the chunk (`extend`,
    as without drafts: nothing is sampled), and the MTP module its positions with their next tokens,
    filling its pool as far as the model's; the module's output at a row's last position is its slot's
    `mtp_hidden` (after the prompt's last chunk: the first token's draft). Returns `[1, B,
    VERIFIED_WIDTH]` of no tokens (the call's shape as a decode call's), both pools and the state."""
    rows = StepRows.unpack(packed_rows)
    chunk = rows.tokens.shape[1] - 1
    with jax.named_scope("step_inputs"):
        table = page_table[jnp.minimum(rows.slots, page_table.shape[0] - 1)]
        tokens = rows.tokens[:, :chunk]
        last = jnp.maximum(rows.counts - 1, 0)
    # Hidden states at every position (the MTP module reads them all); no logits (past the chunk).
    _, hidden, cache, routing = model.extend_routed(
        params, cache, tokens, rows.starts, rows.counts, table, jnp.full((tokens.shape[0], 1), chunk, jnp.int32),
        cfg=cfg, mesh=mesh, rules=rules, hidden_at=jnp.broadcast_to(jnp.arange(chunk), tokens.shape))
    state = dataclasses.replace(state, slots=count_routing(state.slots, routing, rows.counts))
    with jax.named_scope("mtp_prefill"):
        _, x, mtp_cache = _paged_mtp(params, mtp_cache, hidden, rows.tokens[:, 1:], rows.starts, rows.counts, table,
                                     cfg, mesh, rules)
    with jax.named_scope("slot_progress"):
        target = jnp.where(rows.counts > 0, rows.slots, state.lengths.shape[0])  # out of range: dropped
        state = dataclasses.replace(state, mtp_hidden=state.mtp_hidden.at[target].set(_at(x, last), mode="drop"))
    out = jnp.zeros((1, rows.slots.shape[0], VERIFIED_WIDTH), jnp.int32).at[..., 0].set(-1)
    return (keep_replicated(out, mesh), cache, mtp_cache, jax.tree.map(lambda a: keep_replicated(a, mesh), state))


@functools.partial(jax.jit, static_argnames=(*_MODEL, "draft_tokens", "steps"),
                   donate_argnames=("cache", "mtp_cache", "state"))
def serve_draft_step(params: Params, cache: PagedKVCache, mtp_cache: PagedKVCache, state: DraftSlotState,
                     packed_rows: jax.Array, page_table: jax.Array, masks: jax.Array | None = None, *, cfg: Config,
                     mesh: Mesh, rules: ShardingRules, draft_tokens: int, steps: int = 1
                     ) -> tuple[jax.Array, PagedKVCache, PagedKVCache, DraftSlotState]:
    """The decode call with drafts: `steps` draft-verify-accept iterations (`_draft_verify`) for every
    decode row (one-token `StepRows`; row b runs its first `rows.steps[b]`), each keeping 1..k+1
    tokens. Where a row is and how many tokens it sampled are read from `state`, not from the rows.

    Returns `[steps * (k+1), B, VERIFIED_WIDTH]`: iteration i's verified position j at `i * (k+1) + j`
    (token -1 where nothing was emitted), both pools and the state."""
    rows = StepRows.unpack(packed_rows)
    width = draft_tokens + 1

    def step(i, carry):
        cache, mtp_cache, state, outs = carry
        active = (rows.counts > 0) & (i < rows.steps)
        out, cache, mtp_cache, state = _draft_verify(params, cache, mtp_cache, state, rows, active, page_table, masks,
                                                     cfg, mesh, rules, draft_tokens)
        return cache, mtp_cache, state, jax.lax.dynamic_update_slice_in_dim(outs, out, i * width, axis=0)

    outs = jnp.zeros((steps * width, rows.slots.shape[0], VERIFIED_WIDTH), jnp.int32)
    carry = (cache, mtp_cache, state, outs)
    cache, mtp_cache, state, outs = step(0, carry) if steps == 1 else jax.lax.fori_loop(0, steps, step, carry)
    return keep_replicated(outs, mesh), cache, mtp_cache, state


def _verify(params: Params, cache: PagedKVCache, fed: jax.Array, starts: jax.Array, width: jax.Array,
            table: jax.Array, cfg: Config, mesh: Mesh,
            rules: ShardingRules) -> tuple[jax.Array, jax.Array, PagedKVCache, jax.Array | None]:
    """Verify `fed [B, k+1]` at `starts + j` in one `extend` over the row's pages, causal among the k+1
    (one pass over the weights); row b runs its first `width[b]` positions. Its logits equal the
    one-token decode calls' up to float rounding; with `rules.batch_invariant`, `_verify_by_steps`.
    Returns what `_verify_by_steps` returns."""
    if rules.batch_invariant:
        return _verify_by_steps(params, cache, fed, starts, width, table, cfg, mesh, rules)
    every = jnp.broadcast_to(jnp.arange(fed.shape[1]), fed.shape)
    return model.extend_routed(params, cache, fed, starts, width, table, every, cfg=cfg, mesh=mesh, rules=rules,
                               absorbed=True)


def _verify_by_steps(params: Params, cache: PagedKVCache, fed: jax.Array, starts: jax.Array, width: jax.Array,
                     table: jax.Array, cfg: Config, mesh: Mesh,
                     rules: ShardingRules) -> tuple[jax.Array, jax.Array, PagedKVCache, jax.Array | None]:
    """Verify `fed [B, k+1]` at `starts + j`, each position j by the one-token `extend` that a decode call
    without drafts runs (the same shapes, kernels and reduction orders: its logits are bit for bit
    theirs, so drafts never change greedy output; docs/serving.md, "Draft numerics"), after position
    j - 1 was written to the row's pages. Row b runs its first `width[b]` positions. Returns logits
    `[B, k+1, V]`, the hidden states entering the final norm `[B, k+1, D]`, the pool and the routing
    `[L_moe, B, k+1, K]` (`model.extend_routed`; None without MoE layers)."""
    at = jnp.zeros((fed.shape[0], 1), jnp.int32)

    def step(cache: PagedKVCache, position: tuple[jax.Array, jax.Array]):
        j, token = position
        logits, hidden, cache, routing = model.extend_routed(
            params, cache, token[:, None], starts + j, (j < width).astype(jnp.int32), table, at, cfg=cfg, mesh=mesh,
            rules=rules)
        return cache, (logits[:, 0], hidden[:, 0], None if routing is None else routing[:, :, 0])

    cache, (logits, hidden, routing) = jax.lax.scan(step, cache, (jnp.arange(fed.shape[1]), fed.T))
    routing = None if routing is None else jnp.moveaxis(routing, 0, 2)  # [k+1, L, B, K] -> [L, B, k+1, K]
    return jnp.swapaxes(logits, 0, 1), jnp.swapaxes(hidden, 0, 1), cache, routing


def _progressed(state: DraftSlotState, slots: jax.Array, verdict: Any, starts: jax.Array, mtp_hidden: jax.Array,
                counted: SlotState) -> DraftSlotState:
    """The slot state after an iteration whose `verdict` kept tokens for the rows of `slots` (rows that
    kept none leave their slots as they were): each row's last token, counts, recent tokens, length,
    generated count and the MTP module's output for its next first draft; `counted`: the slot state
    with the iteration's routing counted."""
    kept = verdict.emitted > 0
    target = jnp.where(kept, slots, state.lengths.shape[0])  # out of range: dropped
    progressed = dataclasses.replace(counted, last=counted.last.at[target].set(verdict.last_token(), mode="drop"),
                                     counts=counted.counts.at[target].set(verdict.counts, mode="drop"),
                                     recent=counted.recent.at[target].set(verdict.recent, mode="drop"))
    return DraftSlotState(progressed, state.lengths.at[target].set(starts + verdict.emitted, mode="drop"),
                          state.generated.at[target].set(verdict.generated, mode="drop"),
                          state.mtp_hidden.at[target].set(mtp_hidden, mode="drop"))


def _draft_verify(params: Params, cache: PagedKVCache, mtp_cache: PagedKVCache, state: DraftSlotState,
                  rows: StepRows, active: jax.Array, page_table: jax.Array, masks: jax.Array | None, cfg: Config,
                  mesh: Mesh, rules: ShardingRules, k: int
                  ) -> tuple[jax.Array, PagedKVCache, PagedKVCache, DraftSlotState]:
    """One iteration (`dsr1.programs.speculative`'s steps 2-4 and its catch-up, on pages) for the `active`
    rows, each at its slot's `L = lengths` with last token `t_L`: 1. draft `d_1` from the module's
    logits at `L - 1` (`mtp_hidden`), then `d_2..d_k` by applying it at `L..L+k-2` (provisional MTP
    latents, overwritten by 4); 2. verify `[t_L, d_1..d_k]` at `L..L+k` (`_verify`), only the
    first `min(k+1, budget left)` positions, so nothing is written past the request's pages; 3. accept
    (`speculative.accept_drafts`): e tokens kept, the length becomes `L + e` (latents past it are never
    read); 4. catch the MTP pool up on `L..L+e-1`, its output at `L+e-1` kept for the next first draft.

    A row with a grammar mask (`rows.mask_row`) verifies `t_L` alone and samples under its mask, taking
    no draft: its next mask needs the token, which only the host's matcher can check.
    """
    with jax.named_scope("step_inputs"):
        safe, sampling, last = slot_rows(state.slots, rows.slots)
        seen, counts, recent = state.slots.prompt_seen[safe], state.slots.counts[safe], state.slots.recent[safe]
        token_rules = jax.tree.map(lambda a: a[safe], state.slots.token_rules)
        starts, generated = state.lengths[safe], state.generated[safe]
        active = active & (generated < sampling.max_new_tokens)
        constrained = jnp.zeros_like(active) if masks is None else rows.mask_row >= 0
        left = sampling.max_new_tokens - generated
        width = jnp.where(active, jnp.minimum(jnp.where(constrained, 1, k + 1), left), 0)
        table = page_table[jnp.minimum(rows.slots, page_table.shape[0] - 1)]
    with jax.named_scope("draft"):
        module, _ = mtp_module(params, speculative.MTP_MODULE)
        h = state.mtp_hidden[safe]
        applied = 0

        def recurse(h: jax.Array, previous: jax.Array) -> tuple[jax.Array, jax.Array]:
            nonlocal mtp_cache, applied
            written = (applied < width).astype(jnp.int32)  # within the verified positions: pages exist
            q, x, mtp_cache = _paged_mtp(params, mtp_cache, h[:, None], previous[:, None], starts + applied, written,
                                         table, cfg, mesh, rules)
            applied += 1
            return q[:, 0], x[:, 0]

        drafts, qs = speculative.draft_tokens_recursively(mtp_logits(module, h, cfg), h, recurse, k, sampling, seen,
                                                          counts, generated, token_rules, recent)
    fed = jnp.stack([last, *drafts], axis=1)
    with jax.named_scope("verify"):
        logits, hidden, cache, routing = _verify(params, cache, fed, starts, width, table, cfg, mesh, rules)
    with jax.named_scope("accept"):
        checked = logits if masks is None else logits.at[:, 0].set(apply_masks(logits[:, 0], masks, rows.mask_row))
        verdict = speculative.accept_drafts(checked, drafts, qs, sampling, seen, counts, generated, active,
                                            token_rules, recent, plain=constrained)
    with jax.named_scope("mtp_catch_up"):
        _, x, mtp_cache = _paged_mtp(params, mtp_cache, hidden, jnp.maximum(verdict.tokens, 0), starts,
                                     verdict.emitted, table, cfg, mesh, rules)
    with jax.named_scope("slot_progress"):
        state = _progressed(state, rows.slots, verdict, starts, _at(x, jnp.maximum(verdict.emitted - 1, 0)),
                            count_routing(state.slots, routing, width))
    with jax.named_scope("logprobs"):
        out = jnp.stack([_verified_pack(verdict.tokens[:, j], logits[:, j], rows.logprobs, verdict.accepted[:, j],
                                          vocab_split(mesh, rules, cfg.vocab_size))
                         for j in range(k + 1)])
    return out, cache, mtp_cache, jax.tree.map(lambda a: keep_replicated(a, mesh), state)
