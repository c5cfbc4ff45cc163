"""Token sampling on device, with per-row settings, for a jitted generation loop.

A generation loop (a `jax.lax.while_loop` around the model's decode step) carries a
`SamplingArrays` pytree with one entry per batch row, so rows of one batch may use different
settings and changing them never recompiles. Everything here runs in a program (`sample`,
`update_counts`, `is_stop_token`, `token_logprobs`); the host builds the arrays from each request's
`dsr1.Sampling` (`dsr1.generation.sampling`).

Per token, `sample` applies, in this order (the order of HF transformers and vLLM):

1. penalties: repetition (HF/CTRL, on tokens seen in the prompt or the output so far), then
   presence and frequency (OpenAI, on the output so far);
2. rows with temperature 0 take the argmax of the penalized logits (filters and key unused);
3. temperature, then top-k, top-p and min-p on the temperature-scaled distribution;
4. a categorical draw with the key `fold_in(keys[b], step)`, so a row's tokens depend only on
   its own seed, logits and settings, never on the other rows of the batch.

Ties: top-k and top-p are applied as a per-row logit threshold, so every token tied with the
last kept token is kept too (HF's top-k does the same; top-p in HF/vLLM breaks such ties by sort
order instead). This keeps the result independent of the sort's tie order and avoids a scatter.

Logits split over the vocabulary (`VocabSplit`: the lm_head's columns on several devices) are
sampled where they lie: each shard's candidates (its top tokens, its first maximum, its part of a
softmax's sum) are combined, never the logits. Greedy tokens, draws and log-probabilities are the
same as from whole logits; top-k and top-p choose among the row's `CANDIDATES` most likely tokens
(a larger top-k, or a nucleus wider than that, is cut there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ..core.sharding import ShardingRules

KEY_IMPL = "threefry2x32"  # the PRNG of every row's key
BAD_WORD_TOKENS = 8  # the longest bad word: the device keeps each row's last BAD_WORD_TOKENS - 1 tokens
CANDIDATES = 4096  # tokens top-k and top-p choose among when the vocabulary is split over devices


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row settings as device arrays [B] (what the jitted loop carries).

    Every field is a pytree leaf, so new values of the same batch size never recompile.
    """

    temperature: jax.Array  # [B] float32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32, 1 = off
    min_p: jax.Array  # [B] float32, 0 = off
    repetition_penalty: jax.Array  # [B] float32, 1 = off
    presence_penalty: jax.Array  # [B] float32
    frequency_penalty: jax.Array  # [B] float32
    keys: jax.Array  # [B] typed threefry PRNG keys, one per row from its seed
    stop_tokens: jax.Array  # [B, S] int32 stop ids, padded with -1 (S >= 1)
    max_new_tokens: jax.Array  # [B] int32

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenRuleRows:
    """Each row's token rules, sparse (host numpy arrays or device arrays), padded with -1 to
    power-of-two widths: what `token_rules` expands once per request into dense `TokenRules`."""

    bias_ids: np.ndarray  # [B, W] int32 logit_bias ids, then one-token bad words
    bias_values: np.ndarray  # [B, W] float32 their biases (-inf for bad words)
    allowed: np.ndarray  # [B, A] int32 allowed_token_ids (row all -1: every token allowed)
    stops: np.ndarray  # [B, S] int32 the stop ids that min_tokens holds back
    min_tokens: np.ndarray  # [B] int32
    bad_prefix: np.ndarray  # [B, N, H] int32 a bad word's tokens but the last, right-aligned (-1 before)
    bad_last: np.ndarray  # [B, N] int32 its last token (-1: no word)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenRules:
    """Each row's rules on its next token, dense over the vocabulary (`token_rules`), applied by
    `restrict` before penalties: logit_bias, allowed_token_ids, bad_words_ids and min_tokens."""

    bias: jax.Array  # [B, V] float32 added to the logits; -inf bans
    stops: jax.Array  # [B, V] bool banned while fewer than `min_tokens` tokens were generated
    min_tokens: jax.Array  # [B] int32
    bad_prefix: jax.Array  # [B, N, H] int32 (`TokenRuleRows`)
    bad_last: jax.Array  # [B, N] int32
    active: jax.Array  # [B] bool the row has some rule


