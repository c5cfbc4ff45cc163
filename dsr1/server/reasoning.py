"""R1's reasoning as DeepSeek's API returns it: the text inside `<think>...</think>` goes to
`reasoning_content`, the rest to `content`, both while streaming and at the end.

`ReasoningSplitter` splits text as it streams in; it holds back only what it cannot place yet
(text that could be the start of `</think>`, newlines that may turn out to be trailing), so the
pieces it emits join to exactly what `split_reply` gives for the whole text. That split is
`dsr1.generation.output.split_reasoning`'s (the reasoning without its surrounding newlines, the
answer without leading ones) for every output that thinks: the prompt opened `<think>` (R1's chat
template does, V3.1's with `chat_template_kwargs` `{"thinking": true}`) or the output starts with
it. Output that does not think is all `content` (V3.1's chat mode, whose prompt ends `</think>`).

V3.2 and V4 sometimes open their DSML tool calls without closing the reasoning first (the peers'
reports: the call left inside `reasoning_content`). A DSML call block ends the reasoning as
`</think>` would, and stays in the content, where the tool-call parser reads it.
"""

from __future__ import annotations

from ..generation.dsml import DSML
from ..generation.tokenizer import THINK_END, THINK_START

__all__ = ["ReasoningSplitter", "split_reply"]

# What ends the reasoning: `</think>`, or a DSML call block (kept in the content).
_REASONING_ENDS = (THINK_END, f"<{DSML}function_calls>", f"<{DSML}tool_calls>")


def _reasoning_end(text: str) -> tuple[int, int]:
    """Where the reasoning in `text` ends and where the content after it starts ((-1, -1): not yet)."""
    found = [(at, marker) for marker in _REASONING_ENDS if (at := text.find(marker)) >= 0]
    if not found:
        return -1, -1
    at, marker = min(found)
    return at, at + len(marker) if marker == THINK_END else at


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
            end, answer = _reasoning_end(self._raw)
            if end < 0:
                return self._emit(self._stable_reasoning(final)), ""
            reasoning = self._emit(self._raw[:end].strip("\n"))
            self._switch("answer", self._raw[answer:])
        if self._mode == "answer":
            return reasoning, self._emit(self._raw.lstrip("\n"))
        return reasoning, self._emit(self._raw)

    def _stable_reasoning(self, final: bool) -> str:
        """The reasoning so far without what may still change: a possible start of `</think>` and
        newlines at either end (trailing ones are held until more reasoning follows them)."""
        if final:
            return self._raw.strip("\n")
        held = max(_partial_suffix(self._raw, marker) for marker in _REASONING_ENDS)
        return self._raw[:len(self._raw) - held].strip("\n")

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
