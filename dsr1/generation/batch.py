"""Text generation: prefill the batch, then decode on device in chunks of steps.

One `jax.lax.while_loop` (`dsr1.programs.generate_chunk`) runs up to `chunk_size` decode steps
without returning to the host: decode, sample (per-row settings, `dsr1.generation.sampling`),
record, stop rows that hit a stop token or their token budget, and leave early when every row is
done. Between chunks the host detokenizes
the new tokens, streams text, and looks for stop strings; a row that hits one is cut exactly
there and marked done on the device. R1's reasoning (`<think>...</think>`) is separated from the
answer in each completion.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import programs
from ..api import Model
from ..core.sharding import put_replicated, to_host
from .sampling import Sampling, batch_sampling, find_stop_string
from .tokenizer import THINK_END, THINK_START, StreamDecoder, Tokenizer, load_tokenizer

STOP_WIDTH = 8  # stop-token columns: fixed, so requests with more or fewer stop ids share one program
Prompt = str | Sequence[int] | Sequence[dict[str, Any]]
StreamCallback = Callable[[int, str], None]  # (row, new text)


@dataclasses.dataclass(frozen=True)
class Completion:
    """One row's output. `tokens` excludes the stop token; `text` ends before any stop string."""

    tokens: list[int]
    text: str
    reasoning: str  # R1's thinking, between <think> and </think>
    answer: str  # what follows </think> (all of `text` when the model does not think)
    finish_reason: str  # "stop" (stop token or string) or "length"
    prompt_tokens: int


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    completions: list[Completion]
    prefill_seconds: float
    decode_seconds: float
    prefill_tokens: int
    decode_tokens: int
    steady_decode_seconds: float  # decode time after the first chunk (which compiles on a first call)
    steady_decode_tokens: int

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefill_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float:
        """Decode throughput over all rows; after the first chunk when there was more than one."""
        if self.steady_decode_tokens:
            return self.steady_decode_tokens / max(self.steady_decode_seconds, 1e-9)
        return self.decode_tokens / max(self.decode_seconds, 1e-9)


def _prompt_tokens(prompt: Prompt, tokenizer: Tokenizer | None, chat: bool) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer")
        if chat:
            return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return tokenizer.encode(prompt, add_bos=True)
    items = list(prompt)
    if items and isinstance(items[0], dict):
        if tokenizer is None:
            raise ValueError("chat prompts need a tokenizer")
        return tokenizer.apply_chat_template(items)
    if not items:
        raise ValueError("empty prompt")
    return [int(t) for t in items]


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


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, answer) of an R1 output. `thinking`: the prompt already opened `<think>`."""
    if THINK_END in text:
        reasoning, answer = text.split(THINK_END, 1)
        return reasoning.removeprefix(THINK_START).strip("\n"), answer.lstrip("\n")
    if thinking or text.startswith(THINK_START):
        return text.removeprefix(THINK_START).strip("\n"), ""  # still thinking when it stopped
    return "", text


class _Row:
    """Host-side bookkeeping of one row: tokens, text, stop strings and what was already streamed."""

    def __init__(self, tokenizer: Tokenizer | None, settings: Sampling):
        self.tokens: list[int] = []
        self.text = ""
        self.streamed = 0
        self.stopped_by_string = False
        self.decoder = StreamDecoder(tokenizer) if tokenizer else None
        self.stops = settings.stop_strings
        self.stop_ids = set(settings.stop_token_ids)

    def add(self, new: list[int]) -> None:
        """Append a chunk's tokens; with stop strings, token by token so nothing after a stop is kept."""
        for token in new:
            if self.stopped_by_string:
                return
            if token in self.stop_ids:
                continue
            self.tokens.append(token)
            if self.decoder is None:
                continue
            before = len(self.text)
            self.text += self.decoder.push(token)
            cut = find_stop_string(self.text, self.stops, start=before) if self.stops else None
            if cut is not None:
                self.text, self.stopped_by_string = self.text[:cut], True

    def finish(self) -> None:
        if self.decoder is not None and not self.stopped_by_string:
            self.text += self.decoder.flush()

    def streamable(self, final: bool) -> str:
        """New text that can no longer be cut by a stop string (held back while it could begin one)."""
        end = len(self.text)
        if not final and not self.stopped_by_string:
            end -= max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        new, self.streamed = self.text[self.streamed:end], max(self.streamed, end)
        return new


