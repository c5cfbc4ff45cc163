"""DeepSeek-V3.2's sparse attention (`dsr1.core.sparse_attention`) against the official inference code
(transcribed: `tests/reference_dsa.py`) and transformers' token-by-token path, float32, on tiny
release-layout checkpoints whose sequences are 3-4x index_topk long."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsr1
from dsr1.core.model import forward_hidden
from dsr1.core.mtp import mtp_forward
from dsr1.generation.batch import generate

from . import reference, reference_dsa
from .harness import MIN_ROUTING_MARGIN, TOLERANCE, relative_error

LENGTHS = np.array([32, 21], np.int32)  # 4x and 2.6x index_topk (8)


@dataclasses.dataclass(frozen=True)
class V32Fixture:
    name: str
    folder: Path
    hf_config: dict
    tensors: dict
    tokens: np.ndarray  # [B, T] right-padded with 0
    official: list[np.ndarray]  # per row: the official transcription's logits [n, V]
    official_hidden: list[np.ndarray]  # per row: its residual stream entering the final norm [n, D]
    hf: list[np.ndarray]  # per row: HF's token-by-token logits [n, V]
    seed: int
    margins: reference_dsa.Margins


def _rows(vocab: int, seed: int) -> np.ndarray:
    tokens = np.random.default_rng(2000 + seed).integers(2, vocab, (len(LENGTHS), LENGTHS.max())).astype(np.int32)
    for row, n in enumerate(LENGTHS):
        tokens[row, n:] = 0
    return tokens


def build(root: Path, name: str) -> V32Fixture:
    """The first seed whose routing and index margins (on the official transcription) are safe."""
    cfg = reference_dsa.CONFIGS[name]
    for seed in range(20):
        tensors, tokens = reference_dsa.v32_tensors(cfg, seed), _rows(cfg["vocab_size"], seed)
        margins = reference_dsa.Margins()
        official = [reference_dsa.official_forward(tensors, cfg, tokens[r:r + 1, :n], margins)
                    for r, n in enumerate(LENGTHS)]
        if margins.routing < MIN_ROUTING_MARGIN or margins.index < reference_dsa.MIN_INDEX_MARGIN:
            continue
        folder = reference.write_checkpoint(root / f"{name}-{seed}", cfg, tensors)
        hf = reference_dsa.hf_model(folder)
        by_token = [reference_dsa.hf_token_by_token(hf, tokens[r, :n].tolist()) for r, n in enumerate(LENGTHS)]
        return V32Fixture(name, folder, cfg, tensors, tokens, [o[0][0] for o in official],
                          [o[1][0] for o in official], by_token, seed, margins)
    raise RuntimeError(f"{name}: no seed gave safe routing and index margins")


@pytest.fixture(scope="module", params=sorted(reference_dsa.CONFIGS))
def v32(request, tmp_path_factory) -> V32Fixture:
    return build(tmp_path_factory.mktemp("v32"), request.param)


@pytest.fixture(scope="module")
def v32_model(v32):
    return dsr1.load(v32.folder, dtype="float32", mtp=bool(v32.hf_config["num_nextn_predict_layers"]), progress=False)


@pytest.mark.slow
def test_forward_matches_official_and_hf_token_by_token(v32, v32_model):
    """Every position of both rows (past index_topk: the selection matters) within 1e-4 of both."""
    assert v32_model.cfg.sparse_attention and v32_model.cfg.index_topk == 8
    logits = np.asarray(v32_model.forward(v32.tokens, LENGTHS))
    vs_official = [relative_error(logits[r, :n], v32.official[r]) for r, n in enumerate(LENGTHS)]
    vs_hf = [relative_error(logits[r, :n], v32.hf[r]) for r, n in enumerate(LENGTHS)]
    print(f"\n[{v32.name}] forward: vs official {max(vs_official):.1e}, vs HF token by token {max(vs_hf):.1e} "
          f"(seed {v32.seed}, {v32.margins})")
    assert max(vs_official) <= TOLERANCE and max(vs_hf) <= TOLERANCE


PREFIX = np.array([12, 3], np.int32)  # past index_topk (prefill writes the indexer keys decode reads), and not


def _prefill_then_decode(model, tokens: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """Prefill `PREFIX` tokens of each row, then decode the rest: the logits at every position from
    `PREFIX - 1` on, by (row, position)."""
    logits, cache = model.prefill(tokens[:, :PREFIX.max()], PREFIX, max_len=int(LENGTHS.max()) + 1)
    assert cache.index_k.shape == (model.cfg.num_hidden_layers, 2, LENGTHS.max() + 1, model.cfg.index_head_dim)
    out = {(r, int(PREFIX[r]) - 1): np.asarray(logits)[r] for r in range(2)}
    for step in range(int((LENGTHS - PREFIX).max())):
        pos = PREFIX + step
        feed = np.where(pos < LENGTHS, tokens[np.arange(2), np.minimum(pos, LENGTHS.max() - 1)], 0)
        logits, cache = model.decode(cache, feed)
        out.update({(r, int(pos[r])): np.asarray(logits)[r] for r in np.flatnonzero(pos < LENGTHS)})
    return out


@pytest.mark.slow
def test_decode_equals_own_prefill_and_hf_token_by_token(v32, v32_model):
    """Each decoded position's logits are the forward's (dsr1's own prefill) and HF's token-by-token ones."""
    forward = np.asarray(v32_model.forward(v32.tokens, LENGTHS))
    decoded = _prefill_then_decode(v32_model, v32.tokens)
    own = max(relative_error(v, forward[key]) for key, v in decoded.items())
    hf = max(relative_error(v, v32.hf[key[0]][key[1]]) for key, v in decoded.items())
    print(f"\n[{v32.name}] decode: {len(decoded)} positions, vs own prefill {own:.1e}, vs HF {hf:.1e}")
    assert own <= TOLERANCE and hf <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_selecting_every_position_is_mla(kv_cache_dtype):
    """With index_topk above every query's positions the selection is all of them: sparse attention is
    MLA, in prefill and against a cache (T = 2 new tokens, rows of different lengths; an int8 latent
    cache's scales gathered with the selected latents)."""
    from dsr1.core import attention, sparse_attention
    from dsr1.core.cache import cache_from_prefill

    cfg = dataclasses.replace(dsr1.Config.preset("tiny-v3.2"), vocab_size=64, index_topk=64)
    p = jax.tree.map(lambda a: a[0], dsr1.init_random(cfg, seed=0, dtype="float32").params["dense_layers"])
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 18, cfg.hidden_size)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    out, (c_kv, k_pe, index_k) = sparse_attention.attend_prefill(p, x[:, :16], positions, cfg)
    assert relative_error(np.asarray(out), np.asarray(attention.attend_prefill(p, x[:, :16], positions, cfg)[0])) < 1e-5
    cache = cache_from_prefill(c_kv[None], k_pe[None], jnp.array([16, 11]), 24, kv_cache_dtype, index_k=index_k[None])
    new, at = x[:, 16:], jnp.array([[16, 17], [11, 12]])
    dense = attention.attend_cached(p, new, at, cache, jnp.int32(0), cfg)[0]
    assert relative_error(np.asarray(sparse_attention.attend_cached(p, new, at, cache, jnp.int32(0), cfg)[0]),
                          np.asarray(dense)) < 1e-5


@pytest.mark.slow
def test_greedy_equals_hf_token_by_token_greedy(v32, v32_model):
    """A 5-token prompt continued by 24 greedy tokens (29 positions: 3.6x index_topk); with the MTP
    layer's drafts (its own indexer, its own cache) the same tokens. On the MTP config only (the
    other adds compilation, not coverage: its forward and decode are checked above)."""
    if not v32.hf_config["num_nextn_predict_layers"]:
        pytest.skip("greedy runs on the MTP config")
    prompt = v32.tokens[0, :5].tolist()
    hf = reference_dsa.hf_greedy_token_by_token(reference_dsa.hf_model(v32.folder), prompt, 24)
    expected = hf[: hf.index(1)] if 1 in hf else hf  # EOS ends the row; it is not output
    got = generate(v32_model, [prompt], max_new_tokens=24).completions[0].tokens
    assert got == expected
    assert generate(v32_model, [prompt], max_new_tokens=24, draft_tokens=2).completions[0].tokens == expected


@pytest.mark.slow
def test_mtp_layer_matches_official(v32, v32_model):
    """The MTP layer, with its own indexer, over the longer row: dsr1's `mtp_forward` against the
    transcription's (the official code has no MTP layer; it is V3's module around a V3.2 block)."""
    if not v32.hf_config["num_nextn_predict_layers"]:
        pytest.skip("this config has no MTP layer")
    n = int(LENGTHS[0])
    tokens = v32.tokens[:1, :n]
    kw = v32_model.program_kwargs
    _, hidden = jax.jit(lambda p, t, m: forward_hidden(p, t, m, **kw))(v32_model.params, tokens, LENGTHS[:1])
    nxt = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)
    ours, _ = jax.jit(lambda p, h, t, m: mtp_forward(p, h, t, m, **kw))(v32_model.params, hidden, jnp.asarray(nxt),
                                                                       LENGTHS[:1])
    margins = reference_dsa.Margins()
    want = reference_dsa.official_mtp(v32.tensors, v32.hf_config, v32.official_hidden[0][None], nxt, margins)
    assert relative_error(np.asarray(hidden)[0], v32.official_hidden[0]) <= TOLERANCE
    if margins.routing < MIN_ROUTING_MARGIN or margins.index < reference_dsa.MIN_INDEX_MARGIN:
        pytest.skip(f"the MTP block's selections are near ties on this seed ({margins})")
    assert relative_error(np.asarray(ours)[0], want[0]) <= TOLERANCE


