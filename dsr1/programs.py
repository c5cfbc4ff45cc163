"""Every jitted program that runs the model, defined once: the `Model` methods, `generate`, the
benchmarks and the profiles all call these, so each compiles once per shape and static setting.

Static arguments are the hashable description of the program (`cfg`, `mesh`, `rules`, sizes and
dtypes); arrays are the weights, tokens and caches. A cache passed to a decoding program is
donated: its buffers are reused for the grown cache, so the caller must not use it again.

- `forward`, `prefill`, `decode`: the model's three passes (`dsr1.core.model`).
- `generate_start`, `generate_chunk`: prefill and sample the first token; then up to `steps`
  decode-and-sample steps in one `lax.while_loop` that leaves early when every row is done.
- `greedy_decode`: `steps` greedy steps in one `fori_loop`, recording the tokens fed and the
  experts routed (what benchmarks and profiles account for).
- `random_cache`: a cache as if prompts had been prefilled, for timing decode at any context.
- `extend`, `paged_cache`: serving. `extend` runs T new tokens per row against each row's pages
  of a `PagedKVCache` (donated) and writes their latents; it compiles once per (B, T, P, K) bucket
  and static setting, whatever the rows' starts, counts and page tables. `paged_cache` creates an
  empty page pool on the mesh.
- `serve_step`, `slot_state`, `admit_slot`, `copy_pages`, `restore_pages`: the serving engine's
  programs (`dsr1.serving.engine`). `serve_step` is extend plus per-slot sampling in one program,
  reading and writing the per-slot `SlotState` (sampling settings, last token, penalty counts) so
  a decoding row's next input never travels through the host; `admit_slot` resets one slot for a
  new request; `copy_pages` and `restore_pages` move whole pages out of and back into the pool
  (the prefix cache's host offload).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from .core import model
from .core.attention import PagedContext, attend_extend, use_absorbed
from .core.cache import (
    KVCache,
    PagedKVCache,
    empty_paged_cache,
    gather_pages,
    quantize_latent,
    scatter_pages,
    to_stored,
    token_slots,
    write_tokens,
)
from .core.config import Config
from .core.mtp import mtp_logits, mtp_module, mtp_step
from .core.params import Params
from .core.sharding import ShardingRules, keep_replicated
from .generation import speculative
from .generation.output import TokenLogprob
from .generation.sampling import (
    KEY_IMPL,
    TOP_LOGPROBS,
    SamplingArrays,
    argmax,
    init_counts,
    is_stop_token,
    sample,
    token_logprobs,
    update_counts,
)

_MODEL = ("cfg", "mesh", "rules")  # the static arguments every program shares

forward = jax.jit(model.forward, static_argnames=_MODEL)
prefill = jax.jit(model.prefill, static_argnames=(*_MODEL, "max_len", "kv_cache_dtype"))
decode = jax.jit(model.decode, static_argnames=_MODEL, donate_argnames=("cache",))
extend = jax.jit(model.extend, static_argnames=(*_MODEL, "absorbed", "block_pages"), donate_argnames=("cache",))
# MTP speculative decoding (`dsr1.generation.speculative`): prefill + first token, then chunks of
# draft-verify-accept iterations in one `lax.while_loop`.
speculative_start = jax.jit(speculative.speculative_start,
                            static_argnames=(*_MODEL, "max_len", "kv_cache_dtype", "draft_tokens"))
speculative_chunk = jax.jit(speculative.speculative_chunk, static_argnames=(*_MODEL, "steps", "draft_tokens"),
                            donate_argnames=("state",))


# ---- generation: sampling on device --------------------------------------------------------------

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


def _advance(state: DecodeState, logits: jax.Array, sampling: SamplingArrays,
             cache: KVCache) -> tuple[DecodeState, jax.Array]:
    """Sample each active row's next token from `logits` and update the row's progress; the
    recorded token is -1 for rows that were already done."""
    active = ~state.done
    token = sample(logits, sampling, state.prompt_seen, state.counts, state.generated)
    generated = state.generated + active
    done = state.done | (active & (is_stop_token(token, sampling) | (generated >= sampling.max_new_tokens)))
    new = DecodeState(cache, jnp.where(active, token, state.last), done, generated, state.prompt_seen,
                      update_counts(state.counts, token, active))
    return new, jnp.where(active, token, -1)


@functools.partial(jax.jit, static_argnames=(*_MODEL, "max_len", "kv_cache_dtype"))
def generate_start(params: Params, tokens: jax.Array, lengths: jax.Array, sampling: SamplingArrays, *, cfg: Config,
                   mesh: Mesh, rules: ShardingRules, max_len: int,
                   kv_cache_dtype: str | None) -> tuple[DecodeState, jax.Array]:
    """Prefill and sample the first token of every row: the loop state and the tokens `[B]`."""
    logits, cache = model.prefill(params, tokens, lengths, cfg=cfg, mesh=mesh, rules=rules, max_len=max_len,
                                  kv_cache_dtype=kv_cache_dtype)
    prompt_seen, counts = init_counts(tokens, lengths, cfg.vocab_size)
    b = tokens.shape[0]
    state = DecodeState(cache, jnp.zeros(b, jnp.int32), jnp.zeros(b, bool), jnp.zeros(b, jnp.int32), prompt_seen,
                        counts)
    return _advance(state, logits, sampling, cache)


@functools.partial(jax.jit, static_argnames=(*_MODEL, "steps"), donate_argnames=("state",))
def generate_chunk(params: Params, state: DecodeState, sampling: SamplingArrays, *, cfg: Config, mesh: Mesh,
                   rules: ShardingRules, steps: int) -> tuple[DecodeState, jax.Array]:
    """Up to `steps` decode steps on device; stops early when every row is done. Returns the new state
    and the tokens recorded `[B, steps]` (-1 where a row was done or the loop ended)."""
    out = jnp.full((state.last.shape[0], steps), -1, jnp.int32)

    def step(carry):
        i, state, out = carry
        logits, cache, _ = model.decode(params, state.cache, state.last, cfg=cfg, mesh=mesh, rules=rules)
        state, token = _advance(state, logits, sampling, cache)
        return i + 1, state, out.at[:, i].set(token)

    def running(carry):
        i, state, _ = carry
        return (i < steps) & ~jnp.all(state.done)

    _, state, out = jax.lax.while_loop(running, step, (0, state, out))
    return state, out


# ---- benchmarks and profiles ---------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=(*_MODEL, "steps"), donate_argnames=("cache",))
def greedy_decode(params: Params, cache: KVCache, tokens: jax.Array, *, cfg: Config, mesh: Mesh,
                  rules: ShardingRules, steps: int) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
    """`steps` greedy decode steps in one program. Returns the grown cache, the tokens fed at each
    step `[steps, B]` (the first is `tokens`, then each step's argmax), the routed expert ids of
    each step `[steps, L_moe, B, K]`, and the last step's argmax `[B]`."""
    batch, k = tokens.shape[0], cfg.num_experts_per_tok
    fed = jnp.zeros((steps, batch), jnp.int32)
    ids = jnp.zeros((steps, cfg.num_moe_layers, batch, k), jnp.int32)

    def body(i, carry):
        cache, tokens, fed, ids = carry
        logits, cache, routed = model.decode(params, cache, tokens, cfg=cfg, mesh=mesh, rules=rules)
        fed = fed.at[i].set(tokens)
        if routed is not None:
            ids = ids.at[i].set(routed)
        return cache, argmax(logits), fed, ids

    cache, last, fed, ids = jax.lax.fori_loop(0, steps, body, (cache, tokens, fed, ids))
    return cache, fed, ids, last


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "batch", "context", "max_len", "dtype", "kv_cache_dtype"))
def random_cache(key: jax.Array, *, cfg: Config, mesh: Mesh, batch: int, context: int, max_len: int, dtype: Any,
                 kv_cache_dtype: str | None) -> KVCache:
    """A cache as if `batch` prompts of `context` tokens had been prefilled: random latents in the
    cache's dtype, room for `max_len` positions, replicated over the mesh."""
    layers = cfg.num_hidden_layers
    k_lat, k_pe = jax.random.split(key)
    c_kv = jax.random.normal(k_lat, (layers, batch, max_len, cfg.kv_lora_rank), jnp.float32)
    pe = jax.random.normal(k_pe, (layers, batch, max_len, cfg.qk_rope_head_dim), jnp.float32).astype(dtype)
    c_kv, c_scale = quantize_latent(c_kv) if kv_cache_dtype == "int8" else (c_kv.astype(dtype), None)
    platform = mesh.devices.flat[0].platform
    cache = KVCache(to_stored(c_kv, platform), to_stored(pe, platform), c_scale, jnp.full((batch,), context, jnp.int32))
    return jax.tree.map(lambda a: keep_replicated(a, mesh), cache)