def generate(model: Model, prompts: Sequence[Prompt], *, max_new_tokens: int | None = None,
             sampling: Sampling | Sequence[Sampling] | None = None, tokenizer: Tokenizer | None = None,
             chat: bool = False, stream: StreamCallback | None = None, chunk_size: int = 16) -> GenerationResult:
    """Generate for a batch of prompts of different lengths.

    `prompts`: strings (encoded with BOS, or as one user turn of the chat template with `chat=True`),
    chat message lists, or token id lists. `sampling`: one `Sampling` for all rows or one per row
    (default greedy); the model's EOS is always a stop token. `max_new_tokens` overrides every
    row's `Sampling.max_new_tokens`. `stream(row, text)` receives each row's new text after every
    chunk of `chunk_size` decode steps (the only host round trips of the loop).
    """
    n = len(prompts)
    if n == 0:
        raise ValueError("generate needs at least one prompt")
    if tokenizer is None and any(isinstance(p, str) or (len(p) and isinstance(p[0], dict)) for p in prompts):
        tokenizer = load_tokenizer()
    settings = list(sampling) if isinstance(sampling, Sequence) else [sampling or Sampling()] * n
    if len(settings) != n:
        raise ValueError(f"got {len(settings)} Sampling settings for {n} prompts")
    eos = tokenizer.eos_id if tokenizer else model.cfg.eos_token_id
    settings = [dataclasses.replace(s, stop_token_ids=tuple(dict.fromkeys((*s.stop_token_ids, eos))),
                                    max_new_tokens=max_new_tokens or s.max_new_tokens) for s in settings]
    if any(s.stop_strings for s in settings) and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    encoded = [_prompt_tokens(p, tokenizer, chat) for p in prompts]
    budget = max(s.max_new_tokens for s in settings)
    tokens, lengths = _pad(encoded, model.cfg.max_position_embeddings - budget)
    max_len = tokens.shape[1] + budget
    if max_len > model.cfg.max_position_embeddings:
        raise ValueError(f"prompt ({tokens.shape[1]}) + max_new_tokens ({budget}) exceeds max_position_embeddings="
                         f"{model.cfg.max_position_embeddings}")
    tokens, lengths = model.check_prompt(tokens, lengths)
    arrays = put_replicated(batch_sampling(settings, stop_width=STOP_WIDTH), model.mesh)
    rows = [_Row(tokenizer, s) for s in settings]
    thinking = [bool(tokenizer) and p[-2:] == tokenizer.encode(THINK_START + "\n") for p in encoded]

    start = time.perf_counter()
    state, first = programs.generate_start(model.params, tokens, lengths, arrays, **model.program_kwargs,
                                           max_len=max_len, kv_cache_dtype=model.kv_cache_dtype)
    chunk = to_host(first)[:, None]
    prefill_seconds = time.perf_counter() - start
    chunks, steady_start, steady_from = 0, time.perf_counter(), 0
    while True:
        _consume(rows, chunk, stream, final=False)
        stopped = np.array([r.stopped_by_string for r in rows])
        if stopped.any():
            state = dataclasses.replace(state, done=state.done | put_replicated(stopped, model.mesh))
        if to_host(state.done).all():
            break
        state, out = programs.generate_chunk(model.params, state, arrays, **model.program_kwargs, steps=chunk_size)
        chunk = to_host(out)
        chunks += 1
        if chunks == 1:
            steady_start, steady_from = time.perf_counter(), int((chunk >= 0).sum())
    for row in rows:
        row.finish()
    _consume(rows, np.zeros((n, 0), np.int32), stream, final=True)
    end = time.perf_counter()
    decode_seconds = end - start - prefill_seconds

    generated = to_host(state.generated)
    decode_tokens = int(generated.sum()) - n
    completions = []
    for i, row in enumerate(rows):
        reason = "stop" if row.stopped_by_string or len(row.tokens) < generated[i] else "length"
        reasoning, answer = split_reasoning(row.text, thinking[i])
        completions.append(Completion(row.tokens, row.text, reasoning, answer, reason, len(encoded[i])))
    steady = decode_tokens - steady_from if chunks > 1 else 0
    return GenerationResult(completions, prefill_seconds, decode_seconds, int(sum(len(p) for p in encoded)),
                            decode_tokens, end - steady_start if steady else 0.0, steady)


def _consume(rows: list[_Row], chunk: np.ndarray, stream: StreamCallback | None, final: bool) -> None:
    for i, row in enumerate(rows):
        row.add([int(t) for t in chunk[i] if t >= 0])
        if stream is not None:
            text = row.streamable(final)
            if text:
                stream(i, text)