def token_rules(rows: TokenRuleRows, vocab_size: int) -> TokenRules:
    """(In a program) the dense rules of `rows`; ids outside the vocabulary are ignored."""
    batch = rows.min_tokens.shape[0]
    index = jnp.arange(batch)[:, None]

    def column(ids: jax.Array) -> jax.Array:  # padding and out-of-vocabulary ids go to a dropped column
        return jnp.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)

    restricted = jnp.any(rows.allowed >= 0, axis=1)
    allowed = jnp.zeros((batch, vocab_size + 1), bool).at[index, column(rows.allowed)].set(True)[:, :vocab_size]
    bias = jnp.where(restricted[:, None] & ~allowed, -jnp.inf, 0.0)
    bias = jnp.pad(bias, ((0, 0), (0, 1))).at[index, column(rows.bias_ids)].add(rows.bias_values)[:, :vocab_size]
    stops = jnp.zeros((batch, vocab_size + 1), bool).at[index, column(rows.stops)].set(True)[:, :vocab_size]
    active = (restricted | jnp.any(rows.bias_ids >= 0, axis=1) | (rows.min_tokens > 0)
              | jnp.any(rows.bad_last >= 0, axis=1))
    return TokenRules(bias.astype(jnp.float32), stops, jnp.asarray(rows.min_tokens, jnp.int32),
                      jnp.asarray(rows.bad_prefix, jnp.int32), jnp.asarray(rows.bad_last, jnp.int32), active)


def no_recent(batch: int) -> jax.Array:
    """`[B, BAD_WORD_TOKENS - 1]` int32: no token generated yet (what `restrict` compares bad words with)."""
    return jnp.full((batch, BAD_WORD_TOKENS - 1), -1, jnp.int32)


def push_recent(recent: jax.Array, tokens: jax.Array, active: jax.Array | None = None) -> jax.Array:
    """Each row's last generated tokens with `tokens [B]` appended (rows with `active` False unchanged)."""
    pushed = jnp.concatenate([recent[:, 1:], tokens[:, None].astype(jnp.int32)], axis=1)
    return pushed if active is None else jnp.where(active[:, None], pushed, recent)


def restrict(logits: jax.Array, rules: TokenRules | None, generated: jax.Array, recent: jax.Array | None,
             rows: jax.Array | None = None) -> jax.Array:
    """`logits [B, V]` (float32) with each row's rules applied: bias added, stop tokens banned while
    `generated [B]` < min_tokens, and a bad word's last token banned where its other tokens are the
    row's last generated ones (`recent [B, H]`, oldest first). `rows`: the rules are `[S, ...]` and row
    b's are `rows[b]`. Skipped (no vocabulary-sized work) when no row has a rule."""
    logits = logits.astype(jnp.float32)
    if rules is None:
        return logits

    def apply(x: jax.Array) -> jax.Array:
        r = rules if rows is None else jax.tree.map(lambda a: a[rows], rules)
        x = x + r.bias
        x = jnp.where(r.stops & (generated < r.min_tokens)[:, None], -jnp.inf, x)
        prefix = r.bad_prefix
        matches = jnp.all((prefix < 0) | (prefix == recent[:, None, :]), axis=-1) & (r.bad_last >= 0)
        banned = jnp.where(matches, r.bad_last, x.shape[1])
        index = jnp.arange(x.shape[0])[:, None]
        return jnp.pad(x, ((0, 0), (0, 1))).at[index, banned].set(-jnp.inf)[:, :-1]

    active = rules.active if rows is None else rules.active[rows]
    return jax.lax.cond(jnp.any(active), apply, lambda x: x, logits)


