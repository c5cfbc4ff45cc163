"""One prompt in, one completion out: the host-side pieces shared by `generate` (static batches) and
the serving engine (`dsr1.serving`, continuous batching).

- `encode_prompt`: token ids, text (with BOS, or one user turn of the chat template) or chat messages.
- `request_sampling`: a request's `Sampling` with the model's EOS among its stop tokens.
- `RowOutput`: a row's tokens and text as they arrive: incremental detokenization, stop tokens and
  strings (cut exactly, nothing after them kept), and the text that can safely be streamed.
- `Completion`, `split_reasoning` and `visible_text`: the finished output, R1's reasoning separated
  from the answer; what a person reads carries no `<think>` / `</think>` markers.
- `text_tokenizer`: the tokenizer a request uses by default: the model's own, else R1's.
- `TokenLogprob`: an output token's log-probability and the most likely alternatives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from .sampling import Sampling, find_stop_string
from .tokenizer import THINK_END, THINK_START, StreamDecoder, Tokenizer, load_tokenizer

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
    """One row's output. `tokens` excludes the stop token; `text` ends before any stop string and
    reads as displayed: R1's reasoning, a blank line, the answer, without the `<think>` markers
    (`visible_text`; the tokens' raw text is `tokenizer.decode(tokens)`)."""

    tokens: list[int]
    text: str
    reasoning: str  # R1's thinking, between <think> and </think>
    answer: str  # what follows </think> (all of `text` when the model does not think)
    finish_reason: str  # "stop" (stop token or string) or "length" (or "abort" in serving)
    prompt_tokens: int


def needs_tokenizer(prompt: Prompt) -> bool:
    """Whether encoding `prompt` needs a tokenizer (text or chat messages, not token ids)."""
    return isinstance(prompt, str) or bool(len(prompt) and isinstance(prompt[0], dict))


def text_tokenizer(tokenizer: Tokenizer | None, own: Tokenizer | None, vocab_size: int,
                   prompts: Sequence[Prompt]) -> Tokenizer | None:
    """The tokenizer for `prompts`: `tokenizer` if given, else the model's `own` (its checkpoint's),
    else R1's when a prompt is text, else None (token ids in, token ids out). A tokenizer with more
    ids than the model's `vocab_size` is refused: its ids past the vocabulary would be errors and
    the ones below it another vocabulary's tokens, read as noise."""
    tokenizer = tokenizer or own
    if tokenizer is None and any(needs_tokenizer(p) for p in prompts):
        tokenizer = load_tokenizer()
    if tokenizer is not None and tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} token ids but the model's vocabulary holds "
                         f"{vocab_size}: pass the model's own tokenizer (dsr1.load_tokenizer(checkpoint_folder)), "
                         "or token ids")
    return tokenizer


def encode_prompt(prompt: Prompt, tokenizer: Tokenizer | None, chat: bool,
                  chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a prompt: ids as given; text with BOS (or as one user turn of the chat template
    with `chat=True`); chat messages through the template, with its switches `chat_template_kwargs`
    (V3.1: `{"thinking": True}`). ValueError if empty, a tokenizer is missing, or the template
    takes no such switch."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer")
        if chat:
            return tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                 chat_template_kwargs=chat_template_kwargs)
        return tokenizer.encode(prompt, add_bos=True)
    items = list(prompt)
    if items and isinstance(items[0], dict):
        if tokenizer is None:
            raise ValueError("chat prompts need a tokenizer")
        return tokenizer.apply_chat_template(items, chat_template_kwargs=chat_template_kwargs)
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
    """Whether the prompt ends by opening a `<think>` block: R1's generation prompt ends
    `<think>` + newline, V3.1's in thinking mode `<think>` alone (in chat mode `</think>`: no)."""
    if not tokenizer:
        return False
    markers = (tokenizer.encode(THINK_START + "\n"), tokenizer.encode(THINK_START))
    return any(list(prompt[-len(ids):]) == ids for ids in markers if ids)


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, answer) of an R1 output. `thinking`: the prompt already opened `<think>`. Output
    that neither follows an open `<think>` nor starts with one is all answer."""
    if not (thinking or text.startswith(THINK_START)):
        return "", text
    reasoning, _, answer = text.removeprefix(THINK_START).partition(THINK_END)
    return reasoning.strip("\n"), answer.lstrip("\n")  # no </think>: still thinking when it stopped


def _partial_marker(text: str) -> int:
    """Length of the longest suffix of `text` that may still grow into `<think>` or `</think>`."""
    return max((k for m in (THINK_START, THINK_END) for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


def _unmarked(text: str) -> str:
    return text.replace(THINK_START, "").replace(THINK_END, "")


def visible_text(text: str, thinking: bool, final: bool = True) -> str:
    """An output as a person reads it: R1's reasoning, a blank line, then the answer, with no
    `<think>` / `</think>` marker. Before the output is `final`, what may still change (a partial
    marker, the start that may yet open `<think>`) is held back, so each call's result extends the
    previous one's and can be streamed."""
    if not final:
        text = text[:len(text) - _partial_marker(text)]
        if not thinking and THINK_START.startswith(text):
            return ""
    if not (thinking or text.startswith(THINK_START)):
        return _unmarked(text)
    reasoning, answer = (_unmarked(part) for part in split_reasoning(text, thinking))
    return reasoning + ("\n\n" if reasoning and answer else "") + answer


class RowOutput:
    """Host-side bookkeeping of one row: tokens, text, stop tokens and strings, and what was already streamed."""

    def __init__(self, tokenizer: Tokenizer | None, settings: Sampling):
        self.tokens: list[int] = []
        self.text = ""  # the tokens' raw text, R1's markers included
        self.streamed = 0
        self.shown = 0  # characters of `visible_text` already returned by `displayable`
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

    def _settled(self, final: bool) -> int:
        """How much of `text` no stop string can cut any more (held back while it could begin one)."""
        end = len(self.text)
        if not final and not self.stopped_by_string:
            end -= max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return end

    def streamable(self, final: bool) -> str:
        """New raw text (markers included) that can no longer be cut by a stop string."""
        end = self._settled(final)
        new, self.streamed = self.text[self.streamed:end], max(self.streamed, end)
        return new

    def displayable(self, final: bool, thinking: bool) -> str:
        """New text as displayed (`visible_text`, no reasoning markers); the pieces join to the
        completion's `text`. `thinking`: the prompt opened `<think>`."""
        shown = visible_text(self.text[:self._settled(final)], thinking, final)
        new, self.shown = shown[self.shown:], max(self.shown, len(shown))
        return new

    def completion(self, finish_reason: str, prompt_tokens: int, thinking: bool) -> Completion:
        """The finished row as a `Completion`."""
        reasoning, answer = split_reasoning(self.text, thinking)
        return Completion(list(self.tokens), visible_text(self.text, thinking), reasoning, answer, finish_reason,
                          prompt_tokens)