# ---- serving -------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "num_pages", "page_size", "dtype", "kv_cache_dtype"))
def paged_cache(*, cfg: Config, mesh: Mesh, num_pages: int, page_size: int, dtype: Any,
                kv_cache_dtype: str | None) -> PagedKVCache:
    """An empty pool of `num_pages` pages of `page_size` tokens (page 0 is the scratch page) for every
    layer, in the model's `dtype` (or int8 latents with per-token scales), replicated over the mesh
    like the contiguous cache."""
    cache = empty_paged_cache(cfg.num_hidden_layers, num_pages, page_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                              jnp.dtype(dtype), kv_cache_dtype, mesh.devices.flat[0].platform)
    return jax.tree.map(lambda a: keep_replicated(a, mesh), cache)


# ---- serving: the engine's programs --------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    """What the serving engine keeps on device for each of its S batch slots between steps."""

    sampling: SamplingArrays  # [S] the slot's request's settings and random key (stops are checked on the host)
    last: jax.Array  # [S] int32 the slot's last sampled token: a decoding row's next input
    prompt_seen: jax.Array  # [S, V] bool the request's prompt tokens (repetition penalty)
    counts: jax.Array  # [S, V] int32 the request's output token counts (penalties)


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

    _COLUMNS = ("slots", "starts", "counts", "feed_last", "sample", "sample_index", "logprobs", "steps")  # then tokens
    _FLAGS = ("feed_last", "sample", "logprobs")

    def pack(self) -> np.ndarray:
        """(Host) the rows as one int32 array `[B, 8 + T]`: each `device_put` leaf has a fixed cost of a
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

    def logprob(self, row: int, top: int | None) -> TokenLogprob | None:
        """Row `row`'s token with its log-probability and `top` alternatives (None when `top` is None)."""
        if top is None:
            return None
        alternatives = zip(self.top_ids[row, :top].tolist(), self.top_logprobs[row, :top].tolist())
        return TokenLogprob(int(self.tokens[row]), float(self.logprobs[row]),
                            tuple((token, logprob) for token, logprob in alternatives if token >= 0))

    @classmethod
    def unpack(cls, packed: np.ndarray) -> Sampled:
        """(Host) the arrays of `pack`."""
        packed = np.asarray(packed, np.int32)
        top = (packed.shape[1] - 2) // 2
        return cls(packed[:, 0], packed[:, 1].view(np.float32), packed[:, 2:2 + top],
                   packed[:, 2 + top:].view(np.float32))


