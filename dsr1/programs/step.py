"""The serving engine's device state and its programs (the engine: `dsr1.serving.engine`).

`serve_step` is extend plus per-slot sampling in one program, reading and writing the per-slot
`SlotState` (sampling settings, last token, penalty counts) so a decoding row's next input never
travels through the host; `admit_slot` resets one slot for a new request; `copy_pages` and
`restore_pages` move whole pages out of and back into the pool (the prefix cache's host offload).
`StepRows` and `Sampled` are a call's rows and results, packed into one int32 array each way.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ..core import model
from ..core.cache import PagedKVCache, gather_rank_pages, keep_pool_layout, scatter_rank_pages
from ..core.config import Config
from ..core.params import Params
from ..core.sharding import ShardingRules, keep_replicated
from .sampling import (
    BAD_WORD_TOKENS,
    KEY_IMPL,
    TOP_LOGPROBS,
    SamplingArrays,
    TokenRuleRows,
    TokenRules,
    VocabSplit,
    apply_masks,
    init_counts,
    no_recent,
    push_recent,
    sample,
    token_logprobs,
    token_rules,
    update_counts,
    vocab_split,
)

_MODEL = ("cfg", "mesh", "rules")  # the static arguments every program shares

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    """What the serving engine keeps on device between steps: for each of its S batch slots, and the
    routing statistics of redundant experts."""

    sampling: SamplingArrays  # [S] the slot's request's settings and random key (stops are checked on the host)
    last: jax.Array  # [S] int32 the slot's last sampled token: a decoding row's next input
    prompt_seen: jax.Array  # [S, V] bool the request's prompt tokens (repetition penalty)
    counts: jax.Array  # [S, V] int32 the request's output token counts (penalties)
    token_rules: TokenRules  # [S, ...] the request's logit bias, allowed tokens, bad words, min_tokens
    recent: jax.Array  # [S, H] int32 the request's last sampled tokens (bad words)
    # [L_moe, E] int32: the (token, expert) pairs each MoE layer routed to each logical expert since
    # the state was made, when the engine collects them (redundant experts' statistics); else None.
    expert_load: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepRows:
    """The rows of one `serve_step` call, built on the host: B rows of T new tokens, each row one slot's
    request (a prefill chunk, or one decode token). A row's slot is S (out of range) when it is idle."""

    slots: jax.Array  # [B] int32
    tokens: jax.Array  # [B, T] int32 new tokens (a decode row's are ignored: see feed_last)
    starts: jax.Array  # [B] int32 tokens the request has cached (the first new token's position)
    counts: jax.Array  # [B] int32 real new tokens (0: idle row)
    feed_last: jax.Array  # [B] bool the row's first new token is its slot's last sampled token (decode)
    sample: jax.Array  # [B] bool sample a token after the row's last new token (false mid-prompt)
    sample_index: jax.Array  # [B] int32 tokens the request sampled before: the position in its random stream
    logprobs: jax.Array  # [B] bool the request wants its sampled token's log-probability and the top ones
    steps: jax.Array  # [B] int32 decode steps the row runs in a multi-step call (`serve_step(steps=k)`), <= k
    prompt_logprobs: jax.Array  # [B] bool the request wants its prompt tokens' log-probabilities (prefill)
    mask_row: jax.Array  # [B] int32 the row of the call's grammar masks its sampled token obeys (-1: none)

    _COLUMNS = ("slots", "starts", "counts", "feed_last", "sample", "sample_index", "logprobs", "steps",
                "prompt_logprobs", "mask_row")  # then tokens
    _FLAGS = ("feed_last", "sample", "logprobs", "prompt_logprobs")

    def pack(self) -> np.ndarray:
        """(Host) the rows as one int32 array `[B, 10 + T]`: each `device_put` leaf has a fixed cost of a
        fraction of a millisecond, which a serving step would otherwise pay nine times per call."""
        columns = [np.asarray(getattr(self, name), np.int32)[:, None] for name in self._COLUMNS]
        return np.concatenate([*columns, np.asarray(self.tokens, np.int32)], axis=1)

    @classmethod
    def unpack(cls, packed: jax.Array) -> StepRows:
        """(In a program) the rows of `pack`."""
        fields = {name: packed[:, i] for i, name in enumerate(cls._COLUMNS)}
        fields |= {name: fields[name] != 0 for name in cls._FLAGS}
        return cls(tokens=packed[:, len(cls._COLUMNS):], **fields)


