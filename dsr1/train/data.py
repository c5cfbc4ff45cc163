"""Token streams and batches: plays as plain text plus speech pairs as chat turns, cut into windows.

A training document is a play (`BOS text EOS`) or an exchange of two consecutive speeches rendered as
one chat turn with R1's template (`BOS<｜User｜>speech<｜Assistant｜><think>\\n</think>\\n\\nreply EOS`), so
the chat widget answers in kind. Batches are windows of `seq_len + 2` tokens (inputs, next tokens,
and the tokens after those for the MTP loss), in an order fixed by the seed and the step alone, so a
resumed run reads exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..generation.tokenizer import EOS, THINK_END, Tokenizer, render_chat
from .corpus import speeches

MAX_SPEECH_CHARS = 800


def chat_documents(text: str) -> Iterator[str]:
    """Consecutive speeches (the 1st and 2nd, the 3rd and 4th, ...) as one user/assistant chat turn."""
    pairs = speeches(text)
    for (_, asked), (_, answer) in zip(pairs[0::2], pairs[1::2]):
        if len(asked) <= MAX_SPEECH_CHARS and len(answer) <= MAX_SPEECH_CHARS:
            prompt = render_chat([{"role": "user", "content": asked}], add_generation_prompt=True)
            yield f"{prompt}{THINK_END}\n\n{answer}{EOS}"


def encode_documents(tok: Tokenizer, plays: dict[str, str], chat: bool = True) -> np.ndarray:
    """One int32 stream of every play (`BOS text EOS`) and, with `chat`, every play's chat turns."""
    ids: list[int] = []
    for text in plays.values():
        ids += [tok.bos_id, *tok.encode(text), tok.eos_id]
    if chat:
        docs = [d for text in plays.values() for d in chat_documents(text)]
        for enc in tok.backend.encode_batch(docs, add_special_tokens=False):
            ids += enc.ids
    return np.asarray(ids, np.int32)


def window_starts(n_tokens: int, seq_len: int) -> np.ndarray:
    """Starts of the windows of `seq_len + 2` tokens, every `seq_len` tokens (each token a target once)."""
    last = n_tokens - (seq_len + 2)
    if last < 0:
        raise ValueError(f"{n_tokens} tokens cannot fill one window of {seq_len + 2}")
    return np.arange(0, last + 1, seq_len)


def batch_at(stream: np.ndarray, step: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
    """The `[batch, seq_len + 2]` windows of training step `step`: epoch after epoch, each a permutation
    of the windows drawn from (seed, epoch); a function of its arguments alone (resumable)."""
    starts = window_starts(len(stream), seq_len)
    rows = []
    for i in range(step * batch, (step + 1) * batch):
        epoch, k = divmod(i, len(starts))
        order = np.random.default_rng([seed, epoch]).permutation(len(starts))
        rows.append(stream[starts[order[k]]:starts[order[k]] + seq_len + 2])
    return np.stack(rows)


def eval_windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping `[N, seq_len + 1]` windows covering the held-out stream (the tail is dropped)."""
    n = (len(stream) - 1) // seq_len
    return np.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])


def token_byte_lengths(tok: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token stands for; 0 for special tokens (not text, not counted in bits per byte)."""
    specials = {t.content for t in tok.backend.get_added_tokens_decoder().values()}
    lengths = np.zeros(tok.vocab_size, np.int32)
    for i in range(tok.vocab_size):
        piece = tok.backend.id_to_token(i)
        if piece is not None and piece not in specials:
            lengths[i] = len(tok.token_bytes(i))
    return lengths