@functools.partial(jax.jit, static_argnames=("mesh", "vocab_size"))
def slot_state(sampling: SamplingArrays, *, mesh: Mesh, vocab_size: int) -> SlotState:
    """Fresh state for `sampling.batch_size` slots: the given settings, no tokens seen or counted."""
    slots = sampling.batch_size
    state = SlotState(sampling, jnp.zeros(slots, jnp.int32), jnp.zeros((slots, vocab_size), bool),
                      jnp.zeros((slots, vocab_size), jnp.int32))
    return jax.tree.map(lambda a: keep_replicated(a, mesh), state)


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
def admit_slot(state: SlotState, packed: jax.Array, *, mesh: Mesh) -> SlotState:
    """`state` with a slot given to a new request (`packed`: `pack_admission`): its settings (one row),
    the tokens of its prompt marked as seen, no output counted yet, and its prompt's last token as the
    slot's last token (the request's first decode input: `dsr1.serving.scheduler`)."""
    slot, sampling, prompt, length = _unpack_admission(packed, state.sampling)
    with jax.named_scope("admit_slot"):
        seen, counts = init_counts(prompt, length, state.prompt_seen.shape[1])
        # mode="drop": warm-up admits to slot S (out of range) and changes nothing.
        rows = jax.tree.map(lambda a, row: a.at[slot].set(row[0], mode="drop"),
                            (state.sampling, state.prompt_seen, state.counts), (sampling, seen, counts))
        last = prompt[0, jnp.maximum(length[0] - 1, 0)]
        state = SlotState(rows[0], state.last.at[slot].set(last, mode="drop"), rows[1], rows[2])
    return jax.tree.map(lambda a: keep_replicated(a, mesh), state)


