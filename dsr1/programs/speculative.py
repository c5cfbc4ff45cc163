"""MTP speculative decoding on device: the MTP module drafts k tokens, the model verifies them in one step.

One iteration (`speculative_step`), per row, with the main cache holding positions `< L` and the
row's last token `t_L` not yet fed:

1. *Catch up* the MTP module's own latent cache (`SpecState.mtp_cache`, one layer) with the
   positions the model verified last time: MTP position i reads the model's hidden `h_i` and the
   token `t_{i+1}`, so its last position `L - 1` gives the logits `q_0` of token `L + 1`.
2. *Draft* `d_1 ~ q_0`, then apply the module recursively: at position `L + j - 1` its own output
   replaces `h`, with the draft `d_j` as the next token, giving `q_j` and `d_{j+1}` (k > 1). These
   recursive latents are provisional: the MTP cache's length is set back, and step 1 overwrites them.
3. *Verify* `[t_L, d_1, ..., d_k]` at positions `L..L+k` against the main cache in one pass over the
   weights (`dsr1.core.model.verify`, causal among the k+1): `p_j` predicts the same token as `q_j`.
   Its logits equal those of decoding without drafts up to float rounding (k+1 times the rows per
   product). With `ShardingRules.batch_invariant` (`dsr1.generate(..., batch_invariant=True)`) each
   position runs in the one-token decode step's own shapes within that pass
   (`dsr1.core.model.verify_per_position`): its logits are bit for bit decoding's, so greedy output
   never depends on the drafts, in bf16 too (docs/serving.md, "Draft numerics").
4. *Accept*: greedy rows keep `d_{j+1}` while it equals `argmax p_j` and then emit that argmax;
   sampled rows run standard speculative rejection sampling (keep `d` with probability
   `min(1, p(d) / q(d))`, else draw from `norm(max(p - q, 0))`; after k acceptances draw from
   `p_k`), so the output distribution is exactly the model's. `p` and `q` are the same sampling
   transforms (penalties with the counts of the tokens before, temperature, top-k/top-p/min-p) of
   the model's and the module's logits. Every step emits 1..k+1 tokens; a stop token or the budget
   ends the row at once. The main cache's length becomes `L + emitted` (rejected drafts rolled back).

Randomness: token index `s` of a row (tokens generated before it) uses `fold_in(key, s)` and three
streams of it (draft, acceptance, correction), so no draw is reused by a decision that was seen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ..core import model
from ..core.cache import KVCache, append_tokens, cache_from_prefill, keep_cache_rows, latent_parts
from ..core.config import Config
from ..core.mtp import mtp_step
from ..core.params import Params
from ..core.sharding import ShardingRules, keep_replicated
from .sampling import (
    SamplingArrays,
    TokenRuleRows,
    TokenRules,
    apply_filters,
    apply_penalties,
    argmax,
    init_counts,
    is_stop_token,
    no_recent,
    push_recent,
    restrict,
    sample,
    token_rules,
    update_counts,
    vocab_split,
)

MTP_MODULE = 0  # the module that drafts (DeepSeek-V3 has one; k > 1 applies it recursively)
_DRAFT, _ACCEPT, _CORRECT = 0, 1, 2  # random streams of one token index


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """What the speculative loop carries (see the module doc for the positions)."""

    cache: KVCache  # the model's latents, positions < lengths
    mtp_cache: KVCache  # the MTP module's latents (one layer), positions < lengths - pending_count
    last: jax.Array  # [B] the token to feed next (t_L)
    pending_hidden: jax.Array  # [B, k+1, D] the model's hidden at the positions the MTP cache lacks
    pending_tokens: jax.Array  # [B, k+1] the token after each of those positions
    pending_count: jax.Array  # [B] how many of them are real
    done: jax.Array  # [B] bool
    generated: jax.Array  # [B] tokens produced so far
    prompt_seen: jax.Array  # [B, V] bool
    counts: jax.Array  # [B, V] int32 output token counts
    drafted: jax.Array  # [] int32 drafts made for active rows
    accepted: jax.Array  # [] int32 drafts accepted (and emitted)
    token_rules: TokenRules  # each row's logit bias, allowed tokens, bad words, min_tokens
    recent: jax.Array  # [B, H] int32 the row's last generated tokens (bad words)


def _laid_out(state: SpecState, mesh: Mesh, rules: ShardingRules) -> SpecState:
    """The loop state's caches laid out by their rows (`keep_cache_rows`), its bookkeeping whole."""
    bookkeeping = jax.tree.map(lambda a: keep_replicated(a, mesh), dataclasses.replace(state, cache=None,
                                                                                      mtp_cache=None))
    return dataclasses.replace(bookkeeping, cache=keep_cache_rows(state.cache, mesh, rules),
                               mtp_cache=keep_cache_rows(state.mtp_cache, mesh, rules))


