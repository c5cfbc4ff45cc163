"""Text generation: prefill the batch, then decode on device in chunks of steps.

One `jax.lax.while_loop` (`dsr1.programs.decoding.generate_chunk`) runs up to `chunk_size` decode steps
without returning to the host: decode, sample (per-row settings, `dsr1.programs.sampling`),
record, stop rows that hit a stop token or their token budget, and leave early when every row is
done. Between chunks the host detokenizes the new tokens, streams text, and looks for stop
strings; a row that hits one is cut exactly there and marked done on the device. R1's reasoning
(`<think>...</think>`) is separated from the answer in each completion, and the text streamed and
displayed carries no marker.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.params import without_mtp
from ..core.sharding import put_replicated, to_host
from ..programs import decoding
from .output import (
    Completion,
    Prompt,
    RowOutput,
    encode_prompt,
    opens_thinking,
    request_sampling,
    split_reasoning,
    text_tokenizer,
)
from .sampling import Sampling, batch_sampling, host_token_rules
from .tokenizer import Tokenizer

if TYPE_CHECKING:  # annotations only
    import jax

    from ..api import Model

__all__ = ["STOP_WIDTH", "Completion", "GenerationResult", "Prompt", "generate", "split_reasoning"]

STOP_WIDTH = 8  # stop-token columns: fixed, so requests with more or fewer stop ids share one program
StreamCallback = Callable[[int, str], None]  # (row, new text)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    completions: list[Completion]
    prefill_seconds: float
    decode_seconds: float
    prefill_tokens: int
    decode_tokens: int
    steady_decode_seconds: float  # decode time after the first chunk (which compiles on a first call)
    steady_decode_tokens: int
    draft_acceptance: float | None = None  # with draft_tokens > 0: the share of MTP drafts accepted

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefill_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float:
        """Decode throughput over all rows; after the first chunk when there was more than one."""
        if self.steady_decode_tokens:
            return self.steady_decode_tokens / max(self.steady_decode_seconds, 1e-9)
        return self.decode_tokens / max(self.decode_seconds, 1e-9)


def _bucket(n: int) -> int:
    """Pad prompt blocks to powers of two (at least 16): prompts of similar length share one compiled
    program instead of compiling again for every new length."""
    return max(16, 1 << (n - 1).bit_length())


def _pad(prompts: list[list[int]], limit: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), max(int(lengths.max()), min(_bucket(int(lengths.max())), limit))), np.int32)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = p
    return tokens, lengths


def generate(model: Model, prompts: Sequence[Prompt], *, max_new_tokens: int | None = None,
             sampling: Sampling | Sequence[Sampling] | None = None, tokenizer: Tokenizer | None = None,
             chat: bool = False, stream: StreamCallback | None = None, chunk_size: int = 16,
             draft_tokens: int = 0, chat_template_kwargs: dict[str, Any] | None = None,
             batch_invariant: bool = False) -> GenerationResult:
    """Generate for a batch of prompts of different lengths.

    `prompts`: strings (encoded with BOS, or as one user turn of the chat template with `chat=True`),
    chat message lists, or token id lists. `chat_template_kwargs`: the chat template's switches, as
    vLLM takes them (V3.1's `{"thinking": True}` opens the reply's reasoning; its default is chat
    mode). `tokenizer`: default the model's own (`Model.tokenizer`,
    the checkpoint's), else R1's. `sampling`: one `Sampling` for all rows or one per row
    (default greedy); the model's EOS is always a stop token. `max_new_tokens` overrides every
    row's `Sampling.max_new_tokens`. `stream(row, text)` receives each row's new text after every
    chunk of `chunk_size` decode steps (the only host round trips of the loop), as displayed: the
    pieces join to the completion's `text`, with no `<think>` marker.

    `draft_tokens=k > 0`: MTP speculative decoding (`dsr1.programs.speculative`; the model needs
    its MTP module: `dsr1.load(..., mtp=True)`). The MTP module drafts k tokens, the model verifies
    them in one step; greedy output is the same token for token, sampled output has the same
    distribution. A chunk is then `chunk_size // (k + 1)` (at least 1) draft-verify steps, and
    `GenerationResult.draft_acceptance` is the share of drafts accepted. The verification reads the
    weights once for all k+1 positions: its logits equal decoding's up to float rounding (in
    bfloat16 a near tie can flip a greedy token). `batch_invariant=True`: bit for bit, drafts or
    not (`batch_invariant_model`; the keyword `dsr1.serving.Engine` takes for the same guarantee).
    """
    n = len(prompts)
    if n == 0:
        raise ValueError("generate needs at least one prompt")
    model.check_draft_tokens(draft_tokens)
    model = batch_invariant_model(model) if batch_invariant else model
    tokenizer = text_tokenizer(tokenizer, model.tokenizer, model.cfg.vocab_size, prompts)
    settings = _row_settings(model, sampling, n, tokenizer, max_new_tokens)
    encoded = [encode_prompt(p, tokenizer, chat, chat_template_kwargs) for p in prompts]
    tokens, lengths, max_len = _prompt_arrays(model, encoded, max(s.max_new_tokens for s in settings))
    arrays = put_replicated(batch_sampling(settings, stop_width=STOP_WIDTH), model.mesh)
    rule_rows = put_replicated(host_token_rules(settings), model.mesh)
    rows = [RowOutput(tokenizer, s) for s in settings]
    thinking = [opens_thinking(p, tokenizer) for p in encoded]
    start_program, chunk_program = _programs(model, draft_tokens, chunk_size, max_len)

    start = time.perf_counter()
    state, first = start_program(tokens, lengths, arrays, rule_rows)
    chunk = to_host(first)[:, None]
    prefill_seconds = time.perf_counter() - start
    state, chunks, steady_start, steady_from = _decode(state, chunk, lambda s: chunk_program(s, arrays), rows,
                                                       stream, thinking, model.mesh)
    for row in rows:
        row.finish()
    _consume(rows, np.zeros((n, 0), np.int32), stream, thinking, final=True)
    end = time.perf_counter()
    generated = to_host(state.generated)
    decode_tokens = int(generated.sum()) - n
    completions = [row.completion("stop" if row.stopped_by_string or len(row.tokens) < generated[i] else "length",
                                  len(encoded[i]), thinking[i]) for i, row in enumerate(rows)]
    steady = decode_tokens - steady_from if chunks > 1 else 0
    acceptance = int(to_host(state.accepted)) / max(int(to_host(state.drafted)), 1) if draft_tokens else None
    return GenerationResult(completions, prefill_seconds, end - start - prefill_seconds,
                            int(sum(len(p) for p in encoded)), decode_tokens, end - steady_start if steady else 0.0,
                            steady, acceptance)


def batch_invariant_model(model: Model) -> Model:
    """`model` with products whose per-row arithmetic is the one-token decode step's whatever shares the
    call (`ShardingRules.batch_invariant`; one name with `Engine(batch_invariant=True)`, so one keyword
    means it everywhere): a verification runs each position in decode's own shapes within its one
    pass over the layers (`dsr1.core.model.verify_per_position`), so greedy tokens with drafts are
    those without, bit for bit, in bfloat16 too; drafts then save less (docs/limits.md)."""
    if model.rules.batch_invariant:
        return model
    return dataclasses.replace(model, rules=dataclasses.replace(model.rules, batch_invariant=True))


def _decode(state: Any, chunk: np.ndarray, chunk_program: Callable, rows: list[RowOutput],
            stream: StreamCallback | None, thinking: list[bool], mesh: Any) -> tuple[Any, int, float, int]:
    """Hand out each chunk's tokens and run the next until every row is done (a stop string ends its
    row here, on the host). Returns the final state, the chunks run, and when the steady state (from
    the second chunk) began and how many tokens had been sampled by then."""
    chunks, steady_start, steady_from = 0, time.perf_counter(), 0
    while True:
        _consume(rows, chunk, stream, thinking, final=False)
        stopped = np.array([r.stopped_by_string for r in rows])
        if stopped.any():
            state = dataclasses.replace(state, done=state.done | put_replicated(stopped, mesh))
        if to_host(state.done).all():
            return state, chunks, steady_start, steady_from
        state, out = chunk_program(state)
        chunk = to_host(out)
        chunks += 1
        if chunks == 1:
            steady_start, steady_from = time.perf_counter(), int((chunk >= 0).sum())


def _row_settings(model: Model, sampling: Sampling | Sequence[Sampling] | None, n: int, tokenizer: Tokenizer | None,
                  max_new_tokens: int | None) -> list[Sampling]:
    """Each row's sampling settings: one for all rows or one per row, the EOS a stop token."""
    settings = list(sampling) if isinstance(sampling, Sequence) else [sampling or Sampling()] * n
    if len(settings) != n:
        raise ValueError(f"got {len(settings)} Sampling settings for {n} prompts")
    eos = tokenizer.eos_id if tokenizer else model.cfg.eos_token_id
    settings = [request_sampling(s, eos, max_new_tokens) for s in settings]
    if any(s.stop_strings for s in settings) and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    return settings


