"""Parity with HF transformers DeepseekV3ForCausalLM (float32) on tiny release-layout checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

import dsr1

from .harness import DECODE_PREFIX, TOLERANCE, decode_logits, relative_error


@pytest.fixture
def model(fixture):
    return dsr1.load(fixture.folder, dtype="float32", progress=False)


def test_forward_matches_hf(fixture, model):
    logits = np.asarray(model.forward(fixture.tokens, fixture.lengths))
    errors = []
    for row, n in enumerate(fixture.lengths):
        errors.append(relative_error(logits[row, :n], fixture.reference[row, :n]))
        assert not logits[row, n:].any(), "logits past a row's length must be zero"
    print(f"\n[{fixture.name}] forward vs HF: max|dlogit|/max|logit| per row = "
          f"{', '.join(f'{e:.2e}' for e in errors)} (seed {fixture.seed}, routing margin {fixture.margin:.1e})")
    assert max(errors) <= TOLERANCE


@pytest.mark.slow
def test_unpadded_forward_matches_hf(fixture, model):
    """No lengths: every row is full length (the first row is unpadded)."""
    logits = np.asarray(model.forward(fixture.tokens[:1]))
    assert relative_error(logits[0], fixture.reference[0]) <= TOLERANCE


@pytest.mark.slow
def test_decode_matches_hf_position_by_position(fixture, model):
    decoded = decode_logits(model, fixture.tokens, fixture.lengths, DECODE_PREFIX)
    assert len(decoded) == int((fixture.lengths - DECODE_PREFIX + 1).sum())
    errors = {key: relative_error(v, fixture.reference[key]) for key, v in decoded.items()}
    worst = max(errors, key=errors.get)
    print(f"\n[{fixture.name}] absorbed decode vs HF full-sequence logits: {len(errors)} positions, "
          f"worst {errors[worst]:.2e} at (row, position) {worst}")
    assert errors[worst] <= TOLERANCE


def test_prefill_logits_are_last_token_logits(fixture, model):
    logits, cache = model.prefill(fixture.tokens, fixture.lengths, max_len=48)
    last = fixture.reference[np.arange(3), fixture.lengths - 1]
    assert relative_error(np.asarray(logits), last) <= TOLERANCE
    cfg = model.cfg
    assert cache.c_kv.shape == (cfg.num_hidden_layers, 3, 48, cfg.kv_lora_rank)
    assert cache.k_pe.shape == (cfg.num_hidden_layers, 3, 48, cfg.qk_rope_head_dim)
    assert np.asarray(cache.lengths).tolist() == fixture.lengths.tolist()


@pytest.mark.slow
def test_eos_inside_prompt_is_an_ordinary_token(grouped):
    """Row 1 holds EOS at positions 5 and 11; its logits after them match HF, which masks nothing."""
    model = dsr1.load(grouped.folder, dtype="float32", progress=False)
    logits = np.asarray(model.forward(grouped.tokens[1:2], grouped.lengths[1:2]))
    n = grouped.lengths[1]
    assert (grouped.tokens[1, :n] == 1).sum() == 2
    assert relative_error(logits[0, :n], grouped.reference[1, :n]) <= TOLERANCE