def _key(sampling: SamplingArrays, index: jax.Array, stream: int) -> jax.Array:
    """Each row's key for token index `index [B]` and one of its random streams."""
    keys = jax.vmap(jax.random.fold_in)(sampling.keys, index.astype(jnp.uint32))
    return jax.vmap(lambda k: jax.random.fold_in(k, stream))(keys)


def _distribution(penalized: jax.Array, sampling: SamplingArrays) -> jax.Array:
    """The sampling distribution `[B, V]` of `sample` from penalized logits (only sampled rows need it)."""
    return jax.nn.softmax(apply_filters(penalized, sampling), axis=-1)


def _categorical(keys: jax.Array, probs: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.categorical)(keys, jnp.log(probs)).astype(jnp.int32)


def _if_sampling(sampling: SamplingArrays, draw, greedy_result, *operands):
    """`draw(*operands)` when some row samples, else `greedy_result` (the same shapes, `[B]` arrays
    only, so nothing vocabulary-sized is copied out of the branch): random bits for every vocabulary
    entry of every row cost more than the rest of an accept step on CPU."""
    return jax.lax.cond(jnp.any(sampling.temperature > 0), draw, lambda *_: greedy_result, *operands)


def draft_token(q_logits: jax.Array, sampling: SamplingArrays, seen: jax.Array, counts: jax.Array,
                index: jax.Array, rules: TokenRules | None = None,
                recent: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """A draft `[B]` from the MTP module's logits (argmax for greedy rows, else a draw from `q`) and the
    penalized logits `[B, V]` that `q` derives from (`_distribution`; derived again where a verification
    needs it, so that all-greedy steps never compute a distribution). `rules` and `recent`: the rows'
    token rules (`restrict`), with `index` tokens generated before."""
    penalized = apply_penalties(restrict(q_logits, rules, index, recent), sampling, seen, counts)
    greedy = argmax(penalized)
    drawn = _if_sampling(sampling, lambda x: _categorical(_key(sampling, index, _DRAFT), _distribution(x, sampling)),
                         greedy, penalized)
    return jnp.where(sampling.temperature > 0, drawn, greedy), penalized


def verify_token(p_logits: jax.Array, draft: jax.Array | None, q_penalized: jax.Array | None,
                 sampling: SamplingArrays, seen: jax.Array, counts: jax.Array,
                 index: jax.Array, rules: TokenRules | None = None,
                 recent: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The token emitted at one verified position and whether it is the draft (`[B]`, `[B]` bool).
    `q_penalized`: what `draft_token` returned with `draft`. `draft` None: the bonus position after
    k acceptances (a plain draw from `p`)."""
    penalized = apply_penalties(restrict(p_logits, rules, index, recent), sampling, seen, counts)
    greedy = argmax(penalized)
    if draft is None:
        drawn = _if_sampling(sampling, lambda x: _categorical(_key(sampling, index, _CORRECT),
                                                              _distribution(x, sampling)), greedy, penalized)
        return jnp.where(sampling.temperature > 0, drawn, greedy), jnp.zeros(penalized.shape[0], bool)

    def rejection_sample(p_penalized: jax.Array, q_penalized: jax.Array) -> tuple[jax.Array, jax.Array]:
        p, q = _distribution(p_penalized, sampling), _distribution(q_penalized, sampling)
        p_d = jnp.take_along_axis(p, draft[:, None], axis=-1)[:, 0]
        q_d = jnp.take_along_axis(q, draft[:, None], axis=-1)[:, 0]
        u = jax.vmap(jax.random.uniform)(_key(sampling, index, _ACCEPT))
        residual = jnp.maximum(p - q, 0.0)
        total = residual.sum(axis=-1, keepdims=True)
        residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p)
        return u * q_d < p_d, _categorical(_key(sampling, index, _CORRECT), residual)

    keep_sampled, corrected = _if_sampling(sampling, rejection_sample, (draft == greedy, greedy), penalized,
                                           q_penalized)
    sampled = sampling.temperature > 0
    accepted = jnp.where(sampled, keep_sampled, draft == greedy)
    token = jnp.where(accepted, draft, jnp.where(sampled, corrected, greedy))
    return token, accepted


def draft_tokens_recursively(q_logits: jax.Array, h: jax.Array,
                             recurse: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]], k: int,
                             sampling: SamplingArrays, seen: jax.Array, counts: jax.Array,
                             generated: jax.Array, rules: TokenRules | None = None,
                             recent: jax.Array | None = None) -> tuple[list[jax.Array], list[jax.Array]]:
    """Step 2 of the module doc: `k` drafts `[B]` and the penalized logits `[B, V]` of the distributions
    `q` they came from (`draft_token`), from the module's logits `q_logits [B, V]` and output `h [B, D]`
    at the row's last caught-up position.
    `recurse(h, draft)` applies the module once more at the next position (its own output `h` and the
    draft as the next token) and returns its logits and output there."""
    drafts, qs = [], []
    for j in range(k):
        if j:
            q_logits, h = recurse(h, drafts[-1])
        d, q = draft_token(q_logits, sampling, seen, counts, generated + j, rules, recent)
        counts = update_counts(counts, d)
        recent = None if recent is None else push_recent(recent, d)
        drafts.append(d)
        qs.append(q)
    return drafts, qs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verdict:
    """What one verification kept, per row (`accept_drafts`)."""

    tokens: jax.Array  # [B, k+1] int32 the tokens emitted, -1 after a row's last one (and for inactive rows)
    accepted: jax.Array  # [B, k+1] bool the token emitted at that position is an accepted draft
    emitted: jax.Array  # [B] int32 tokens emitted (1..k+1 for active rows, 0 otherwise)
    generated: jax.Array  # [B] int32 tokens produced so far, these included
    counts: jax.Array  # [B, V] int32 output token counts, these included
    stopped: jax.Array  # [B] bool a stop token or the budget ended the row
    recent: jax.Array | None  # [B, H] int32 the row's last generated tokens, these included (None: no rules)

    def last_token(self) -> jax.Array:
        """Each row's last emitted token `[B]` (-1 where none was)."""
        return jnp.take_along_axis(self.tokens, jnp.maximum(self.emitted - 1, 0)[:, None], axis=1)[:, 0]


def accept_drafts(logits: jax.Array, drafts: list[jax.Array], qs: list[jax.Array], sampling: SamplingArrays,
                  seen: jax.Array, counts: jax.Array, generated: jax.Array, active: jax.Array,
                  rules: TokenRules | None = None, recent: jax.Array | None = None,
                  plain: jax.Array | None = None) -> Verdict:
    """Step 4 of the module doc for `active [B]` rows: walk the verified positions (`logits [B, k+1, V]`
    of `[t_L, d_1..d_k]`), keeping each draft `drafts[j]` (drawn from the `q` whose penalized logits
    are `qs[j]`, as `draft_tokens_recursively` returns them) while it is accepted and emitting the
    correction or bonus token where the walk ends; a stop token or the budget
    (`sampling.max_new_tokens`, counting `generated`) ends a row at once. Rows with `plain [B]` set take
    no draft: their first position is a plain sample from `p` (as without drafts), and they stop there."""
    k = len(drafts)
    done, alive = jnp.zeros_like(active), active
    out, ok_out, emitted = [], [], jnp.zeros_like(generated)
    for j in range(k + 1):
        draft, q = (drafts[j], qs[j]) if j < k else (None, None)
        token, ok = verify_token(logits[:, j], draft, q, sampling, seen, counts, generated, rules, recent)
        if j == 0 and plain is not None:
            alone, _ = verify_token(logits[:, 0], None, None, sampling, seen, counts, generated, rules, recent)
            token, ok = jnp.where(plain, alone, token), ok & ~plain
        recent = None if recent is None else push_recent(recent, token, alive)
        out.append(jnp.where(alive, token, -1))
        ok_out.append(alive & ok)
        counts = update_counts(counts, token, alive)
        generated = generated + alive
        emitted = emitted + alive
        stop = alive & (is_stop_token(token, sampling) | (generated >= sampling.max_new_tokens))
        done = done | stop
        alive = alive & ok & ~stop
    return Verdict(jnp.stack(out, axis=1), jnp.stack(ok_out, axis=1), emitted, generated, counts, done, recent)


def _mtp_attend(cache: KVCache, positions: jax.Array, cfg: Config):
    def attend(p: dict, h: jax.Array, query_at: jax.Array | None = None):
        return model.attention_module(cfg).attend_cached(p, h, positions, cache, MTP_MODULE, cfg, query_at)
    return attend


def run_mtp(params: Params, cache: KVCache, hidden: jax.Array, next_tokens: jax.Array, last: jax.Array, *,
            cfg: Config, mesh: Mesh, rules: ShardingRules) -> tuple[jax.Array, jax.Array, KVCache]:
    """The MTP module on T positions per row at `cache.lengths + t` (`hidden [B, T, D]`, `next_tokens
    [B, T]`) against its own cache: its logits `[B, V]` and output `[B, D]` at each row's position
    `last [B]` (0 <= last < T), and the cache with the T positions appended (the caller sets
    `lengths` to what is real). A draft needs the module's output at `last` only: the block (its
    attention's queries, MoE, head) runs there; the other positions only add their latents."""
    positions = cache.lengths[:, None] + jnp.arange(hidden.shape[1])
    logits, x, latents = mtp_step(params, hidden, next_tokens, _mtp_attend(cache, positions, cfg), cfg=cfg,
                                  mesh=mesh, rules=rules, index=MTP_MODULE, query_at=last)
    cache = append_tokens(cache, *(None if a is None else a[None] for a in latent_parts(latents)))
    return logits[:, 0], x[:, 0], keep_cache_rows(cache, mesh, rules)


def speculative_start(params: Params, tokens: jax.Array, lengths: jax.Array, sampling: SamplingArrays,
                      rule_rows: TokenRuleRows, *,
                      cfg: Config, mesh: Mesh, rules: ShardingRules, max_len: int, kv_cache_dtype: str | None,
                      draft_tokens: int) -> tuple[SpecState, jax.Array]:
    """Prefill the model and the MTP module, and sample every row's first token (as `generate_start`).
    The MTP cache gets positions `< n - 1` (position `n - 1` needs the first token: pending)."""
    logits, cache, hidden = model.prefill_hidden(params, tokens, lengths, cfg=cfg, mesh=mesh, rules=rules,
                                                 max_len=max_len, kv_cache_dtype=kv_cache_dtype)
    b, width = tokens.shape
    seen, counts = init_counts(tokens, lengths, cfg.vocab_size)
    rules_b = token_rules(rule_rows, cfg.vocab_size)
    first = sample(logits, sampling, seen, counts, 0, rules=rules_b, recent=no_recent(b),  # as without drafts
                   split=vocab_split(mesh, rules, cfg.vocab_size))
    # The MTP prefill over the prompt: position i reads h_i and token i + 1 (padding past n - 2).
    next_tokens = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
    positions = jnp.broadcast_to(jnp.arange(width), tokens.shape)
    attend_prefill = model.attention_module(cfg).attend_prefill
    _, _, latents = mtp_step(params, hidden, next_tokens, lambda p, h: attend_prefill(p, h, positions, cfg),
                                  cfg=cfg, mesh=mesh, rules=rules, index=MTP_MODULE)
    c_kv, k_pe, index_k = (None if a is None else a[None] for a in latent_parts(latents))
    mtp_cache = cache_from_prefill(c_kv, k_pe, lengths - 1, max_len, kv_cache_dtype, index_k=index_k)
    last_hidden = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)  # [B, 1, D]
    k1 = draft_tokens + 1
    pending_hidden = jnp.pad(last_hidden, [(0, 0), (0, k1 - 1), (0, 0)])
    pending_tokens = jnp.pad(first[:, None], [(0, 0), (0, k1 - 1)])
    generated = jnp.ones(b, jnp.int32)
    done = is_stop_token(first, sampling) | (generated >= sampling.max_new_tokens)
    state = SpecState(cache, mtp_cache, first, pending_hidden, pending_tokens, jnp.ones(b, jnp.int32), done,
                      generated, seen, update_counts(counts, first), jnp.zeros((), jnp.int32),
                      jnp.zeros((), jnp.int32), rules_b, push_recent(no_recent(b), first))
    return _laid_out(state, mesh, rules), first


def speculative_step(params: Params, state: SpecState, sampling: SamplingArrays, *, cfg: Config, mesh: Mesh,
                     rules: ShardingRules, draft_tokens: int) -> tuple[SpecState, jax.Array]:
    """One draft-verify-accept iteration (module doc). Returns the new state and the tokens emitted
    `[B, k+1]` (-1 after a row's last emitted token, and for rows that were done)."""
    k = draft_tokens
    active = ~state.done
    with jax.named_scope("mtp_catch_up"):
        q_logits, h, mtp_cache = run_mtp(params, state.mtp_cache, state.pending_hidden, state.pending_tokens,
                                         jnp.maximum(state.pending_count - 1, 0), cfg=cfg, mesh=mesh, rules=rules)
        caught_up = state.mtp_cache.lengths + state.pending_count
        mtp_cache = dataclasses.replace(mtp_cache, lengths=caught_up)
    with jax.named_scope("draft"):
        def recurse(h: jax.Array, previous: jax.Array) -> tuple[jax.Array, jax.Array]:
            nonlocal mtp_cache
            q_step, h_step, mtp_cache = run_mtp(params, mtp_cache, h[:, None], previous[:, None],
                                                jnp.zeros_like(previous), cfg=cfg, mesh=mesh, rules=rules)
            return q_step, h_step

        drafts, qs = draft_tokens_recursively(q_logits, h, recurse, k, sampling, state.prompt_seen, state.counts,
                                              state.generated, state.token_rules, state.recent)
        mtp_cache = dataclasses.replace(mtp_cache, lengths=caught_up)  # the recursive latents are provisional
    fed = jnp.stack([state.last, *drafts], axis=1)
    with jax.named_scope("verify"):
        verify = model.verify_per_position if rules.batch_invariant else model.verify
        logits, hidden, cache = verify(params, state.cache, fed, cfg=cfg, mesh=mesh, rules=rules)
    with jax.named_scope("accept"):
        verdict = accept_drafts(logits, drafts, qs, sampling, state.prompt_seen, state.counts, state.generated,
                                active, state.token_rules, state.recent)
        new_last = verdict.last_token()
        cache = dataclasses.replace(cache, lengths=state.cache.lengths + verdict.emitted)
        out, emitted, generated, counts = verdict.tokens, verdict.emitted, verdict.generated, verdict.counts
        done, accepted = state.done | verdict.stopped, jnp.sum(verdict.accepted)
    new = SpecState(cache, mtp_cache, jnp.where(emitted > 0, new_last, state.last), hidden, jnp.maximum(out, 0),
                    emitted, done, generated, state.prompt_seen, counts,
                    state.drafted + k * jnp.sum(active), state.accepted + accepted, state.token_rules,
                    verdict.recent)
    return _laid_out(new, mesh, rules), out


def speculative_chunk(params: Params, state: SpecState, sampling: SamplingArrays, *, cfg: Config, mesh: Mesh,
                      rules: ShardingRules, steps: int, draft_tokens: int) -> tuple[SpecState, jax.Array]:
    """Up to `steps` iterations on device, leaving early when every row is done: the new state and the
    tokens `[B, steps * (k+1)]` (-1 where nothing was emitted)."""
    width = draft_tokens + 1
    out = jnp.full((state.last.shape[0], steps * width), -1, jnp.int32)

    def step(carry):
        i, state, out = carry
        state, tokens = speculative_step(params, state, sampling, cfg=cfg, mesh=mesh, rules=rules,
                                         draft_tokens=draft_tokens)
        return i + 1, state, jax.lax.dynamic_update_slice_in_dim(out, tokens, i * width, axis=1)

    def running(carry):
        i, state, _ = carry
        return (i < steps) & ~jnp.all(state.done)

    _, state, out = jax.lax.while_loop(running, step, (0, state, out))
    return state, out