def test_release_layout_names_the_indexer_tensors():
    """The V3.2 release's (and transformers' `deepseek_v32`) indexer tensors, the MTP layer's too,
    FP8 where the release quantizes them."""
    from dsr1.weights.release import expected_tensors

    cfg = dsr1.Config.preset("deepseek-v3.2")
    expected = expected_tensors(cfg, mtp=True)
    for layer in (0, 60, 61):
        p = f"model.layers.{layer}.self_attn.indexer."
        assert expected[p + "wq_b.weight"].shape == (64 * 128, 1536) and expected[p + "wq_b.weight"].fp8_in_release
        assert expected[p + "wk.weight"].shape == (128, 7168) and expected[p + "wk.weight"].fp8_in_release
        assert expected[p + "weights_proj.weight"].shape == (64, 7168)
        assert not expected[p + "weights_proj.weight"].fp8_in_release
        assert expected[p + "k_norm.weight"].shape == expected[p + "k_norm.bias"].shape == (128,)
    assert not any(".indexer." in name for name in expected_tensors(dsr1.Config.preset("deepseek-r1"), mtp=True))


@pytest.mark.slow
def test_decode_step_reads_only_the_selected_latents():
    """The compiled decode step of a 1,000-position cache holds no layer's latents of every position,
    nor a block of them as MLA's decode reads (in any dtype): it scans the indexer keys, then gathers
    the 8 selected positions' latents."""
    from dsr1 import programs

    cfg = dataclasses.replace(dsr1.Config.preset("tiny-v3.2"), vocab_size=64, index_head_dim=24)  # shapes apart
    model = dsr1.init_random(cfg, seed=0, dtype="float32")
    cache = programs.random_cache(jax.random.key(0), cfg=cfg, mesh=model.mesh, batch=2, context=5, max_len=1000,
                                  dtype=jnp.float32, kv_cache_dtype=None)
    hlo = programs.decode.lower(model.params, cache, jnp.ones(2, jnp.int32), **model.program_kwargs).compile().as_text()
    r, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    assert f"f32[2,1000,{cfg.index_head_dim}]" in hlo or "f32[2,1,1000]" in hlo  # the keys are scanned
    whole = [f"{t}[2,{n},{d}]" for t in ("f32", "bf16", "u16") for d in (r, rope) for n in (1000, 256)]
    assert [s for s in whole if s in hlo] == []
    assert f"f32[2,1,8,{r}]" in hlo  # the selected latents