def _slot_rows(state: SlotState, slots: jax.Array) -> tuple[jax.Array, SamplingArrays, jax.Array]:
    """The rows' slots (idle rows, whose slot is out of range, read the last slot: their outputs are
    discarded), their sampling settings and last tokens. Their `[V]` rows of prompt tokens seen and
    output counts are gathered by `sample`, only when some row has penalties."""
    safe = jnp.minimum(slots, state.last.shape[0] - 1)
    sampling = jax.tree.map(lambda a: a[safe], state.sampling)
    return safe, sampling, state.last[safe]


@functools.partial(jax.jit, static_argnames=(*_MODEL, "steps"), donate_argnames=("cache", "state"))
def serve_step(params: Params, cache: PagedKVCache, state: SlotState, packed_rows: jax.Array, page_table: jax.Array,
               *, cfg: Config, mesh: Mesh, rules: ShardingRules, steps: int = 1
               ) -> tuple[jax.Array, PagedKVCache, SlotState]:
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
    token and output counts updated."""
    rows = StepRows.unpack(packed_rows)
    if steps == 1:
        out, cache, state = _serve_rows(params, cache, state, rows, page_table, cfg, mesh, rules)
        return keep_replicated(out[None], mesh), cache, state

    def step(i, carry):
        cache, state, outs = carry
        active = i < rows.steps
        moved = dataclasses.replace(rows, starts=rows.starts + i, counts=jnp.where(active, rows.counts, 0),
                                    sample=rows.sample & active, sample_index=rows.sample_index + i)
        out, cache, state = _serve_rows(params, cache, state, moved, page_table, cfg, mesh, rules)
        return cache, state, outs.at[i].set(out)

    width = 2 + 2 * TOP_LOGPROBS
    outs = jnp.zeros((steps, rows.slots.shape[0], width), jnp.int32)
    cache, state, outs = jax.lax.fori_loop(0, steps, step, (cache, state, outs))
    return keep_replicated(outs, mesh), cache, state


def _serve_rows(params: Params, cache: PagedKVCache, state: SlotState, rows: StepRows, page_table: jax.Array,
                cfg: Config, mesh: Mesh, rules: ShardingRules) -> tuple[jax.Array, PagedKVCache, SlotState]:
    """`serve_step`'s one step on unpacked rows: extend, sample, update the slots."""
    with jax.named_scope("step_inputs"):
        safe, sampling, last = _slot_rows(state, rows.slots)
        tokens = rows.tokens.at[:, 0].set(jnp.where(rows.feed_last, last, rows.tokens[:, 0]))
        table = page_table[jnp.minimum(rows.slots, page_table.shape[0] - 1)]
        # Logits only where a token is sampled (past the chunk elsewhere: none computed there).
        logits_at = jnp.where(rows.sample, jnp.maximum(rows.counts - 1, 0), rows.tokens.shape[1])[:, None]
    logits, _, cache = model.extend(params, cache, tokens, rows.starts, rows.counts, table, logits_at, cfg=cfg,
                                    mesh=mesh, rules=rules)
    # The barrier hands the sampling conditional a row-major [B, V] operand: without it XLA:CPU passes
    # the [B, 1, V] logits in another (equivalent) layout and copies them inside the branch, 0.25 ms
    # at 8 rows and 0.6 ms at 16 on the tiny preset, a tenth of a decode step.
    out, state, _ = _sample_rows(jax.lax.optimization_barrier(logits[:, 0]), state, rows, safe, sampling)
    return out, cache, jax.tree.map(lambda a: keep_replicated(a, mesh), state)


def _sample_rows(logits: jax.Array, state: SlotState, rows: StepRows, safe: jax.Array,
                 sampling: SamplingArrays) -> tuple[jax.Array, SlotState, jax.Array]:
    """Sample each sampling row's next token from `logits [B, V]` and record it in its slot (last token,
    output counts): the packed `Sampled` row `[B, W]`, the new state and the tokens `[B]`."""
    with jax.named_scope("sample"):
        token = sample(logits, sampling, state.prompt_seen, state.counts, rows.sample_index, rows=safe)
        sampled = rows.sample & (rows.counts > 0)
        target = jnp.where(sampled, rows.slots, state.last.shape[0])  # out of range: dropped
        new_last = state.last.at[target].set(token, mode="drop")
        slot_sampled = jnp.zeros(state.last.shape, bool).at[target].set(True, mode="drop")
        state = SlotState(state.sampling, new_last, state.prompt_seen,
                          update_counts(state.counts, new_last, slot_sampled))
    with jax.named_scope("logprobs"):
        out = Sampled.pack(token, *token_logprobs(logits, token, rows.logprobs & sampled))
    return out, state, token