def init_counts(
    prompt_tokens: jax.Array | np.ndarray, lengths: jax.Array | np.ndarray | None, vocab_size: int
) -> tuple[jax.Array, jax.Array]:
    """(prompt_seen [B, V] bool, output_counts [B, V] int32 zeros) to start a generation.

    prompt_seen marks the tokens in each row's prompt, counting only the first lengths[b] positions.
    `prompt_tokens` is [B, T], right-padded; `lengths` None means every position is real.
    Token ids outside [0, vocab_size) are ignored (the model could not have produced them).
    """
    tokens = jnp.asarray(prompt_tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"init_counts: prompt_tokens must be [batch, time], got shape {tokens.shape}")
    batch, time = tokens.shape
    if lengths is None:
        lengths = jnp.full((batch,), time, jnp.int32)
    valid = jnp.arange(time)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]
    valid &= (tokens >= 0) & (tokens < vocab_size)
    # Padding goes to an extra column that is dropped, instead of relying on scatter OOB modes.
    index = jnp.where(valid, tokens, vocab_size)
    rows = jnp.arange(batch)[:, None]
    seen = jnp.zeros((batch, vocab_size + 1), bool).at[rows, index].set(True)[:, :vocab_size]
    return seen, jnp.zeros((batch, vocab_size), jnp.int32)


def update_counts(output_counts: jax.Array, tokens: jax.Array, active: jax.Array | None = None) -> jax.Array:
    """Add each row's new token to its output counts; rows with `active` False are unchanged."""
    increment = jnp.ones(tokens.shape, output_counts.dtype)
    if active is not None:
        increment = jnp.where(active, increment, 0)
    rows = jnp.arange(output_counts.shape[0])
    return output_counts.at[rows, tokens].add(increment)


def is_stop_token(tokens: jax.Array, sampling: SamplingArrays) -> jax.Array:
    """[B] bool: the token is one of the row's stop ids (the -1 padding never matches)."""
    return jnp.any(tokens[:, None] == sampling.stop_tokens, axis=-1)


def apply_penalties(
    logits: jax.Array, sampling: SamplingArrays, prompt_seen: jax.Array, output_counts: jax.Array
) -> jax.Array:
    """Repetition (prompt or output), then presence and frequency (output only) penalties, float32 [B, V]."""
    logits = logits.astype(jnp.float32)
    rep = sampling.repetition_penalty[:, None]
    seen = prompt_seen | (output_counts > 0)
    # CTRL/HF: dividing a positive logit and multiplying a negative one both make it less likely.
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = output_counts.astype(jnp.float32)
    logits -= sampling.frequency_penalty[:, None] * counts
    logits -= sampling.presence_penalty[:, None] * (counts > 0)
    return logits