def test_fp8_release_indexer_loads_and_is_checked(tmp_path):
    """The release's FP8 indexer projections (`wq_b`, `wk`, 128x128 blocks with partial edges, the MTP
    layer's too) load as their dequantized values; `check_tensors` passes the folder and names a
    missing indexer tensor."""
    import json

    import torch
    from safetensors.torch import save_file

    from dsr1.weights.release import CheckpointIndex, check_tensors, dequantize_fp8, quantize_fp8

    cfg = reference_dsa.CONFIGS["v32_grouped_mtp"]
    tensors = reference_dsa.v32_tensors(cfg, 0)
    fp8 = [n for n in tensors if ".indexer.wq_b." in n or ".indexer.wk." in n]
    reference.write_checkpoint(tmp_path, cfg, {k: v for k, v in tensors.items() if k not in fp8})
    stored = {}
    for name in fp8:
        q, scale = quantize_fp8(tensors[name])
        stored[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
        stored[name + "_scale_inv"] = torch.from_numpy(scale)
    save_file(stored, str(tmp_path / "fp8.safetensors"))
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"].update({name: "fp8.safetensors" for name in stored})
    index_file.write_text(json.dumps(index))
    v32 = dsr1.Config.from_hf(tmp_path)
    assert check_tensors(CheckpointIndex.open(tmp_path), v32, mtp=True, strict=True) == []
    model = dsr1.load(tmp_path, dtype="float32", mtp=True, progress=False)
    name = "model.layers.3.self_attn.indexer.wq_b.weight"  # the MTP layer's
    q, scale = quantize_fp8(tensors[name])
    want = dequantize_fp8(q, scale).T.reshape(cfg["q_lora_rank"], cfg["index_n_heads"], cfg["index_head_dim"])
    np.testing.assert_array_equal(np.asarray(model.params["mtp"]["block"]["indexer"]["wq_b"][0]), want)
    opened, missing = CheckpointIndex.open(tmp_path), "model.layers.1.self_attn.indexer.k_norm.bias"
    without = dataclasses.replace(opened, tensors={k: v for k, v in opened.tensors.items() if k != missing})
    assert check_tensors(without, v32, mtp=True) == [f"missing tensor {missing!r} (expected shape [16])"]