@dataclasses.dataclass(frozen=True)
class Sampled:
    """What one step of a `serve_step` call sampled, on the host: each row's token and, for rows that asked
    (`StepRows.logprobs`), the token's log-probability and the `TOP_LOGPROBS` most likely tokens with
    theirs, from the log-softmax of the model's raw logits (before penalties and temperature, as
    OpenAI and vLLM report them). Rows that did not ask read 0."""

    tokens: np.ndarray  # [B] int32
    logprobs: np.ndarray  # [B] float32
    top_ids: np.ndarray  # [B, TOP_LOGPROBS] int32, most likely first
    top_logprobs: np.ndarray  # [B, TOP_LOGPROBS] float32

    @staticmethod
    def pack(tokens: jax.Array, logprobs: jax.Array, top_ids: jax.Array, top_logprobs: jax.Array) -> jax.Array:
        """(In a program) one int32 array `[B, 2 + 2 * TOP_LOGPROBS]` (floats by their bit patterns), so
        a call's results reach the host in one transfer."""
        as_int = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
        return jnp.concatenate([tokens[:, None], as_int(logprobs)[:, None], top_ids, as_int(top_logprobs)], axis=1)

    @classmethod
    def unpack(cls, packed: np.ndarray) -> Sampled:
        """(Host) the arrays of `pack`."""
        packed = np.asarray(packed, np.int32)
        top = (packed.shape[1] - 2) // 2
        return cls(packed[:, 0], packed[:, 1].view(np.float32), packed[:, 2:2 + top],
                   packed[:, 2 + top:].view(np.float32))


@functools.partial(jax.jit, static_argnames=("mesh", "vocab_size", "expert_load"))
def slot_state(sampling: SamplingArrays, *, mesh: Mesh, vocab_size: int,
               expert_load: tuple[int, int] | None = None) -> SlotState:
    """Fresh state for `sampling.batch_size` slots: the given settings, no tokens seen or counted, no rules;
    `expert_load=(L_moe, E)`: routing statistics collected from zero."""
    slots = sampling.batch_size
    no_rules = token_rules(_no_rule_rows(slots), vocab_size)
    load = None if expert_load is None else jnp.zeros(expert_load, jnp.int32)
    state = SlotState(sampling, jnp.zeros(slots, jnp.int32), jnp.zeros((slots, vocab_size), bool),
                      jnp.zeros((slots, vocab_size), jnp.int32), no_rules, no_recent(slots), load)
    return jax.tree.map(lambda a: keep_replicated(a, mesh), state)


BAD_WORDS = 16  # multi-token bad words a request may have (one-token ones are unlimited: a bias)


def _no_rule_rows(rows: int) -> TokenRuleRows:
    """Rule rows without any rule, with `BAD_WORDS` word columns (the slot state's fixed width)."""
    none = jnp.full((rows, 1), -1, jnp.int32)
    return TokenRuleRows(none, jnp.zeros((rows, 1), jnp.float32), none, none, jnp.zeros(rows, jnp.int32),
                         jnp.full((rows, BAD_WORDS, BAD_WORD_TOKENS - 1), -1, jnp.int32),
                         jnp.full((rows, BAD_WORDS), -1, jnp.int32))


def slot_rule_rows(rows: TokenRuleRows) -> TokenRuleRows:
    """(Host) `rows` with their bad words padded to the slot state's `BAD_WORDS` columns; ValueError
    for more."""
    words = rows.bad_last.shape[1]
    if words > BAD_WORDS and np.any(rows.bad_last[:, BAD_WORDS:] >= 0):
        raise ValueError(f"at most {BAD_WORDS} bad words of several tokens per request")
    pad = BAD_WORDS - min(words, BAD_WORDS)
    return dataclasses.replace(
        rows, bad_prefix=np.pad(rows.bad_prefix[:, :BAD_WORDS], ((0, 0), (0, pad), (0, 0)), constant_values=-1),
        bad_last=np.pad(rows.bad_last[:, :BAD_WORDS], ((0, 0), (0, pad)), constant_values=-1))


def pack_admission(slot: int, sampling: SamplingArrays, prompt: np.ndarray, width: int) -> np.ndarray:
    """(Host) one admission as one int32 array (one transfer instead of a dozen): the slot, the prompt's
    length, each field of the one-row `sampling` (numpy, keys as their uint32 key data; float and
    uint32 fields by their bit patterns), then the prompt padded to `width` tokens."""
    words = [np.array([slot, len(prompt)], np.int32)]
    words += [np.ascontiguousarray(np.asarray(leaf)[0]).reshape(-1).view(np.int32)
              for leaf in jax.tree.leaves(sampling)]
    padded = np.zeros(width, np.int32)
    padded[:len(prompt)] = prompt
    return np.concatenate([*words, padded])


