"""`python -m dsr1.bench quality` end to end on a tiny random checkpoint with an MTP layer, and its
measures against direct computations."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

import dsr1
from dsr1.bench.cli import main
from dsr1.bench.quality import (
    bits_per_byte,
    draft_agreement,
    held_out_tokens,
    teacher_forced_acceptance,
    token_bytes_table,
    windows,
)
from dsr1.core.config import Config

pytestmark = pytest.mark.slow  # its module fixtures start servers or engines: out of the quick tier

HELD_OUT = Path(__file__).parent / "data" / "held_out_macbeth.txt"
VOCAB = 300


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A release-layout folder: random float32 master weights of a tiny DeepSeek-V3 with its MTP layer
    (written as bf16 by `dsr1.train.export`) and a 300-token BPE trained on the held-out text."""
    from dsr1.train.bpe import save_tokenizer, train_bpe
    from dsr1.train.export import export
    from dsr1.train.step import init_master

    root = tmp_path_factory.mktemp("quality")
    save_tokenizer(train_bpe([HELD_OUT.read_text()], VOCAB), root / "tokenizer")
    cfg = dataclasses.replace(
        Config.preset("demo"), vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2)
    params = jax.jit(init_master, static_argnums=(0, 1))(cfg, 0)  # one compile, not one per leaf
    return export(params, cfg, root / "tokenizer", root / "model")


def test_quality_command_reports_every_variant_and_k(checkpoint, tmp_path, capsys):
    out, png = tmp_path / "quality.json", tmp_path / "q.png"
    assert main(["quality", "--model", str(checkpoint), "--text", str(HELD_OUT), "--max-bytes", "2000",
                 "--seq-len", "32", "--decode-windows", "1", "--prompts", "2", "--prompt-len", "8", "--new-tokens",
                 "6", "--draft-tokens", "1", "--repeats", "1", "--dtype", "float32", "--plot", str(png),
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["bits_per_byte"]] == [
        "float32 weights", "bf16 weights", "int8 weights", "FP8 128x128 round trip (read in float32)",
        "bf16 weights, bf16 cache", "bf16 weights, int8 cache"]
    assert [r["path"] for r in result["bits_per_byte"]][-2:] == ["decode, 1 window"] * 2
    assert all(r["bpb"] > 0 and r["bytes"] > 0 for r in result["bits_per_byte"])
    assert [r["draft_tokens"] for r in result["speculative"]] == [0, 1]
    assert all(r["same_tokens"] for r in result["speculative"])  # greedy drafts never change the output
    assert all(0 <= r["draft_acceptance"] <= 1 for r in result["speculative"][1:])
    assert result["speculative"][1]["first_draft_acceptance"] == result["speculative"][1]["draft_acceptance"]
    assert 0 <= result["teacher_forced_acceptance"] <= 1 and png.stat().st_size > 0
    stdout = capsys.readouterr().out
    assert "| variant | path | bits per byte | bytes scored |" in stdout and "| draft tokens k |" in stdout


def test_drafts_command_alternates_every_k_in_both_modes(checkpoint, tmp_path, capsys):
    out = tmp_path / "drafts.json"
    assert main(["drafts", "--model", str(checkpoint), "--text", str(HELD_OUT), "--max-bytes", "2000", "--prompts",
                 "1", "--prompt-len", "8", "--new-tokens", "6", "--draft-tokens", "1", "--rounds", "2", "--dtype",
                 "bfloat16", "--batch-invariant", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch_invariant"], r["draft_tokens"]) for r in rows] == [(False, 0), (False, 1), (True, 0), (True, 1)]
    assert rows[0]["speedup"] == 1.0 and all(r["decode_tok_s"] > 0 for r in rows)
    assert rows[3]["same_tokens"]  # the batch-invariant mode: bf16 greedy drafts never change the output
    assert 0 <= rows[1]["draft_acceptance"] <= 1 and rows[0]["draft_acceptance"] is None
    assert "| weights | mode | draft tokens k |" in capsys.readouterr().out


def test_float32_bits_per_byte_equals_a_direct_computation(checkpoint):
    model = dsr1.load(checkpoint, dtype="float32", progress=False)
    tok = dsr1.load_tokenizer(checkpoint)
    ids = held_out_tokens(tok, HELD_OUT, 1000)
    assert ids[0] == tok.bos_id
    rows, nbytes = windows(ids, 32)[:2], token_bytes_table(tok)
    logits = np.asarray(model.forward(rows[:, :-1]), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    targets = rows[:, 1:]
    text = np.array([[0 if t == tok.bos_id else len(tok.decode([t]).encode()) for t in row] for row in targets])
    bits = -np.take_along_axis(logp, targets[..., None], -1)[..., 0] / np.log(2)
    got, scored = bits_per_byte(model, rows, nbytes)
    assert scored == text.sum() and got == pytest.approx(bits[text > 0].sum() / text.sum(), rel=1e-6)


def _brute_force_agreement(model: dsr1.Model, tokens: np.ndarray, positions: list[int]) -> list[bool]:
    """For each t in `positions`, whether the MTP module's argmax at t equals the model's at t+1,
    computed with `Model.forward`, `forward_hidden` and `mtp_forward` directly on a copy of `tokens`
    whose tokens after t+1 are replaced (they must not matter: both are causal)."""
    from dsr1.core.model import forward_hidden
    from dsr1.core.mtp import mtp_forward

    seen = np.stack([np.concatenate([tokens[:t + 2], tokens[::-1][:len(tokens) - t - 2]]) for t in positions])
    lengths = np.full(len(positions), tokens.shape[0])
    kwargs = model.program_kwargs
    main_logits = np.asarray(model.forward(seen))
    _, hidden = jax.jit(forward_hidden, static_argnames=tuple(kwargs))(model.params, seen, lengths, **kwargs)
    following = np.concatenate([seen[:, 1:], seen[:, -1:]], axis=1)
    draft, _ = jax.jit(mtp_forward, static_argnames=tuple(kwargs))(model.params, hidden, following, lengths, **kwargs)
    draft = np.asarray(draft)
    return [bool(draft[i, t].argmax() == main_logits[i, t + 1].argmax()) for i, t in enumerate(positions)]


def test_teacher_forced_acceptance_matches_a_brute_force_check():
    folder = dsr1.demo_checkpoint()  # trained: its agreements are not all False as a random model's are
    model = dsr1.load(folder, dtype="float32", mtp=True, progress=False)
    tokens = np.asarray(dsr1.load_tokenizer(folder).encode(HELD_OUT.read_text(), add_bos=True), np.int32)[:24]
    agree = draft_agreement(model, tokens)
    assert agree.shape == (1, 23) and teacher_forced_acceptance(model, tokens) == agree.mean()
    assert 0 < agree.mean() < 1
    assert agree[0, [0, 5, 22]].tolist() == _brute_force_agreement(model, tokens, [0, 5, 22])
    with pytest.raises(ValueError, match="mtp=True"):
        teacher_forced_acceptance(dataclasses.replace(model, params={k: v for k, v in model.params.items()
                                                                     if k != "mtp"}), tokens)
