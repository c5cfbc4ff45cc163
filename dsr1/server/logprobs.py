"""OpenAI's log-probability objects from the engine's `TokenLogprob`s (`Request.logprobs`).

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
"refusal": null}`. Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}`. A token's text is its bytes decoded as UTF-8 (a byte-level piece holding part of a
character reads U+FFFD there; `bytes` has the exact bytes). Values are log-softmax of the model's
raw logits; one that underflowed to -inf reads -9999.0, as OpenAI writes it (JSON has no infinity).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..generation.output import TokenLogprob
from ..generation.tokenizer import Tokenizer
from ..serving.request import Request

__all__ = ["LogprobCursor", "chat_logprobs", "completion_logprobs", "prompt_logprobs_entries",
           "vllm_prompt_logprobs"]

_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


def _token(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), raw


def _chat_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text, raw = _token(tokenizer, token_id)
    return {"token": text, "logprob": _value(logprob), "bytes": list(raw)}


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs` for `entries`."""
    content = [_chat_entry(tokenizer, e.token, e.logprob)
               | {"top_logprobs": [_chat_entry(tokenizer, t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob | int], offset: int = 0) -> dict[str, Any]:
    """A completions choice's (or chunk's) `logprobs` for `entries`, the first token's text at
    character `offset` of the completion. A bare token id (an echoed prompt's first token, which
    has no log-probability) reads None, as OpenAI's echo writes it."""
    tokens, offsets, values, tops = [], [], [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(_token(tokenizer, e if isinstance(e, int) else e.token)[0])
        offset += len(tokens[-1])
        values.append(None if isinstance(e, int) else _value(e.logprob))
        tops.append(None if isinstance(e, int) else {_token(tokenizer, t)[0]: _value(lp) for t, lp in e.top})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_entries(prompt: Sequence[int], entries: Sequence[TokenLogprob | None] | None
                            ) -> list[TokenLogprob | int]:
    """An echoed prompt's entries for `completion_logprobs`: the first token bare (it has no
    log-probability), the others the engine's. For OpenAI's echo the top alternatives include the
    prompt's own token, as OpenAI's do."""
    entries = list(entries or [None] * len(prompt))
    out: list[TokenLogprob | int] = []
    for token, e in zip(prompt, entries, strict=True):
        if e is None:
            out.append(token)
            continue
        top = dict(e.top)
        top.setdefault(e.token, e.logprob)
        out.append(TokenLogprob(e.token, e.logprob, tuple(top.items())))
    return out


def vllm_prompt_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob | None]) -> list[Any]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {"logprob", "rank",
    "decoded_token"}} for the prompt's token and its top alternatives (rank 1 is the most likely;
    the prompt's token has None when it is not among the alternatives)."""
    out: list[Any] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranks = {t: k + 1 for k, (t, _) in enumerate(e.top)}
        alternatives = [(e.token, e.logprob), *((t, lp) for t, lp in e.top if t != e.token)]
        out.append({str(t): {"logprob": _value(lp), "rank": ranks.get(t), "decoded_token": _token(tokenizer, t)[0]}
                    for t, lp in alternatives})
    return out


class LogprobCursor:
    """What a stream has sent of one choice's log-probabilities: `take` returns the entries new since
    the last call (up to the update's token count) of `request`, in the endpoint's form, or None when
    there are none."""

    def __init__(self, tokenizer: Tokenizer, chat: bool):
        self.tokenizer = tokenizer
        self.chat = chat
        self.sent = 0
        self.offset = 0  # characters of the completion's token texts sent so far (completions' text_offset)

    def take(self, request: Request, upto: int) -> dict[str, Any] | None:
        new = request.logprobs_between(self.sent, upto) if request.top_logprobs is not None else []
        if not new:
            return None
        self.sent += len(new)
        if self.chat:
            return chat_logprobs(self.tokenizer, new)
        out = completion_logprobs(self.tokenizer, new, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out
