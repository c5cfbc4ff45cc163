"""A request's sampling settings on the host, and the arrays they become for the device.

`Sampling` is one request's settings, validated when made. `batch_sampling` stacks one per row
into the `SamplingArrays` a jitted loop carries (`host_sampling_arrays`: the same as numpy, for
hosts that send them on), and `host_token_rules` the sparse `TokenRuleRows` that a program expands
into dense rules once per request. What runs per token on the device (`sample` and its steps) is
`dsr1.programs.sampling`; `find_stop_string` finds stop strings in streamed text.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..programs.sampling import BAD_WORD_TOKENS, KEY_IMPL, SamplingArrays, TokenRuleRows

__all__ = ["LOGIT_BIAS_LIMIT", "Sampling", "batch_sampling", "find_stop_string", "host_sampling_arrays",
           "host_token_rules"]

# Seeds are split into two 32-bit words on the host: `jax.random.key(seed)` silently keeps only
# the low 32 bits when x64 is off, which would make seeds 2**32 apart collide.
_SEED_LIMIT = 2**64
_PENALTY_LIMIT = 2.0  # OpenAI's documented range for presence/frequency penalties
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values


def _check_real(name: str, value: object) -> float:
    """`value` as a float, or a ValueError naming the field if it is not a finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"Sampling.{name} must be a finite number, got {value!r}")
    return float(value)


