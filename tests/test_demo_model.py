"""The shipped demo model (`dsr1.demo_checkpoint()`): its folder is a release-layout HF checkpoint that
transformers reads with the same logits, it writes English, and its MTP module drafts well enough
for speculative decoding. These tests guard the trained weights: an MTP regression fails them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

import dsr1

from .harness import relative_error
from .reference import reference_logits

HELD_OUT = Path(__file__).parent / "data" / "held_out_macbeth.txt"  # a held-out play: never trained on
MIN_ACCEPTANCE = 0.60  # the floor for the first draft token
COMMON_WORDS = {"the", "and", "i", "to", "of", "a", "you", "my", "that", "in", "is", "not", "me", "it", "with",
                "for", "be", "your", "his", "this", "he", "but", "have", "as", "thou", "so", "him", "will", "what",
                "her", "thy", "shall", "all", "no", "do", "by", "our", "lord", "sir", "good", "now", "come"}


@pytest.fixture(scope="module")
def folder() -> Path:
    return dsr1.demo_checkpoint()


@pytest.fixture(scope="module")
def model(folder):
    return dsr1.load(folder, dtype="float32", mtp=True, progress=False)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return dsr1.load_tokenizer(folder)


@pytest.fixture(scope="module")
def held_out(tokenizer) -> np.ndarray:
    return np.asarray(tokenizer.encode(HELD_OUT.read_text()), np.int32)


def test_folder_is_a_release_checkpoint_under_25_mb(folder):
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    weights = folder / "model.safetensors"
    assert weights.stat().st_size <= 25 * 2**20
    with safe_open(weights, "np") as f:
        names = set(f.keys())
        mtp = f"model.layers.{cfg['num_hidden_layers']}."
        assert {mtp + "enorm.weight", mtp + "hnorm.weight", mtp + "eh_proj.weight"} <= names
        assert f.get_tensor("model.embed_tokens.weight").dtype.name == "bfloat16"


@pytest.mark.slow
def test_hf_transformers_reads_the_folder_with_the_same_logits(folder, model, held_out):
    tokens = np.stack([held_out[:48], held_out[300:348]])
    ref, margin = reference_logits(folder, tokens)
    ours = np.asarray(model.forward(tokens))
    assert relative_error(ours, ref) <= 1e-4, f"routing margin {margin:.1e}"


@pytest.mark.slow
def test_first_draft_acceptance_on_held_out_text(model, held_out):
    from dsr1.bench.quality import teacher_forced_acceptance, windows

    acceptance = teacher_forced_acceptance(model, windows(held_out, 256)[:, :-1])  # the trained length
    assert acceptance >= MIN_ACCEPTANCE, f"the MTP module's first draft is accepted {acceptance:.1%} of the time"


@pytest.mark.slow
def test_greedy_with_drafts_equals_greedy_without(model, tokenizer, held_out):
    prompts = [tokenizer.decode(held_out[i:i + 40]) for i in (0, 500)]
    kwargs = dict(tokenizer=tokenizer, max_new_tokens=32, sampling=dsr1.Sampling(temperature=0.0))
    plain = dsr1.generate(model, prompts, **kwargs)
    for k in (1, 2):
        drafted = dsr1.generate(model, prompts, draft_tokens=k, **kwargs)
        assert [c.tokens for c in drafted.completions] == [c.tokens for c in plain.completions], k
        if k == 1:
            assert drafted.draft_acceptance >= MIN_ACCEPTANCE


def english_share(text: str) -> float:
    """The share of a text's words that are common English (and Shakespearean) words."""
    words = re.findall(r"[a-z']+", text.lower())
    return sum(w in COMMON_WORDS for w in words) / max(len(words), 1)


@pytest.mark.slow
def test_the_cli_writes_english_by_default(capsys):
    from dsr1.__main__ import main

    assert main(["generate", "--prompt", "Good morrow, my lord. What news from the court?", "--chat",
                 "--max-new-tokens", "48", "--no-warmup"]) == 0
    out = capsys.readouterr()
    assert "demo_model" in out.err and "RANDOM" not in out.err
    assert english_share(out.out) >= 0.3, out.out
