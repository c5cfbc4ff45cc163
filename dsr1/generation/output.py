"""One prompt in, one completion out: the host-side pieces shared by `generate` (static batches) and
the serving engine (`dsr1.serving`, continuous batching).

- `encode_prompt`: token ids, text (with BOS, or one user turn of the chat template) or chat messages.
- `request_sampling`: a request's `Sampling` with the model's EOS among its stop tokens.
- `RowOutput`: a row's tokens and text as they arrive: incremental detokenization, stop tokens and
  strings (cut exactly, nothing after them kept), and the text that can safely be streamed.
- `Completion` and `split_reasoning`: the finished output, R1's reasoning separated from the answer.
- `TokenLogprob`: an output token's log-probability and the most likely alternatives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from .sampling import Sampling, find_stop_string
from .tokenizer import THINK_END, THINK_START, StreamDecoder, Tokenizer

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability under the model's raw logits (before penalties, temperature
    and filters) and the `top` most likely tokens at that position as `(token id, log-probability)`,
    most likely first (as many as the request asked for)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Completion:
    """One row's output. `tokens` excludes the stop token; `text` ends before any stop string."""

    tokens: list[int]
    text: str
    reasoning: str  # R1's thinking, between <think> and </think>
    answer: str  # what follows </think> (all of `text` when the model does not think)
    finish_reason: str  # "stop" (stop token or string) or "length" (or "abort" in serving)
    prompt_tokens: int


def needs_tokenizer(prompt: Prompt) -> bool:
    """Whether encoding `prompt` needs a tokenizer (text or chat messages, not token ids)."""
    return isinstance(prompt, str) or bool(len(prompt) and isinstance(prompt[0], dict))


def encode_prompt(prompt: Prompt, tokenizer: Tokenizer | None, chat: bool) -> list[int]:
    """Token ids of a prompt: ids as given; text with BOS (or as one user turn of the chat template
    with `chat=True`); chat messages through the template. ValueError if empty or a tokenizer is missing."""
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


def request_sampling(sampling: Sampling, eos_id: int, max_new_tokens: int | None) -> Sampling:
    """`sampling` with the model's EOS among its stop tokens (unless `ignore_eos`) and `max_new_tokens`
    (when given) as budget."""
    stops = sampling.stop_token_ids if sampling.ignore_eos else (*sampling.stop_token_ids, eos_id)
    budget = max_new_tokens or sampling.max_new_tokens
    return dataclasses.replace(sampling, stop_token_ids=tuple(dict.fromkeys(stops)), max_new_tokens=budget,
                               min_tokens=min(sampling.min_tokens, budget))


def opens_thinking(prompt: Sequence[int], tokenizer: Tokenizer | None) -> bool:
    """Whether the prompt ends by opening R1's `<think>` block (the chat template's generation prompt)."""
    return bool(tokenizer) and list(prompt[-2:]) == tokenizer.encode(THINK_START + "\n")


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, answer) of an R1 output. `thinking`: the prompt already opened `<think>`."""
    if THINK_END in text:
        reasoning, answer = text.split(THINK_END, 1)
        return reasoning.removeprefix(THINK_START).strip("\n"), answer.lstrip("\n")
    if thinking or text.startswith(THINK_START):
        return text.removeprefix(THINK_START).strip("\n"), ""  # still thinking when it stopped
    return "", text


class RowOutput:
    """Host-side bookkeeping of one row: tokens, text, stop tokens and strings, and what was already streamed."""

    def __init__(self, tokenizer: Tokenizer | None, settings: Sampling):
        self.tokens: list[int] = []
        self.text = ""
        self.streamed = 0
        self.stopped_by_token = False
        self.stopped_by_string = False
        self.decoder = StreamDecoder(tokenizer, settings.skip_special_tokens) if tokenizer else None
        self.stops = settings.stop_strings
        self.keep_stop_string = settings.include_stop_str_in_output
        self.stop_ids = set(settings.stop_token_ids)

    @property
    def stopped(self) -> bool:
        """A stop token or stop string ended the row; later tokens are ignored."""
        return self.stopped_by_token or self.stopped_by_string

    def add(self, new: Iterable[int]) -> None:
        """Append tokens, one by one, until a stop token (not kept) or a stop string (text cut right before
        it, or right after it with `include_stop_str_in_output`)."""
        for token in new:
            if self.stopped:
                return
            if token in self.stop_ids:
                self.stopped_by_token = True
                return
            self.tokens.append(token)
            if self.decoder is None:
                continue
            before = len(self.text)
            self.text += self.decoder.push(token)
            cut = find_stop_string(self.text, self.stops, start=before) if self.stops else None
            if cut is not None:
                if self.keep_stop_string:
                    cut += len(next(stop for stop in self.stops if self.text.startswith(stop, cut)))
                self.text, self.stopped_by_string = self.text[:cut], True

    def finish(self) -> None:
        """The row is over: emit any text the detokenizer held back (unless a stop string cut it)."""
        if self.decoder is not None and not self.stopped_by_string:
            self.text += self.decoder.flush()

    def streamable(self, final: bool) -> str:
        """New text that can no longer be cut by a stop string (held back while it could begin one)."""
        end = len(self.text)
        if not final and not self.stopped_by_string:
            end -= max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        new, self.streamed = self.text[self.streamed:end], max(self.streamed, end)
        return new

    def completion(self, finish_reason: str, prompt_tokens: int, thinking: bool) -> Completion:
        """The finished row as a `Completion`."""
        reasoning, answer = split_reasoning(self.text, thinking)
        return Completion(list(self.tokens), self.text, reasoning, answer, finish_reason, prompt_tokens)