@functools.partial(jax.jit, static_argnames=("mesh",))
def copy_pages(cache: PagedKVCache, pages: jax.Array, *, mesh: Mesh) -> PagedKVCache:
    """The contents of `pages [K]` (every layer) as a K-page pool, for copying to host memory."""
    return jax.tree.map(lambda a: keep_replicated(a, mesh), gather_pages(cache, pages))


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("cache",))
def restore_pages(cache: PagedKVCache, pages: jax.Array, contents: PagedKVCache, *, mesh: Mesh) -> PagedKVCache:
    """The pool with `pages [K]` overwritten by `contents` (a K-page pool, e.g. from `copy_pages`)."""
    return jax.tree.map(lambda a: keep_replicated(a, mesh), scatter_pages(cache, pages, contents))


# ---- serving with MTP drafts (`dsr1.serving.Engine(..., draft_tokens=k)`) ------------------------
#
# The MTP module keeps its own one-layer page pool, under the same page ids and tables as the
# model's: page p of a sequence holds both pools' latents for the same positions, so whatever
# shares, offloads or reloads a page moves both. Both pools always hold the same positions of a
# slot, `< lengths[slot]`: MTP position i reads the model's hidden `h_i` and the token `t_{i+1}`,
# so every call runs the module on the positions its model call just ran, with the token after
# each (the next prompt token, or the token sampled or kept after the last one) — nothing is ever
# pending between calls. The module's output at the last position (`mtp_hidden`) gives the next
# call its first draft.

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


@functools.partial(jax.jit, static_argnames=("mesh", "vocab_size", "hidden_size"))
def draft_slot_state(sampling: SamplingArrays, *, mesh: Mesh, vocab_size: int, hidden_size: int) -> DraftSlotState:
    """Fresh `DraftSlotState` for `sampling.batch_size` slots."""
    slots = sampling.batch_size
    state = DraftSlotState(slot_state(sampling, mesh=mesh, vocab_size=vocab_size), jnp.zeros(slots, jnp.int32),
                           jnp.zeros(slots, jnp.int32), jnp.zeros((slots, hidden_size), jnp.float32))
    return jax.tree.map(lambda a: keep_replicated(a, mesh), state)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def admit_draft_slot(state: DraftSlotState, packed: jax.Array, *, mesh: Mesh) -> DraftSlotState:
    """`admit_slot` for a `DraftSlotState` (its length, count and MTP output start from zero)."""
    slot = packed[0]
    with jax.named_scope("admit_draft_slot"):
        reset = jax.tree.map(lambda a: a.at[slot].set(0, mode="drop"),
                             (state.lengths, state.generated, state.mtp_hidden))
        state = DraftSlotState(admit_slot(state.slots, packed, mesh=mesh), *reset)
    return jax.tree.map(lambda a: keep_replicated(a, mesh), state)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "num_pages", "page_size", "dtype", "kv_cache_dtype"))
def mtp_paged_cache(*, cfg: Config, mesh: Mesh, num_pages: int, page_size: int, dtype: Any,
                    kv_cache_dtype: str | None) -> PagedKVCache:
    """`paged_cache` for the MTP module: one layer, the same pages."""
    cache = empty_paged_cache(1, num_pages, page_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim, jnp.dtype(dtype),
                              kv_cache_dtype, mesh.devices.flat[0].platform)
    return jax.tree.map(lambda a: keep_replicated(a, mesh), cache)


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
                             one_device=mesh.size == 1)

    logits, x, (c_kv, k_pe) = mtp_step(params, hidden, next_tokens, attend, cfg=cfg, mesh=mesh, rules=rules,
                                       index=speculative.MTP_MODULE)
    with jax.named_scope("write_mtp_pages"):
        pages, slots = token_slots(table, cached, counts, chunk, pool.page_size)
        pool = write_tokens(pool, c_kv[None], k_pe[None], pages, slots)
    return logits, x, jax.tree.map(lambda a: keep_replicated(a, mesh), pool)


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
    """Row b's entry `index[b]` of `x [B, T, ...]`: `[B, ...]`."""
    return jnp.take_along_axis(x, index.reshape(-1, *([1] * (x.ndim - 1))), axis=1)[:, 0]


