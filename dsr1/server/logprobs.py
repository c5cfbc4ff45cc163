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

__all__ = ["LogprobCursor", "chat_logprobs", "completion_logprobs"]

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


def completion_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A completions choice's (or chunk's) `logprobs` for `entries`, the first token's text at
    character `offset` of the completion."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(_token(tokenizer, e.token)[0])
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [_value(e.logprob) for e in entries],
            "top_logprobs": [{_token(tokenizer, t)[0]: _value(lp) for t, lp in e.top} for e in entries],
            "text_offset": offsets}


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
