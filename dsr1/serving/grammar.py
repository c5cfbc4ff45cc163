"""Grammar-constrained output with llguidance: a matcher per request, and its token mask per step.

The engine asks each constrained request's `Grammar` for the mask of its next token on the host
while the device runs the previous step, and applies it in its on-device sampler (a bitmask per
row, `dsr1.programs.sampling.apply_masks`); the sampled token is then fed back (`advance`).
llguidance is optional: it is imported when a grammar is first given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..generation.tokenizer import Tokenizer

__all__ = ["Grammar", "grammar_tokenizer", "mask_words"]


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask: token t is bit `t % 32` of word `t // 32`."""
    return (vocab_size + 31) // 32


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ValueError("grammar-constrained requests need llguidance: pip install llguidance") from None
    return llguidance


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> Any:
    """The `llguidance.LLTokenizer` of `tokenizer` over the model's `vocab_size` ids (an embedding may
    have more rows than the tokenizer has tokens: those are never allowed; masks cover the larger)."""
    n_vocab = max(vocab_size, tokenizer.backend.get_vocab_size(with_added_tokens=True))
    return _llguidance().LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=tokenizer.eos_id)


class Grammar:
    """One request's llguidance matcher: the mask of the next token, and the tokens sampled."""

    def __init__(self, ll_tokenizer: Any, grammar: str):
        llguidance = _llguidance()
        if not isinstance(grammar, str):
            raise ValueError(f"grammar must be an llguidance grammar string, got {type(grammar).__name__}")
        error = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer)
        if error:
            raise ValueError(f"invalid grammar: {error}")
        self.matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        self.words = mask_words(ll_tokenizer.vocab_size)
        if self.matcher.is_error():
            raise ValueError(f"invalid grammar: {self.matcher.get_error()}")

    def mask(self) -> np.ndarray:
        """The next token's bitmask `[words]` int32."""
        return np.frombuffer(self.matcher.compute_bitmask(), np.int32)[:self.words].copy()

    def advance(self, token: int) -> bool:
        """Feed a sampled token; True when the grammar is complete (nothing but EOS may follow) or broken."""
        self.matcher.consume_token(token)
        return self.matcher.is_stopped() or self.matcher.is_error()