def _verified_pack(tokens: jax.Array, logits: jax.Array, wanted: jax.Array, accepted: jax.Array) -> jax.Array:
    """`Sampled.pack` of `tokens [B]` (-1: none) with their log-probabilities where `wanted`, then `accepted`."""
    packed = Sampled.pack(tokens, *token_logprobs(logits, jnp.maximum(tokens, 0), wanted & (tokens >= 0)))
    return jnp.concatenate([packed, accepted.astype(jnp.int32)[:, None]], axis=1)


@functools.partial(jax.jit, static_argnames=_MODEL, donate_argnames=("cache", "mtp_cache", "state"))
def serve_draft_prefill(params: Params, cache: PagedKVCache, mtp_cache: PagedKVCache, state: DraftSlotState,
                        packed_rows: jax.Array, page_table: jax.Array, *, cfg: Config, mesh: Mesh,
                        rules: ShardingRules) -> tuple[jax.Array, PagedKVCache, PagedKVCache, DraftSlotState]:
    """`serve_step` for prompt chunks with drafts on: rows of `T + 1` tokens, `T` new ones and, in column
    `counts[b]`, the prompt's token after the chunk (the lookahead; a chunk that ends the prompt samples
    its first token instead). The model runs the chunk (`extend`), rows ending their prompt sample
    their first token as `serve_step` does, and the MTP module runs the chunk's positions with their
    next tokens, filling its pool as far as the model's. Returns `[1, B, VERIFIED_WIDTH]`, both pools
    and the state (sampling rows' slots: last token, counts, length = prompt, one token sampled)."""
    rows = StepRows.unpack(packed_rows)
    chunk = rows.tokens.shape[1] - 1
    with jax.named_scope("step_inputs"):
        safe, sampling, _ = _slot_rows(state.slots, rows.slots)
        table = page_table[jnp.minimum(rows.slots, page_table.shape[0] - 1)]
        tokens = rows.tokens[:, :chunk]
        last = jnp.maximum(rows.counts - 1, 0)
    # Hidden states at every position (the MTP module reads them all); logits at `last` of sampling rows only.
    logits_at = jnp.where(rows.sample, last, chunk)[:, None]
    logits, hidden, cache = model.extend(params, cache, tokens, rows.starts, rows.counts, table, logits_at,
                                         cfg=cfg, mesh=mesh, rules=rules,
                                         hidden_at=jnp.broadcast_to(jnp.arange(chunk), tokens.shape))
    logits = logits[:, 0]
    out, slots, token = _sample_rows(logits, state.slots, rows, safe, sampling)
    sampled = rows.sample & (rows.counts > 0)
    with jax.named_scope("mtp_prefill"):
        after = rows.tokens[:, 1:]
        after = jnp.where(sampled[:, None] & (jnp.arange(chunk) == last[:, None]), token[:, None], after)
        _, x, mtp_cache = _paged_mtp(params, mtp_cache, hidden, after, rows.starts, rows.counts, table, cfg, mesh,
                                     rules)
    with jax.named_scope("slot_progress"):
        target = jnp.where(sampled, rows.slots, state.lengths.shape[0])  # out of range: dropped
        state = DraftSlotState(slots, state.lengths.at[target].set(rows.starts + rows.counts, mode="drop"),
                               state.generated.at[target].set(1, mode="drop"),
                               state.mtp_hidden.at[target].set(_at(x, last), mode="drop"))
    out = jnp.concatenate([out, jnp.zeros((out.shape[0], 1), jnp.int32)], axis=1)
    return (keep_replicated(out[None], mesh), cache, mtp_cache, jax.tree.map(lambda a: keep_replicated(a, mesh), state))


@functools.partial(jax.jit, static_argnames=(*_MODEL, "draft_tokens", "steps"),
                   donate_argnames=("cache", "mtp_cache", "state"))