def _scale(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """Divide by temperature after subtracting the row max, so a tiny temperature gives -inf, not inf - inf = NaN."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # an all -inf row stays -inf instead of NaN
    safe_t = jnp.where(temperature > 0, temperature, 1.0)[:, None]  # greedy rows: value unused
    return (logits - top) / safe_t


@dataclasses.dataclass(frozen=True)
class VocabSplit:
    """Logits `[B, V]` split over the vocabulary: the mesh, the axis holding the vocabulary's shards,
    and the axis holding the rows (None: every device holds every row)."""

    mesh: Mesh
    vocab: str
    rows: str | None = None

    def specs(self, batch: int) -> tuple[P, P]:
        """The specs of `[B, V]` logits and of `[B, ...]` per-row results under `shard_map`; rows whole
        where they do not divide their axis."""
        rows = self.rows if self.rows and batch % self.mesh.shape[self.rows] == 0 else None
        return P(rows, self.vocab), P(rows)


def vocab_split(mesh: Mesh | None, rules: ShardingRules, vocab_size: int) -> VocabSplit | None:
    """How `[B, vocab_size]` logits lie under `rules` (the vocabulary as the lm_head's columns, the
    rows as `rules.batch`); None where they are whole (no mesh, one shard, or a vocabulary the
    axis does not divide)."""
    axis = rules.vocab
    if mesh is None or axis is None or mesh.shape[axis] == 1 or vocab_size % mesh.shape[axis]:
        return None
    return VocabSplit(mesh, axis, rules.batch)


def top_k(x: jax.Array, k: int, split: VocabSplit | None = None) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)` of `[B, V]` (values, int32 indices; ties: the lower index first). Split
    logits: each shard's top k, gathered (`[B, shards * k]`, not `[B, V]`), then the top k of those."""
    if split is None:
        values, indices = jax.lax.top_k(x, k)
        return values, indices.astype(jnp.int32)

    def per_shard(part: jax.Array) -> tuple[jax.Array, jax.Array]:
        values, indices = jax.lax.top_k(part, min(k, part.shape[-1]))
        indices = indices.astype(jnp.int32) + jax.lax.axis_index(split.vocab) * part.shape[-1]
        values = jax.lax.all_gather(values, split.vocab, axis=1, tiled=True)
        indices = jax.lax.all_gather(indices, split.vocab, axis=1, tiled=True)
        values, best = jax.lax.top_k(values, k)  # shard order is index order: ties stay lowest-first
        return values, jnp.take_along_axis(indices, best, axis=1)

    logits_spec, rows_spec = split.specs(x.shape[0])
    return jax.shard_map(per_shard, mesh=split.mesh, in_specs=logits_spec, out_specs=(rows_spec, rows_spec),
                         check_vma=False)(x)


def split_argmax(x: jax.Array, split: VocabSplit | None = None) -> jax.Array:
    """`argmax(x)` of `[B, V]` (the first maximum; the first NaN if any). Split logits: each shard's
    first maximum and its value, gathered (`[B, shards]`), then the first of the largest."""
    if split is None:
        return argmax(x)

    def per_shard(part: jax.Array) -> jax.Array:
        local = argmax(part)
        value = jnp.take_along_axis(part, local[:, None], axis=1)
        values = jax.lax.all_gather(value, split.vocab, axis=1, tiled=True)
        indices = jax.lax.all_gather(local[:, None] + jax.lax.axis_index(split.vocab) * part.shape[-1],
                                     split.vocab, axis=1, tiled=True)
        return jnp.take_along_axis(indices, jnp.argmax(values, axis=1)[:, None], axis=1)[:, 0].astype(jnp.int32)

    logits_spec, rows_spec = split.specs(x.shape[0])
    return jax.shard_map(per_shard, mesh=split.mesh, in_specs=logits_spec, out_specs=rows_spec, check_vma=False)(x)


def _candidates_threshold(logits: jax.Array, top_k_: jax.Array, top_p: jax.Array, split: VocabSplit) -> jax.Array:
    """`_top_k_top_p_threshold` over the row's `CANDIDATES` most likely tokens (split logits): top-k
    beyond them keeps them all, top-p normalizes over the whole vocabulary (or the top-k) and stops
    at the last of them."""
    count = min(CANDIDATES, logits.shape[-1])
    ordered, _ = top_k(logits, count, split)  # descending
    kth = jnp.take_along_axis(ordered, (jnp.clip(top_k_, 1, count) - 1)[:, None], axis=-1)
    k_threshold = jnp.where(top_k_[:, None] > 0, kth, -jnp.inf)
    in_top_k = ordered >= k_threshold
    top = ordered[:, :1]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.where(in_top_k, jnp.exp(ordered - top), 0.0)
    # The top-k set lies among the candidates; without top-k the sum runs over every shard's tokens.
    whole = jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True)
    probs = weights / jnp.where(top_k_[:, None] > 0, jnp.sum(weights, axis=-1, keepdims=True), whole)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    last_kept = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True) - 1, 0)
    return jnp.take_along_axis(ordered, last_kept, axis=-1)