def _prompt_arrays(model: Model, encoded: list[list[int]], budget: int) -> tuple[jax.Array, jax.Array, int]:
    """The right-padded prompts and their lengths on the model's devices, and the cache's length."""
    tokens, lengths = _pad(encoded, model.cfg.max_position_embeddings - budget)
    max_len = tokens.shape[1] + budget
    if max_len > model.cfg.max_position_embeddings:
        raise ValueError(f"prompt ({tokens.shape[1]}) + max_new_tokens ({budget}) exceeds max_position_embeddings="
                         f"{model.cfg.max_position_embeddings}")
    tokens, lengths = model.check_prompt(tokens, lengths)
    return tokens, lengths, max_len


def _programs(model: Model, draft_tokens: int, chunk_size: int, max_len: int) -> tuple[Callable, Callable]:
    """The loop's two programs on `model`: prefill and the first token `(tokens, lengths, arrays,
    rules) -> (state, first)`, then a chunk of steps `(state, arrays) -> (state, tokens)`; with
    drafts, their speculative forms."""
    if draft_tokens:
        # The cache of the same length as without drafts (the same attention shapes): a verification's
        # positions past it are never emitted, and their latents are dropped.
        def start(*args):
            return decoding.speculative_start(model.params, *args, **model.program_kwargs, max_len=max_len,
                                              kv_cache_dtype=model.kv_cache_dtype, draft_tokens=draft_tokens)

        def chunk(state, arrays):
            return decoding.speculative_chunk(model.params, state, arrays, **model.program_kwargs,
                                              steps=max(1, chunk_size // (draft_tokens + 1)), draft_tokens=draft_tokens)

        return start, chunk
    plain = without_mtp(model.params)  # what the programs that draft nothing take

    def plain_start(*args):
        return decoding.generate_start(plain, *args, **model.program_kwargs, max_len=max_len,
                                       kv_cache_dtype=model.kv_cache_dtype)

    def plain_chunk(state, arrays):
        return decoding.generate_chunk(plain, state, arrays, **model.program_kwargs, steps=chunk_size)

    return plain_start, plain_chunk


def _consume(rows: list[RowOutput], chunk: np.ndarray, stream: StreamCallback | None, thinking: list[bool],
             final: bool) -> None:
    for i, row in enumerate(rows):
        row.add([int(t) for t in chunk[i] if t >= 0])
        if stream is not None:
            text = row.displayable(final, thinking[i])
            if text:
                stream(i, text)
