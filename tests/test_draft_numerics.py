"""Drafts never change greedy output on the shipped demo model in the batch-invariant mode, in bfloat16
(its default dtype), with a bf16 and an int8 latent cache, in `dsr1.generate(..., batch_invariant=True)`
and in `Engine(..., batch_invariant=True)`; and in float32 in the default mode.

The default verification runs the k+1 positions in one pass with k+1 times the rows per product, whose
bfloat16 roundings differ from decoding's enough to flip a greedy token on this model within a dozen
steps (docs/serving.md, "Draft numerics"); the batch-invariant mode runs each position in the decode
step's own shapes (`dsr1.core.model.verify_per_position`, `dsr1.programs.draft_step._verify_by_steps`),
so its logits are bit for bit decoding's. CI runs `dsr1.generate` on 4 held-out prompts x 64 tokens
and the engine on 6 prompts queued on 4 slots; the extended tier 16 x 128 in both.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dsr1
from dsr1.serving import Engine

HELD_OUT = Path(__file__).parent / "data" / "held_out_macbeth.txt"  # a held-out play: never trained on
# Where a multi-token verification step diverged from decoding (the 3rd and 12th greedy token, alone in a batch).
DIVERGED = ["Was this the face that launch'd a thousand ships,", "To be, or not to be,"]
GREEDY = dsr1.Sampling(temperature=0.0)
ENGINE_SHAPES = dict(max_seqs=4, page_size=16, num_pages=160, prefill_chunk=64, prefill_rows=2, decode_steps=2)


@pytest.fixture(scope="module")
def tokenizer():
    return dsr1.load_tokenizer(dsr1.demo_checkpoint())


@pytest.fixture(scope="module")
def bf16_model():
    model = dsr1.load(dsr1.demo_checkpoint(), mtp=True, progress=False)
    assert str(model.params["embed"].dtype) == "bfloat16"
    return model


@pytest.fixture(scope="module")
def int8_cache_model():
    return dsr1.load(dsr1.demo_checkpoint(), mtp=True, progress=False, kv_cache_dtype="int8")


def held_out_prompts(tokenizer, n: int, length: int = 40) -> list[list[int]]:
    """`n` prompts of `length` tokens from spread-out places in the held-out play."""
    tokens = tokenizer.encode(HELD_OUT.read_text())
    starts = np.linspace(0, len(tokens) - length - 1, n).astype(int)
    return [list(tokens[s:s + length]) for s in starts]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def assert_generate_unchanged(model, prompts, max_new_tokens: int, drafts: tuple[int, ...], batch_invariant=True,
                              **kwargs) -> None:
    options = dict(max_new_tokens=max_new_tokens, sampling=GREEDY, batch_invariant=batch_invariant, **kwargs)
    plain = [c.tokens for c in dsr1.generate(model, prompts, **options).completions]
    assert all(len(t) > 0 for t in plain)
    for k in drafts:
        result = dsr1.generate(model, prompts, draft_tokens=k, **options)
        drafted = [c.tokens for c in result.completions]
        where = [first_difference(a, b) for a, b in zip(plain, drafted)]
        assert drafted == plain, f"draft_tokens={k}: first differing token per prompt {where}"
        assert result.draft_acceptance > 0.3  # the drafts were real (the demo's MTP module drafts well)


def engine_tokens(model, prompts, max_new_tokens: int, **options) -> list[list[int]]:
    """Greedy tokens of `prompts` submitted at once to a `batch_invariant` engine of 4 slots (the rest queue)."""
    engine = Engine(model, **ENGINE_SHAPES, batch_invariant=True, **options)
    requests = [engine.submit(p, max_new_tokens=max_new_tokens, sampling=GREEDY) for p in prompts]
    while engine.has_work:
        engine.step()
    engine.check()
    return [r.tokens for r in requests]


def assert_engine_unchanged(model, prompts, max_new_tokens: int, drafts: tuple[int, ...]) -> None:
    plain = engine_tokens(model, prompts, max_new_tokens)
    assert all(len(t) > 0 for t in plain)
    for k in drafts:
        drafted = engine_tokens(model, prompts, max_new_tokens, draft_tokens=k)
        where = [first_difference(a, b) for a, b in zip(plain, drafted)]
        assert drafted == plain, f"engine draft_tokens={k}: first differing token per prompt {where}"


@pytest.mark.slow
def test_the_prompts_that_diverged_alone_in_a_batch(bf16_model, tokenizer):
    for prompt in DIVERGED:
        assert_generate_unchanged(bf16_model, [prompt], 96, (1,), tokenizer=tokenizer)


@pytest.mark.slow
def test_generate_bf16(bf16_model, tokenizer):
    assert_generate_unchanged(bf16_model, held_out_prompts(tokenizer, 4), 64, (1, 2))


@pytest.mark.slow
def test_generate_float32_in_the_default_mode(tokenizer):
    """The one-pass verification (k+1 times the rows per product) rounds differently from decoding;
    in float32 those roundings do not flip the demo's greedy tokens."""
    model = dsr1.load(dsr1.demo_checkpoint(), mtp=True, progress=False, dtype="float32")
    assert_generate_unchanged(model, held_out_prompts(tokenizer, 4), 64, (1, 3), batch_invariant=False)


@pytest.mark.slow
def test_generate_int8_cache(int8_cache_model, tokenizer):
    assert_generate_unchanged(int8_cache_model, held_out_prompts(tokenizer, 4), 64, (2,))


@pytest.mark.slow
def test_engine_bf16_queued(bf16_model, tokenizer):
    """The batch-invariant engine verifies by decode-shaped steps, and a prompt's last token is its first decode
    input with or without drafts; `batch_invariant` keeps every call's shape and routes the experts
    through XLA's loop, so requests joining and finishing at other times with drafts do not change
    how a row's products are summed (docs/serving.md, "Draft numerics"). 6 prompts on 4 slots: two
    wait for a slot."""
    assert_engine_unchanged(bf16_model, held_out_prompts(tokenizer, 6), 48, (1, 2))


@pytest.mark.extended
@pytest.mark.parametrize("cache", ["bf16", "int8"])
def test_16_prompts_x_128_tokens(bf16_model, int8_cache_model, tokenizer, cache):
    model = bf16_model if cache == "bf16" else int8_cache_model
    prompts = held_out_prompts(tokenizer, 16)
    assert_generate_unchanged(model, prompts, 128, (1, 2))
    assert_engine_unchanged(model, prompts, 128, (1, 2))
