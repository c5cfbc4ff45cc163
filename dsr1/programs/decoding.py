"""The generation loop's programs: prefill and sample the first token (`generate_start`), then
chunks of decode-and-sample steps in one `lax.while_loop` (`generate_chunk`); and the same with MTP
drafts (`speculative_start`, `speculative_chunk`, `dsr1.programs.speculative`). `dsr1.generate`
calls these; `dsr1.programs` lists them with the package's other programs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ..core import model
from ..core.cache import KVCache
from ..core.config import Config
from ..core.params import Params
from ..core.sharding import ShardingRules
from . import speculative
from .sampling import (
    SamplingArrays,
    TokenRuleRows,
    TokenRules,
    VocabSplit,
    init_counts,
    is_stop_token,
    no_recent,
    push_recent,
    sample,
    token_rules,
    update_counts,
    vocab_split,
)

_MODEL = ("cfg", "mesh", "rules")  # the static arguments every program shares

# MTP speculative decoding (`dsr1.programs.speculative`): prefill + first token, then chunks of
# draft-verify-accept iterations in one `lax.while_loop`.
speculative_start = jax.jit(speculative.speculative_start,
                            static_argnames=(*_MODEL, "max_len", "kv_cache_dtype", "draft_tokens"))
speculative_chunk = jax.jit(speculative.speculative_chunk, static_argnames=(*_MODEL, "steps", "draft_tokens"),
                            donate_argnames=("state",))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """What the generation loop carries: the cache, each row's last token and progress, penalty counts."""

    cache: KVCache
    last: jax.Array  # [B] the token to feed next
    done: jax.Array  # [B] bool
    generated: jax.Array  # [B] tokens produced so far (the sampling step index)
    prompt_seen: jax.Array  # [B, V] bool
    counts: jax.Array  # [B, V] int32 output token counts
    token_rules: TokenRules  # each row's logit bias, allowed tokens, bad words, min_tokens
    recent: jax.Array  # [B, H] int32 the row's last generated tokens (bad words)


def _advance(state: DecodeState, logits: jax.Array, sampling: SamplingArrays, cache: KVCache,
             split: VocabSplit | None) -> tuple[DecodeState, jax.Array]:
    """Sample each active row's next token from `logits` (split over the vocabulary as `split` says)
    and update the row's progress; the recorded token is -1 for rows that were already done."""
    active = ~state.done
    token = sample(logits, sampling, state.prompt_seen, state.counts, state.generated, rules=state.token_rules,
                   recent=state.recent, split=split)
    generated = state.generated + active
    done = state.done | (active & (is_stop_token(token, sampling) | (generated >= sampling.max_new_tokens)))
    new = DecodeState(cache, jnp.where(active, token, state.last), done, generated, state.prompt_seen,
                      update_counts(state.counts, token, active), state.token_rules,
                      push_recent(state.recent, token, active))
    return new, jnp.where(active, token, -1)


@functools.partial(jax.jit, static_argnames=(*_MODEL, "max_len", "kv_cache_dtype"))
def generate_start(params: Params, tokens: jax.Array, lengths: jax.Array, sampling: SamplingArrays,
                   rule_rows: TokenRuleRows, *, cfg: Config, mesh: Mesh, rules: ShardingRules, max_len: int,
                   kv_cache_dtype: str | None) -> tuple[DecodeState, jax.Array]:
    """Prefill and sample the first token of every row: the loop state and the tokens `[B]`.
    `rule_rows`: each row's token rules (`host_token_rules`), expanded here once."""
    logits, cache = model.prefill(params, tokens, lengths, cfg=cfg, mesh=mesh, rules=rules, max_len=max_len,
                                  kv_cache_dtype=kv_cache_dtype)
    prompt_seen, counts = init_counts(tokens, lengths, cfg.vocab_size)
    b = tokens.shape[0]
    state = DecodeState(cache, jnp.zeros(b, jnp.int32), jnp.zeros(b, bool), jnp.zeros(b, jnp.int32), prompt_seen,
                        counts, token_rules(rule_rows, cfg.vocab_size), no_recent(b))
    return _advance(state, logits, sampling, cache, vocab_split(mesh, rules, cfg.vocab_size))


@functools.partial(jax.jit, static_argnames=(*_MODEL, "steps"), donate_argnames=("state",))
def generate_chunk(params: Params, state: DecodeState, sampling: SamplingArrays, *, cfg: Config, mesh: Mesh,
                   rules: ShardingRules, steps: int) -> tuple[DecodeState, jax.Array]:
    """Up to `steps` decode steps on device; stops early when every row is done. Returns the new state
    and the tokens recorded `[B, steps]` (-1 where a row was done or the loop ended)."""
    out = jnp.full((state.last.shape[0], steps), -1, jnp.int32)
    split = vocab_split(mesh, rules, cfg.vocab_size)

    def step(carry):
        i, state, out = carry
        logits, cache, _ = model.decode(params, state.cache, state.last, cfg=cfg, mesh=mesh, rules=rules)
        state, token = _advance(state, logits, sampling, cache, split)
        return i + 1, state, out.at[:, i].set(token)

    def running(carry):
        i, state, _ = carry
        return (i < steps) & ~jnp.all(state.done)

    _, state, out = jax.lax.while_loop(running, step, (0, state, out))
    return state, out