def _top_k_top_p_threshold(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[B, 1] logit threshold of top-k then top-p (keep logits >= threshold); -inf where both are off."""
    vocab = logits.shape[-1]
    ordered = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)  # descending
    kth = jnp.take_along_axis(ordered, (jnp.clip(top_k, 1, vocab) - 1)[:, None], axis=-1)
    k_threshold = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)
    in_top_k = ordered >= k_threshold
    # Top-p on the distribution renormalized after top-k, as HF applies its warpers in sequence.
    probs = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive: the first token is always kept
    # top_p == 1 is "off" rather than trusting a float32 cumsum to stay below 1.0.
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    # keep is a prefix of the sorted row; the clamp only matters for an all -inf row (NaN probs).
    last_kept = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True) - 1, 0)
    return jnp.take_along_axis(ordered, last_kept, axis=-1)


def apply_filters(logits: jax.Array, sampling: SamplingArrays, split: VocabSplit | None = None) -> jax.Array:
    """Temperature, top-k, top-p and min-p: float32 [B, V] scaled logits with removed tokens at -inf.

    The row's maximum is always kept, so at least one token stays finite for a finite row.
    Values for greedy rows (temperature 0) are meaningless; `sample` ignores them.
    """
    scaled = _scale(logits, sampling.temperature)
    needs_sort = jnp.any((sampling.top_k > 0) | (sampling.top_p < 1.0))
    # The full sort of a 129k vocabulary is the expensive part: skip it when no row filters.
    threshold = jax.lax.cond(
        needs_sort,
        _top_k_top_p_threshold if split is None else lambda x, k, p: _candidates_threshold(x, k, p, split),
        lambda x, k, p: jnp.full((x.shape[0], 1), -jnp.inf, x.dtype),
        scaled,
        sampling.top_k,
        sampling.top_p,
    )
    # min-p: prob >= min_p * max_prob  <=>  logit >= max_logit + log(min_p); after top-k/top-p
    # the maximum survives, so renormalizing does not change this ratio. Here max_logit is 0.
    min_p_threshold = jnp.log(sampling.min_p)[:, None]  # log(0) = -inf keeps everything
    keep = (scaled >= threshold) & (scaled >= min_p_threshold)
    return jnp.where(keep, scaled, -jnp.inf)


_ARGMAX_BLOCK = 128


def argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32 for `[B, V]`, the same index (the first maximum; the first NaN
    if any), computed blockwise: the maximum of each block of 128 entries (a plain reduction, which
    XLA:CPU vectorizes), the first block holding the row's maximum, then the first maximum inside
    it. jnp.argmax's two-operand reduction is not vectorized on CPU: at R1's 129k vocabulary this is
    ~10x faster there."""
    batch, vocab = x.shape
    if vocab <= _ARGMAX_BLOCK:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    blocks = -(-vocab // _ARGMAX_BLOCK)
    if blocks * _ARGMAX_BLOCK != vocab:  # padding after the end never wins a tie (first index)
        x = jnp.pad(x, ((0, 0), (0, blocks * _ARGMAX_BLOCK - vocab)), constant_values=-jnp.inf)
    x = x.reshape(batch, blocks, _ARGMAX_BLOCK)
    block = jnp.argmax(jnp.max(x, axis=-1), axis=-1)  # NaN propagates into its block's maximum
    inside = jnp.argmax(jnp.take_along_axis(x, block[:, None, None], axis=1)[:, 0], axis=-1)
    return (block * _ARGMAX_BLOCK + inside).astype(jnp.int32)


def sample(
    logits: jax.Array, sampling: SamplingArrays, prompt_seen: jax.Array, output_counts: jax.Array, step: jax.Array,
    rows: jax.Array | None = None, rules: TokenRules | None = None, recent: jax.Array | None = None,
    split: VocabSplit | None = None,
) -> jax.Array:
    """Next token per row, int32 [B].

    Order: the row's `rules` (`restrict`: logit bias, allowed tokens, bad words against `recent`,
    min_tokens against `step`) -> penalties (repetition on prompt_seen | output_counts>0, presence and frequency on
    output_counts) -> greedy rows take argmax -> temperature -> top-k -> top-p -> min-p ->
    categorical draw with key fold_in(keys[b], step).

    `step` is a scalar or a [B] array (rows at different steps); it must differ between the
    draws of one row, e.g. the number of tokens generated so far.

    `rows` `[B]`: `prompt_seen` and `output_counts` are `[S, V]` and row b's are their row `rows[b]`
    (e.g. the serving engine's slots), gathered only when some row has penalties; None: they are
    `[B, V]`, one per row (the same for `rules`). `split`: the logits are split over the vocabulary.
    """
    generated = jnp.broadcast_to(jnp.asarray(step, jnp.int32), sampling.temperature.shape)
    logits = restrict(logits, rules, generated, recent, rows)

    def penalize(x: jax.Array) -> jax.Array:
        seen, counts = (prompt_seen, output_counts) if rows is None else (prompt_seen[rows], output_counts[rows])
        return apply_penalties(x, sampling, seen, counts)

    steps = jnp.broadcast_to(jnp.asarray(step, jnp.uint32), sampling.keys.shape)

    def draw(penalized: jax.Array) -> jax.Array:
        filtered = apply_filters(penalized, sampling, split)
        step_keys = jax.vmap(jax.random.fold_in)(sampling.keys, steps)
        # One draw per row from that row's own key: rows never share random bits. The draw is
        # `jax.random.categorical`'s (the argmax of logits plus Gumbel noise), its argmax taken where
        # the logits lie; the noise of each vocabulary shard is generated on that shard.
        noise = jax.vmap(lambda key: jax.random.gumbel(key, filtered.shape[1:], filtered.dtype))(step_keys)
        return split_argmax(noise + filtered, split)

    def choose(penalized: jax.Array) -> jax.Array:
        greedy_tokens = split_argmax(penalized, split)
        # The draw (random bits for every vocabulary entry of every row) costs ~10x the argmax on CPU
        # at R1's vocabulary: skip it when every row is greedy.
        drawn = jax.lax.cond(jnp.any(sampling.temperature > 0), draw, lambda _: greedy_tokens, penalized)
        return jnp.where(sampling.temperature > 0, drawn, greedy_tokens)

    # Penalties read and write every vocabulary entry of every row: skip them when no row has any.
    # Each branch returns tokens only: a `[B, V]` branch output would be copied out of the cond.
    return jax.lax.cond(
        jnp.any((sampling.repetition_penalty != 1) | (sampling.presence_penalty != 0)
                | (sampling.frequency_penalty != 0)),
        lambda x: choose(penalize(x)),
        lambda x: choose(x.astype(jnp.float32)),
        logits,
    )


def apply_masks(logits: jax.Array, masks: jax.Array, mask_rows: jax.Array) -> jax.Array:
    """(In a program) `logits [B, V]` with the tokens that row b's bitmask `masks[mask_rows[b]]` forbids at
    -inf; rows with `mask_rows` -1 are unchanged. Skipped when no row has a mask."""
    vocab = logits.shape[1]

    def apply(x: jax.Array) -> jax.Array:
        words = masks[jnp.maximum(mask_rows, 0)]
        bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
        allowed = bits.reshape(words.shape[0], -1)[:, :vocab] != 0
        return jnp.where(allowed | (mask_rows < 0)[:, None], x, -jnp.inf)

    return jax.lax.cond(jnp.any(mask_rows >= 0), apply, lambda x: x, logits.astype(jnp.float32))


TOP_LOGPROBS = 20  # the most alternatives per token OpenAI's API returns (`top_logprobs` <= 20)


def token_logprobs(logits: jax.Array, tokens: jax.Array, wanted: jax.Array,
                   split: VocabSplit | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of the sampled `tokens [B]` under the raw `logits [B, V]` (log-softmax in float32:
    before penalties, temperature and filters, as OpenAI and vLLM report them), and each row's
    `TOP_LOGPROBS` most likely tokens: `(logprobs [B], top_ids [B, TOP], top_logprobs [B, TOP])`,
    most likely first (a vocabulary smaller than TOP pads with id -1 and -inf).

    Computed only when some row is `wanted [B]` (a pass over the vocabulary and a top-k that a
    serving step does not pay otherwise); every value is 0 when none is. `split`: the logits are
    split over the vocabulary (the top tokens are each shard's, combined)."""
    batch, vocab = logits.shape
    top = min(TOP_LOGPROBS, vocab)

    def compute(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        # A masked sum rather than a gather: where the vocabulary is split, each shard adds its part.
        ids = jax.lax.broadcasted_iota(jnp.int32, logp.shape, 1)
        chosen = jnp.sum(jnp.where(ids == tokens[:, None], logp, 0.0), axis=-1)
        top_logprobs, top_ids = top_k(logp, top, split)
        pad = ((0, 0), (0, TOP_LOGPROBS - top))
        return (chosen, jnp.pad(top_ids.astype(jnp.int32), pad, constant_values=-1),
                jnp.pad(top_logprobs, pad, constant_values=-jnp.inf))

    def skip(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return (jnp.zeros(batch, jnp.float32), jnp.zeros((batch, TOP_LOGPROBS), jnp.int32),
                jnp.zeros((batch, TOP_LOGPROBS), jnp.float32))

    return jax.lax.cond(jnp.any(wanted), compute, skip, logits)


