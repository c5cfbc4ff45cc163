"""R1's reasoning as DeepSeek's API returns it: the text inside `<think>...</think>` goes to
`reasoning_content`, the rest to `content`, both while streaming and at the end.

`ReasoningSplitter` splits text as it streams in; it holds back only what it cannot place yet
(text that could be the start of `</think>`, newlines that may turn out to be trailing), so the
pieces it emits join to exactly what `split_reply` gives for the whole text. That split is
`dsr1.generation.output.split_reasoning`'s (the reasoning without its surrounding newlines, the
answer without leading ones) for every output that thinks: the prompt opened `<think>` (R1's chat
template does, V3.1's with `chat_template_kwargs` `{"thinking": true}`) or the output starts with
it. Output that does not think is all `content` (V3.1's chat mode, whose prompt ends `</think>`).
"""

from __future__ import annotations

from ..generation.tokenizer import THINK_END, THINK_START

__all__ = ["ReasoningSplitter", "split_reply"]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    return max((k for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)


class ReasoningSplitter:
    """Split streamed output text into (reasoning, content) deltas. `thinking`: the prompt opened
    R1's `<think>` block, so the output starts inside it."""

    def __init__(self, thinking: bool):
        self._thinking = thinking
        # "start": deciding whether the output opens with <think>; "reasoning": inside the block;
        # "answer": after </think>; "plain": output that does not think (all content, as is).
        self._mode = "start"
        self._raw = ""  # the text of the current mode, from its beginning
        self._sent = 0  # characters of the current mode's cleaned text already emitted

    def push(self, piece: str) -> tuple[str, str]:
        """Add streamed text; returns the (reasoning, content) text that became final."""
        return self._advance(piece, final=False)

    def finish(self) -> tuple[str, str]:
        """The output is complete: returns the rest of (reasoning, content)."""
        return self._advance("", final=True)

    def _advance(self, piece: str, final: bool) -> tuple[str, str]:
        self._raw += piece
        if self._mode == "start":
            if not final and THINK_START.startswith(self._raw):
                return "", ""  # might still become "<think>"
            opens = self._raw.startswith(THINK_START)
            self._switch("reasoning" if opens or self._thinking else "plain", self._raw.removeprefix(THINK_START))
        reasoning = ""
        if self._mode == "reasoning":
            end = self._raw.find(THINK_END)
            if end < 0:
                return self._emit(self._stable_reasoning(final)), ""
            reasoning = self._emit(self._raw[:end].strip("\n"))
            self._switch("answer", self._raw[end + len(THINK_END):])
        if self._mode == "answer":
            return reasoning, self._emit(self._raw.lstrip("\n"))
        return reasoning, self._emit(self._raw)

    def _stable_reasoning(self, final: bool) -> str:
        """The reasoning so far without what may still change: a possible start of `</think>` and
        newlines at either end (trailing ones are held until more reasoning follows them)."""
        if final:
            return self._raw.strip("\n")
        return self._raw[:len(self._raw) - _partial_suffix(self._raw, THINK_END)].strip("\n")

    def _switch(self, mode: str, raw: str) -> None:
        self._mode, self._raw, self._sent = mode, raw, 0

    def _emit(self, cleaned: str) -> str:
        """The part of the current mode's cleaned text not emitted yet."""
        new = cleaned[self._sent:]
        self._sent = max(self._sent, len(cleaned))
        return new


def split_reply(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, content) of a complete output, exactly as the streamed pieces join."""
    splitter = ReasoningSplitter(thinking)
    first, last = splitter.push(text), splitter.finish()
    return first[0] + last[0], first[1] + last[1]