def _unpack_admission(packed: jax.Array, like: SamplingArrays) -> tuple[jax.Array, SamplingArrays, jax.Array,
                                                                      jax.Array]:
    """(In a program) `pack_admission`'s slot, sampling row (fields shaped and typed as `like`'s
    rows), prompt `[1, width]` and length `[1]`."""
    fields, at = {}, 2
    for field in dataclasses.fields(SamplingArrays):
        template = getattr(like, field.name)
        if field.name == "keys":
            data = jax.random.key_data(template)
            words = jax.lax.bitcast_convert_type(packed[at:at + data.shape[1]], data.dtype)
            fields["keys"], at = jax.random.wrap_key_data(words[None], impl=KEY_IMPL), at + data.shape[1]
            continue
        size = int(np.prod(template.shape[1:]))
        words = packed[at:at + size]
        if template.dtype != jnp.int32:
            words = jax.lax.bitcast_convert_type(words, template.dtype)
        fields[field.name], at = words.reshape((1, *template.shape[1:])), at + size
    return packed[0], SamplingArrays(**fields), packed[None, at:], packed[1:2]


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def admit_slot(state: SlotState, packed: jax.Array, rule_rows: TokenRuleRows, *, mesh: Mesh) -> SlotState:
    """`state` with a slot given to a new request (`packed`: `pack_admission`): its settings (one row),
    the tokens of its prompt marked as seen, no output counted yet, its token rules (`rule_rows`, one
    row of `host_token_rules`, bad words padded by `slot_rule_rows`), and its prompt's last token as the
    slot's last token (the request's first decode input: `dsr1.serving.scheduler`)."""
    slot, sampling, prompt, length = _unpack_admission(packed, state.sampling)
    with jax.named_scope("admit_slot"):
        seen, counts = init_counts(prompt, length, state.prompt_seen.shape[1])
        # mode="drop": warm-up admits to slot S (out of range) and changes nothing.
        rows = jax.tree.map(lambda a, row: a.at[slot].set(row[0], mode="drop"),
                            (state.sampling, state.prompt_seen, state.counts), (sampling, seen, counts))
        last = prompt[0, jnp.maximum(length[0] - 1, 0)]
        dense = token_rules(rule_rows, state.prompt_seen.shape[1])
        rules = jax.tree.map(lambda a, row: a.at[slot].set(row[0], mode="drop"), state.token_rules, dense)
        state = dataclasses.replace(state, sampling=rows[0], last=state.last.at[slot].set(last, mode="drop"),
                                    prompt_seen=rows[1], counts=rows[2], token_rules=rules,
                                    recent=state.recent.at[slot].set(-1, mode="drop"))
    return jax.tree.map(lambda a: keep_replicated(a, mesh), state)


def slot_rows(state: SlotState, slots: jax.Array) -> tuple[jax.Array, SamplingArrays, jax.Array]:
    """The rows' slots (idle rows, whose slot is out of range, read the last slot: their outputs are
    discarded), their sampling settings and last tokens. Their `[V]` rows of prompt tokens seen and
    output counts are gathered by `sample`, only when some row has penalties."""
    safe = jnp.minimum(slots, state.last.shape[0] - 1)
    sampling = jax.tree.map(lambda a: a[safe], state.sampling)
    return safe, sampling, state.last[safe]