def serve_draft_step(params: Params, cache: PagedKVCache, mtp_cache: PagedKVCache, state: DraftSlotState,
                     packed_rows: jax.Array, page_table: jax.Array, *, cfg: Config, mesh: Mesh, rules: ShardingRules,
                     draft_tokens: int, steps: int = 1
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
        out, cache, mtp_cache, state = _draft_verify(params, cache, mtp_cache, state, rows, active, page_table, cfg,
                                                     mesh, rules, draft_tokens)
        return cache, mtp_cache, state, jax.lax.dynamic_update_slice_in_dim(outs, out, i * width, axis=0)

    outs = jnp.zeros((steps * width, rows.slots.shape[0], VERIFIED_WIDTH), jnp.int32)
    carry = (cache, mtp_cache, state, outs)
    cache, mtp_cache, state, outs = step(0, carry) if steps == 1 else jax.lax.fori_loop(0, steps, step, carry)
    return keep_replicated(outs, mesh), cache, mtp_cache, state


def _draft_verify(params: Params, cache: PagedKVCache, mtp_cache: PagedKVCache, state: DraftSlotState,
                  rows: StepRows, active: jax.Array, page_table: jax.Array, cfg: Config, mesh: Mesh,
                  rules: ShardingRules, k: int) -> tuple[jax.Array, PagedKVCache, PagedKVCache, DraftSlotState]:
    """One iteration (`dsr1.generation.speculative`'s steps 2-4 and its catch-up, on pages) for the `active`
    rows, each at its slot's `L = lengths` with last token `t_L`:

    1. draft `d_1` from the module's logits at `L - 1` (`mtp_hidden`), then `d_2..d_k` by applying it
       recursively at `L..L+k-2` (provisional latents, written to the row's MTP pages and overwritten
       by step 4);
    2. verify `[t_L, d_1..d_k]` at `L..L+k` with `extend` — only the first `min(k+1, budget left)`
       positions, so nothing is written past the pages the request reserved;
    3. accept (`speculative.accept_drafts`): e tokens kept, the row's length becomes `L + e` (the
       latents written past it are never read, and overwritten later);
    4. catch the MTP pool up: the module on `L..L+e-1` with the model's hidden states there and the
       kept tokens, its output at `L+e-1` kept for the next iteration's first draft.
    """
    num_slots = state.lengths.shape[0]
    with jax.named_scope("step_inputs"):
        safe, sampling, last = _slot_rows(state.slots, rows.slots)
        seen, counts = state.slots.prompt_seen[safe], state.slots.counts[safe]
        starts, generated = state.lengths[safe], state.generated[safe]
        active = active & (generated < sampling.max_new_tokens)
        width = jnp.where(active, jnp.minimum(k + 1, sampling.max_new_tokens - generated), 0)
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
                                                          counts, generated)
    fed = jnp.stack([last, *drafts], axis=1)
    logits, hidden, cache = model.extend(params, cache, fed, starts, width, table,
                                         jnp.broadcast_to(jnp.arange(k + 1), fed.shape), cfg=cfg, mesh=mesh,
                                         rules=rules)
    with jax.named_scope("accept"):
        verdict = speculative.accept_drafts(logits, drafts, qs, sampling, seen, counts, generated, active)
    with jax.named_scope("mtp_catch_up"):
        _, x, mtp_cache = _paged_mtp(params, mtp_cache, hidden, jnp.maximum(verdict.tokens, 0), starts,
                                     verdict.emitted, table, cfg, mesh, rules)
    with jax.named_scope("slot_progress"):
        kept = verdict.emitted > 0
        target = jnp.where(kept, rows.slots, num_slots)  # out of range: dropped
        slots = state.slots
        slots = SlotState(slots.sampling, slots.last.at[target].set(verdict.last_token(), mode="drop"),
                          slots.prompt_seen, slots.counts.at[target].set(verdict.counts, mode="drop"))
        state = DraftSlotState(slots, state.lengths.at[target].set(starts + verdict.emitted, mode="drop"),
                               state.generated.at[target].set(verdict.generated, mode="drop"),
                               state.mtp_hidden.at[target].set(_at(x, jnp.maximum(verdict.emitted - 1, 0)),
                                                               mode="drop"))
    with jax.named_scope("logprobs"):
        out = jnp.stack([_verified_pack(verdict.tokens[:, j], logits[:, j], rows.logprobs, verdict.accepted[:, j])
                         for j in range(k + 1)])
    return out, cache, mtp_cache, jax.tree.map(lambda a: keep_replicated(a, mesh), state)