def _check_int(name: str, value: object) -> int:
    """`value` as an int, or a ValueError naming the field if it is not an integer."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"Sampling.{name} must be an integer, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """One request's sampling settings (validated on construction, clear ValueError naming the field and value).

    A single int for `stop_token_ids` or a single str for `stop_strings` is accepted and stored
    as a one-element tuple; lists are stored as tuples (the dataclass stays hashable).
    """

    temperature: float = 0.0  # 0 means greedy (argmax after penalties); must be >= 0
    top_k: int = 0  # 0 = off; else >= 1 (ties with the k-th largest logit are kept)
    top_p: float = 1.0  # in (0, 1]; 1 = off
    min_p: float = 0.0  # in [0, 1); 0 = off
    repetition_penalty: float = 1.0  # > 0; HF/CTRL style on prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, on output tokens, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI style, times the output count, in [-2, 2]
    seed: int | None = None  # None -> a seed drawn at random on the host by `batch_sampling`
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    max_new_tokens: int = 256  # >= 1
    min_tokens: int = 0  # stop tokens (EOS included) cannot be sampled before this many tokens
    ignore_eos: bool = False  # the model's EOS neither stops the output nor is masked
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits, clipped to [-100, 100]
    allowed_token_ids: tuple[int, ...] = ()  # only these may be sampled (empty: all)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # a sequence's last token is banned after the others
    include_stop_str_in_output: bool = False  # keep a matched stop string at the end of the text
    skip_special_tokens: bool = True  # special tokens (BOS, EOS, markers) are left out of the text

    def __post_init__(self) -> None:
        self._validate_numbers()
        self._normalize_stops()
        self._normalize_token_rules()

    def _validate_numbers(self) -> None:
        """Range checks for every numeric field, each error naming the field and the value."""
        checks = {
            "temperature": (_check_real, lambda v: v >= 0, ">= 0 (0 means greedy)"),
            "top_k": (_check_int, lambda v: v >= 0, ">= 0 (0 means off)"),
            "top_p": (_check_real, lambda v: 0 < v <= 1, "in (0, 1]"),
            "min_p": (_check_real, lambda v: 0 <= v < 1, "in [0, 1)"),
            "repetition_penalty": (_check_real, lambda v: v > 0, "> 0 (1 means off)"),
            "presence_penalty": (_check_real, lambda v: abs(v) <= _PENALTY_LIMIT, "in [-2, 2]"),
            "frequency_penalty": (_check_real, lambda v: abs(v) <= _PENALTY_LIMIT, "in [-2, 2]"),
            "max_new_tokens": (_check_int, lambda v: v >= 1, ">= 1"),
        }
        for name, (convert, ok, wanted) in checks.items():
            value = getattr(self, name)
            if not ok(convert(name, value)):
                raise ValueError(f"Sampling.{name} must be {wanted}, got {value!r}")
        if self.seed is not None and not 0 <= _check_int("seed", self.seed) < _SEED_LIMIT:
            raise ValueError(f"Sampling.seed must be None or in [0, 2**64), got {self.seed!r}")

    def _normalize_stops(self) -> None:
        """Store stop ids/strings as tuples; reject negative ids and empty strings."""
        ids = self.stop_token_ids
        ids = (ids,) if isinstance(ids, numbers.Integral) and not isinstance(ids, bool) else tuple(ids)
        for token in ids:
            if _check_int("stop_token_ids", token) < 0:
                raise ValueError(f"Sampling.stop_token_ids must be token ids >= 0, got {token!r}")
        strings = self.stop_strings
        strings = (strings,) if isinstance(strings, str) else tuple(strings)
        for text in strings:
            if not isinstance(text, str) or not text:
                raise ValueError(f"Sampling.stop_strings must be non-empty strings, got {text!r}")
        # Frozen dataclass: object.__setattr__ is the sanctioned way to normalize in __post_init__.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        object.__setattr__(self, "stop_strings", strings)

    def _normalize_token_rules(self) -> None:
        """Store `logit_bias` (a dict or pairs), `allowed_token_ids` and `bad_words_ids` as sorted,
        hashable tuples; reject bad ids, biases, flags, and a `min_tokens` above `max_new_tokens`."""
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Sampling.{name} must be True or False, got {getattr(self, name)!r}")
        if _check_int("min_tokens", self.min_tokens) < 0 or self.min_tokens > self.max_new_tokens:
            raise ValueError(f"Sampling.min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                             f"got {self.min_tokens!r}")
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = [(token, value) for token, value in pairs]
        except (TypeError, ValueError):
            raise ValueError(f"Sampling.logit_bias must map token ids to numbers, got {bias!r}") from None
        checked = {}
        for token, value in pairs:
            if _check_int("logit_bias", token) < 0:
                raise ValueError(f"Sampling.logit_bias: token ids must be >= 0, got {token!r}")
            checked[int(token)] = min(max(_check_real("logit_bias", value), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
        allowed = tuple(int(t) for t in self.allowed_token_ids)
        for token in self.allowed_token_ids:
            if _check_int("allowed_token_ids", token) < 0:
                raise ValueError(f"Sampling.allowed_token_ids must be token ids >= 0, got {token!r}")
        words = []
        for word in self.bad_words_ids:
            word = (word,) if isinstance(word, numbers.Integral) else tuple(word)
            if not word or len(word) > BAD_WORD_TOKENS:
                raise ValueError(f"Sampling.bad_words_ids: each sequence must have 1 to {BAD_WORD_TOKENS} tokens, "
                                 f"got {word!r}")
            for token in word:
                if _check_int("bad_words_ids", token) < 0:
                    raise ValueError(f"Sampling.bad_words_ids must hold token ids >= 0, got {token!r}")
            words.append(tuple(int(t) for t in word))
        object.__setattr__(self, "logit_bias", tuple(sorted(checked.items())))
        object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(allowed))))
        object.__setattr__(self, "bad_words_ids", tuple(dict.fromkeys(words)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0




def _seed_words(seeds: Sequence[int]) -> np.ndarray:
    """Threefry key data `[B, 2]` uint32 from 64-bit seeds; as keys, equal to `jax.random.key(seed)` for
    seeds < 2**32."""
    return np.array([[seed >> 32, seed & 0xFFFFFFFF] for seed in seeds], dtype=np.uint32).reshape(-1, 2)


def _stop_token_matrix(settings: Sequence[Sampling], stop_width: int | None) -> np.ndarray:
    """[B, S] int32 stop ids padded with -1, with S >= 1 so the array is never empty."""
    longest = max(len(s.stop_token_ids) for s in settings)
    if stop_width is None:
        width = max(1, longest)
    elif isinstance(stop_width, bool) or not isinstance(stop_width, numbers.Integral) or stop_width < 1:
        raise ValueError(f"batch_sampling: stop_width must be an integer >= 1 or None, got {stop_width!r}")
    elif longest > stop_width:
        raise ValueError(f"batch_sampling: a row has {longest} stop_token_ids, more than stop_width={stop_width}")
    else:
        width = int(stop_width)
    table = np.full((len(settings), width), -1, dtype=np.int32)
    for row, s in enumerate(settings):
        table[row, : len(s.stop_token_ids)] = s.stop_token_ids
    return table


def host_sampling_arrays(settings: Sequence[Sampling], stop_width: int | None = None) -> SamplingArrays:
    """`batch_sampling` as numpy arrays, with each row's key as its uint32 key data `[B, 2]` (no device
    work: for hosts that prepare many rows, or send them to other processes)."""
    settings = list(settings)
    if not settings:
        raise ValueError("batch_sampling needs at least one Sampling, got an empty sequence")
    for row, s in enumerate(settings):
        if not isinstance(s, Sampling):
            raise ValueError(f"batch_sampling: row {row} is {type(s).__name__}, expected Sampling")

    def column(name: str, dtype) -> np.ndarray:
        return np.array([getattr(s, name) for s in settings], dtype=dtype)

    seeds = [secrets.randbits(64) if s.seed is None else s.seed for s in settings]
    return SamplingArrays(
        temperature=column("temperature", np.float32),
        top_k=column("top_k", np.int32),
        top_p=column("top_p", np.float32),
        min_p=column("min_p", np.float32),
        repetition_penalty=column("repetition_penalty", np.float32),
        presence_penalty=column("presence_penalty", np.float32),
        frequency_penalty=column("frequency_penalty", np.float32),
        keys=_seed_words(seeds),
        stop_tokens=_stop_token_matrix(settings, stop_width),
        max_new_tokens=column("max_new_tokens", np.int32),
    )


def batch_sampling(settings: Sequence[Sampling], stop_width: int | None = None) -> SamplingArrays:
    """Stack one `Sampling` per row into device arrays; rows with seed None get a random seed.

    `stop_width` fixes the number of columns of `stop_tokens` (None: the longest row's count,
    at least 1). Array shapes are part of a jitted function's cache key, so a loop that serves
    batches with varying stop-id counts should pass a fixed width to avoid recompiling.
    """
    host = host_sampling_arrays(settings, stop_width)
    arrays = jax.tree.map(jnp.asarray, dataclasses.replace(host, keys=np.zeros(0)))
    return dataclasses.replace(arrays, keys=jax.random.wrap_key_data(host.keys, impl=KEY_IMPL))


def _bucket(n: int) -> int:
    """Widths of the rule arrays: powers of two (at least 1), so few shapes ever compile."""
    return 1 << max(n - 1, 0).bit_length()



def host_token_rules(settings: Sequence[Sampling]) -> TokenRuleRows:
    """`TokenRuleRows` of `settings` (each with its stop ids final: the EOS among them unless ignored)."""
    history = BAD_WORD_TOKENS - 1
    singles = [[w[0] for w in s.bad_words_ids if len(w) == 1] for s in settings]
    longer = [[w for w in s.bad_words_ids if len(w) > 1] for s in settings]
    width = _bucket(max(len(s.logit_bias) + len(b) for s, b in zip(settings, singles)))
    allowed_width = _bucket(max(len(s.allowed_token_ids) for s in settings))
    stop_width = _bucket(max(len(s.stop_token_ids) for s in settings))
    words = _bucket(max(len(w) for w in longer))
    rows = len(settings)
    out = TokenRuleRows(np.full((rows, width), -1, np.int32), np.zeros((rows, width), np.float32),
                        np.full((rows, allowed_width), -1, np.int32), np.full((rows, stop_width), -1, np.int32),
                        np.array([s.min_tokens for s in settings], np.int32),
                        np.full((rows, words, history), -1, np.int32), np.full((rows, words), -1, np.int32))
    for row, (s, single, multi) in enumerate(zip(settings, singles, longer)):
        pairs = [*s.logit_bias, *((token, -np.inf) for token in single)]
        out.bias_ids[row, :len(pairs)] = [token for token, _ in pairs]
        out.bias_values[row, :len(pairs)] = [value for _, value in pairs]
        out.allowed[row, :len(s.allowed_token_ids)] = s.allowed_token_ids
        out.stops[row, :len(s.stop_token_ids)] = s.stop_token_ids
        for i, word in enumerate(multi):
            out.bad_prefix[row, i, history - len(word) + 1:] = word[:-1]
            out.bad_last[row, i] = word[-1]
    return out



def find_stop_string(text: str, stop_strings: Sequence[str], start: int = 0) -> int | None:
    """Host-side helper for streaming: index where the earliest stop string begins in text, or None.

    The search starts at `start`, but a stop string may straddle `start` (it began in text
    already seen). The generator cuts the output exactly there: the stop string itself is not
    part of the output.

    `start` is how much of `text` was already searched, so a stop string lying wholly before
    `start` is not reported again; one that begins before `start` but ends after it is.
    """
    best = None
    for stop in stop_strings:
        if not stop:
            raise ValueError("find_stop_string: stop strings must be non-empty")
        found = text.find(stop, max(0, start - len(stop) + 1))
        if found >= 0 and (best is None or found < best):
            best = found
    return best