@functools.partial(jax.jit, static_argnames=(*_MODEL, "steps", "prompt_logprobs"), donate_argnames=("cache", "state"))
def serve_step(params: Params, cache: PagedKVCache, state: SlotState, packed_rows: jax.Array, page_table: jax.Array,
               masks: jax.Array | None = None, *, cfg: Config, mesh: Mesh, rules: ShardingRules, steps: int = 1,
               prompt_logprobs: bool = False) -> tuple[jax.Array, PagedKVCache, SlotState]:
    """One engine call on `StepRows` (`packed_rows`: `StepRows.pack()`, one transfer):
    `extend` the rows against their slots' pages (`page_table [S, P]`), then sample
    each sampling row's next token from its last new token, with its slot's settings and penalties
    and the key `fold_in(key, sample_index)`: a request's tokens depend on its seed and logits only,
    never on the rows beside it or the step it arrived at.

    `steps > 1` (decode rows only): that many decode steps in one call, each feeding every row's
    token of the step before; row b runs its first `rows.steps[b]` of them (its budget may end
    sooner) and is idle in the rest. One dispatch, transfer and read-back for `steps` tokens per row.

    Returns what was sampled, `[steps, B, W]` (`Sampled.pack` per step: the tokens, meaningless where
    `rows.sample` is false or the row is idle, and the log-probabilities of the rows that asked for
    them), the cache with the new latents written, and the state with each sampling row's slot's last
    token and output counts updated.

    `masks [M, words]` (`dsr1.serving.grammar`): grammar bitmasks; row b's sampled token obeys
    `masks[rows.mask_row[b]]` (in the first step only: a constrained row runs one). `prompt_logprobs`
    (prompt chunks): every row carries one token more, the prompt's token after the chunk, and the
    result has T more entries after the sampled one, `[1 + T, B, W]`: entry 1 + t is the log-probability
    of row b's token after position t (the next prompt token) with the top alternatives, for the rows
    that asked (`rows.prompt_logprobs`)."""
    rows = StepRows.unpack(packed_rows)
    if steps == 1:
        out, cache, state = _serve_rows(params, cache, state, rows, page_table, masks, cfg, mesh, rules,
                                        prompt_logprobs)
        return keep_replicated(out if prompt_logprobs else out[None], mesh), cache, state

    def step(i, carry):
        cache, state, outs = carry
        active = i < rows.steps
        moved = dataclasses.replace(rows, starts=rows.starts + i, counts=jnp.where(active, rows.counts, 0),
                                    sample=rows.sample & active, sample_index=rows.sample_index + i,
                                    mask_row=jnp.where(i == 0, rows.mask_row, -1))
        out, cache, state = _serve_rows(params, cache, state, moved, page_table, masks, cfg, mesh, rules)
        return cache, state, outs.at[i].set(out)

    width = 2 + 2 * TOP_LOGPROBS
    outs = jnp.zeros((steps, rows.slots.shape[0], width), jnp.int32)
    cache, state, outs = jax.lax.fori_loop(0, steps, step, (cache, state, outs))
    return keep_replicated(outs, mesh), cache, state


def _serve_rows(params: Params, cache: PagedKVCache, state: SlotState, rows: StepRows, page_table: jax.Array,
                masks: jax.Array | None, cfg: Config, mesh: Mesh, rules: ShardingRules,
                prompt_logprobs: bool = False) -> tuple[jax.Array, PagedKVCache, SlotState]:
    """`serve_step`'s one step on unpacked rows: extend, sample, update the slots."""
    chunk = rows.tokens.shape[1] - prompt_logprobs  # a prompt-logprobs call's rows carry the next token
    with jax.named_scope("step_inputs"):
        safe, sampling, last = slot_rows(state, rows.slots)
        tokens = rows.tokens[:, :chunk]
        tokens = tokens.at[:, 0].set(jnp.where(rows.feed_last, last, tokens[:, 0]))
        table = page_table[jnp.minimum(rows.slots, page_table.shape[0] - 1)]
        sample_at = jnp.maximum(rows.counts - 1, 0)
        # Logits only where a token is sampled (past the chunk elsewhere: none computed there).
        logits_at = (jnp.broadcast_to(jnp.arange(chunk), tokens.shape) if prompt_logprobs
                     else jnp.where(rows.sample, sample_at, chunk)[:, None])
    logits, _, cache, routing = model.extend_routed(params, cache, tokens, rows.starts, rows.counts, table,
                                                    logits_at, cfg=cfg, mesh=mesh, rules=rules)
    state = count_routing(state, routing, rows.counts)
    sampling_logits = jnp.take_along_axis(logits, sample_at[:, None, None], axis=1)[:, 0] if prompt_logprobs \
        else logits[:, 0]
    # The barrier hands the sampling conditional a row-major [B, V] operand: without it XLA:CPU passes
    # the [B, 1, V] logits in another (equivalent) layout and copies them inside the branch, a tenth
    # of a decode step on the tiny preset.
    split = vocab_split(mesh, rules, cfg.vocab_size)
    out, state, _ = sample_rows(jax.lax.optimization_barrier(sampling_logits), state, rows, safe, sampling, masks,
                                split)
    if prompt_logprobs:
        with jax.named_scope("prompt_logprobs"):
            out = jnp.concatenate([out[None], _prompt_logprobs(logits, rows, chunk, split)], axis=0)
    return out, cache, jax.tree.map(lambda a: keep_replicated(a, mesh), state)


def count_routing(state: SlotState, routing: jax.Array | None, counts: jax.Array) -> SlotState:
    """`state` with the pairs of `routing [L_moe, B, T, K]` (`model.extend_routed`) added to its
    `expert_load`, each row's first `counts [B]` tokens only (the rest is padding); unchanged when
    the state collects none."""
    if state.expert_load is None or routing is None:
        return state
    with jax.named_scope("expert_load"):
        real = jnp.arange(routing.shape[2]) < counts[:, None]
        pairs = jnp.broadcast_to(real[None, :, :, None], routing.shape).astype(jnp.int32)
        experts = state.expert_load.shape[1]
        load = jax.vmap(lambda e, w: jnp.zeros(experts, jnp.int32).at[e.ravel()].add(w.ravel()))(routing, pairs)
    return dataclasses.replace(state, expert_load=state.expert_load + load)


def _prompt_logprobs(logits: jax.Array, rows: StepRows, chunk: int, split: VocabSplit | None) -> jax.Array:
    """`[T, B, W]`: `Sampled.pack` of each row's token after each position (`rows.tokens[:, 1:]`) under
    the logits there, for the real positions of the rows that want prompt log-probabilities."""
    batch = logits.shape[0]
    following = rows.tokens[:, 1:chunk + 1]
    wanted = rows.prompt_logprobs[:, None] & (jnp.arange(chunk) < rows.counts[:, None])
    flat = logits.reshape(batch * chunk, -1)
    packed = Sampled.pack(following.reshape(-1), *token_logprobs(flat, following.reshape(-1), wanted.reshape(-1),
                                                                    split))
    return packed.reshape(batch, chunk, -1).transpose(1, 0, 2)


def sample_rows(logits: jax.Array, state: SlotState, rows: StepRows, safe: jax.Array,
                sampling: SamplingArrays, masks: jax.Array | None = None,
                split: VocabSplit | None = None) -> tuple[jax.Array, SlotState, jax.Array]:
    """Sample each sampling row's next token from `logits [B, V]` (obeying its grammar mask, if any) and
    record it in its slot (last token, output counts, recent tokens): the packed `Sampled` row `[B, W]`,
    the new state and the tokens `[B]`. `split`: the logits are split over the vocabulary."""
    with jax.named_scope("sample"):
        masked = logits if masks is None else apply_masks(logits, masks, rows.mask_row)
        token = sample(masked, sampling, state.prompt_seen, state.counts, rows.sample_index, rows=safe,
                       rules=state.token_rules, recent=state.recent[safe], split=split)
        sampled = rows.sample & (rows.counts > 0)
        target = jnp.where(sampled, rows.slots, state.last.shape[0])  # out of range: dropped
        new_last = state.last.at[target].set(token, mode="drop")
        slot_sampled = jnp.zeros(state.last.shape, bool).at[target].set(True, mode="drop")
        recent = state.recent.at[target].set(push_recent(state.recent[safe], token), mode="drop")
        state = dataclasses.replace(state, last=new_last, counts=update_counts(state.counts, new_last, slot_sampled),
                                    recent=recent)
    with jax.named_scope("logprobs"):
        out = Sampled.pack(token, *token_logprobs(logits, token, rows.logprobs & sampled, split))
    return out, state, token


@functools.partial(jax.jit, static_argnames=("mesh", "rules"))
def copy_pages(cache: PagedKVCache, pages: jax.Array, *, mesh: Mesh, rules: ShardingRules) -> PagedKVCache:
    """The contents of `pages [K]` (every layer; ids in the whole pool, whichever rank holds them) as a
    K-page pool whole on every device, for copying to host memory."""
    return jax.tree.map(lambda a: keep_replicated(a, mesh), gather_rank_pages(cache, pages, mesh, rules))


@functools.partial(jax.jit, static_argnames=("mesh", "rules"), donate_argnames=("cache",))
def restore_pages(cache: PagedKVCache, pages: jax.Array, contents: PagedKVCache, *, mesh: Mesh,
                  rules: ShardingRules) -> PagedKVCache:
    """The pool with `pages [K]` overwritten by `contents` (a K-page pool, e.g. from `copy_pages`)."""
    return keep_pool_layout(scatter_rank_pages(cache, pages, contents, mesh, rules), mesh, rules)

