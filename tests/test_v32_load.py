"""DeepSeek-V3.2's release layout (FP8 weights in 128x128 blocks with partial edges, UE8M0 scales, the
indexer tensors, the MTP layer with its own indexer) and the folders transformers' `save_pretrained`
writes for `deepseek_v3` and `deepseek_v32` (per-expert, sharded; fused experts with
`save_original_format=False`; no MTP layer), loaded by `dsr1.load` and `python -m dsr1 convert`,
and checked by its `--check` against a release index."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest

import dsr1
from dsr1.weights import convert as dsr1_convert
from dsr1.weights import store
from dsr1.weights.release import FP8_BLOCK, CheckpointIndex, per_expert_view
from dsr1.weights.safetensors_io import TensorInfo, read_header, write_safetensors

from . import reference, reference_dsa
from .harness import MIN_ROUTING_MARGIN, TOLERANCE, relative_error

SHARED = Path(__file__).parents[2] / "shared" / "reference" / "deepseek-r1"
# Dims that are not multiples of 128: every FP8 weight, the indexer's `wq_b [192, 136]` and
# `wk [32, 160]` too, has partial edge blocks.
V32_FP8 = {**reference.hf_config({"hidden_size": 160, "intermediate_size": 200, "moe_intermediate_size": 136,
                                  "q_lora_rank": 136, "kv_lora_rank": 136, "num_attention_heads": 2,
                                  "qk_nope_head_dim": 48, "qk_rope_head_dim": 16, "v_head_dim": 40,
                                  "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
                                  "num_hidden_layers": 2, "num_nextn_predict_layers": 1}),
           **{k: reference_dsa.V32[k] for k in ("model_type", "architectures", "index_topk")},
           "index_n_heads": 6, "index_head_dim": 32}
V32_FP8.pop("rope_interleave")
QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
LENGTHS = (24, 17)  # 3x and 2x index_topk


@dataclasses.dataclass(frozen=True)
class Saved:
    """One tiny model as its release folder and as transformers saved it."""

    release: Path  # the release layout (FP8 with `weight_scale_inv`, for V3.2; float32 for V3)
    transformers: Path  # `save_pretrained`: per-expert tensors in several shards with an index
    fused: Path  # `save_pretrained(save_original_format=False)`: fused experts, one file
    tokens: list[list[int]]
    hf: list[np.ndarray]  # per row: transformers' logits [n, V] (V3.2: its token-by-token path)


def _rows(vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(3000 + seed)
    return [rng.integers(2, vocab, n).tolist() for n in LENGTHS]


def _save(model, root: Path) -> tuple[Path, Path]:
    model.save_pretrained(root / "transformers", max_shard_size="2MB")
    model.save_pretrained(root / "fused", save_original_format=False)
    return root / "transformers", root / "fused"


def _v32_safe_seed(root: Path) -> tuple[int, Path, dict[str, np.ndarray]]:
    """The first seed whose routing and index margins, on the weights the FP8 release stands for, are safe."""
    for seed in range(20):
        release = root / f"release-{seed}"
        dequantized = reference.write_release(release, {**V32_FP8, "quantization_config": QUANTIZATION},
                                              reference_dsa.v32_tensors(V32_FP8, seed), ue8m0=True)
        margins = reference_dsa.Margins()
        for row in _rows(V32_FP8["vocab_size"], seed):
            reference_dsa.official_forward(dequantized, V32_FP8, np.array([row]), margins)
        if margins.routing >= MIN_ROUTING_MARGIN and margins.index >= reference_dsa.MIN_INDEX_MARGIN:
            return seed, release, dequantized
    raise RuntimeError("no seed gave safe routing and index margins")


@pytest.fixture(scope="module")
def v32(tmp_path_factory) -> Saved:
    """An FP8 V3.2 release folder, and the model transformers builds from the weights it stands for, saved."""
    root = tmp_path_factory.mktemp("v32load")
    with _one_torch_thread():
        seed, release, dequantized = _v32_safe_seed(root)
        hf = reference_dsa.hf_model(reference.write_checkpoint(root / "dequantized", V32_FP8, dequantized))
        tokens = _rows(V32_FP8["vocab_size"], seed)
        by_token = [reference_dsa.hf_token_by_token(hf, row) for row in tokens]
    return Saved(release, *_save(hf, root), tokens, by_token)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch on one thread: the references' matrices are tiny, and more threads on a machine shared
    with other tests only contend."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> Saved:
    """A float32 V3 release folder and transformers' save of it (its logits from one full-sequence forward)."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    root = tmp_path_factory.mktemp("v3load")
    cfg = reference.hf_config(reference.CONFIGS["grouped_qlora"])
    with _one_torch_thread():
        for seed in range(20):
            release = reference.write_checkpoint(root / f"release-{seed}", cfg, reference.release_tensors(cfg, seed))
            tokens = _rows(cfg["vocab_size"], seed)
            padded = np.array([row + [0] * (max(LENGTHS) - len(row)) for row in tokens])
            logits, margin = reference.reference_logits(release, padded)
            if margin >= MIN_ROUTING_MARGIN:
                break
        else:
            raise RuntimeError(f"no seed gave a routing margin >= {MIN_ROUTING_MARGIN}")
        hf = DeepseekV3ForCausalLM.from_pretrained(str(release), dtype=torch.float32).eval()
    return Saved(release, *_save(hf, root), tokens, [logits[r, :len(row)] for r, row in enumerate(tokens)])


def _params_equal(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _max_error(model, saved: Saved) -> float:
    """dsr1's logits at every position of both rows against transformers', relative to max|logit|."""
    lengths = np.array([len(row) for row in saved.tokens], np.int32)
    tokens = np.array([row + [0] * (lengths.max() - len(row)) for row in saved.tokens], np.int32)
    logits = np.asarray(model.forward(tokens, lengths))
    return max(relative_error(logits[r, :n], saved.hf[r]) for r, n in enumerate(lengths))


def _load(folder: Path, **kw):
    return dsr1.load(folder, dtype="float32", progress=False, **kw)


@pytest.mark.slow
def test_v32_fp8_release_loads_as_the_model_transformers_saves(v32):
    """The FP8 release (every matmul but the MTP projection, heads and `weights_proj`, scales UE8M0,
    the MTP layer's indexer too) loads as the weights it stands for: bit for bit those of
    transformers' save of the dequantized model; its logits are transformers' token-by-token ones."""
    index = CheckpointIndex.open(v32.release)
    fp8 = {n for n, info in index.tensors.items() if info.dtype == "F8_E4M3"}
    assert {f"model.layers.{n}.self_attn.indexer.{w}.weight" for n in range(3) for w in ("wq_b", "wk")} <= fp8
    assert dsr1_convert.check(v32.release) == []
    release = _load(v32.release, mtp=True)
    saved = _load(v32.transformers)
    assert _params_equal({k: v for k, v in release.params.items() if k != "mtp"}, saved.params)
    wq_b = index.read("model.layers.2.self_attn.indexer.wq_b.weight")  # the MTP layer's, dequantized
    np.testing.assert_array_equal(np.asarray(release.params["mtp"]["block"]["indexer"]["wq_b"][0]),
                                  wq_b.T.reshape(release.params["mtp"]["block"]["indexer"]["wq_b"].shape[1:]))
    error = _max_error(saved, v32)
    print(f"\nV3.2 transformers save vs its token-by-token logits: {error:.1e}")
    assert error <= TOLERANCE


def test_v32_fused_experts_load_as_the_per_expert_save(v32):
    """`save_original_format=False` (fused `gate_up_proj`/`down_proj` per layer, one file) loads as the
    per-expert save does, bit for bit."""
    assert "model.layers.1.mlp.experts.gate_up_proj" in read_header(v32.fused / "model.safetensors")
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in CheckpointIndex.open(v32.fused).tensors
    shards = set(json.loads((v32.transformers / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 1  # the per-expert save is sharded, read through its index
    assert _params_equal(_load(v32.fused).params, _load(v32.transformers).params)


def test_a_transformers_save_has_no_mtp_layer(v32, tmp_path, capsys):
    """transformers drops the MTP layer but keeps `num_nextn_predict_layers`: `mtp=True` says so in one
    line; `--check` passes (noting it) and `convert` leaves the MTP module out."""
    with pytest.raises(dsr1.CheckpointError, match=r"\(1 problems\):\n  no MTP layer: config.json has "
                                                   r"num_nextn_predict_layers=1 but no tensor is named "
                                                   r"'model\.layers\.2\.\*'.*mtp=False\)$"):
        _load(v32.transformers, mtp=True)
    assert dsr1_convert.main(["--check", "--hf", str(v32.transformers)]) == 0
    out = capsys.readouterr().out
    assert "no MTP layer model.layers.2.*" in out and out.strip().endswith(": OK")
    converted = dsr1_convert.convert(v32.fused, tmp_path / "out", dtype="float32", progress=False)
    assert not store.read_manifest(converted)["mtp"]
    assert _params_equal(_load(converted).params, _load(v32.transformers).params)


@pytest.mark.parametrize("quant", [None, pytest.param("int8", marks=pytest.mark.extended)])
def test_v32_release_converts_with_its_mtp_indexer(v32, tmp_path, quant):
    """`convert` of the FP8 release (MTP layer and its indexer included) loads as the release does."""
    out = dsr1_convert.convert(v32.release, tmp_path / "out", quant=quant, dtype="float32", progress=False)
    assert store.read_manifest(out)["mtp"]
    direct = _load(v32.release, quant=quant, mtp=True)
    converted = _load(out, mtp=True)
    assert "indexer" in converted.params["mtp"]["block"] and _params_equal(direct.params, converted.params)


@pytest.mark.extended
def test_v32_release_assembled_on_accelerators_equals_the_host_path(v32, monkeypatch):
    """Where the devices are accelerators (here CPU devices taken for them) the layers, their indexers
    and the MTP layer's too, are assembled on the devices and the FP8 experts dequantized there: the
    same weights, bit for bit, as the host path."""
    from dsr1.weights import loading

    host = _load(v32.release, mtp=True)
    monkeypatch.setattr(loading.LoadPlan, "accelerators", property(lambda plan: True))
    assert _params_equal(host.params, _load(v32.release, mtp=True).params)


@pytest.mark.slow
def test_v3_transformers_saves_load_and_match_its_logits(v3):
    """Both of transformers' layouts of a `deepseek_v3` model load; the logits are its own."""
    saved = _load(v3.transformers)
    assert _params_equal(saved.params, _load(v3.release).params)
    assert _params_equal(_load(v3.fused).params, saved.params)
    error = _max_error(saved, v3)
    print(f"\nV3 transformers save vs its logits: {error:.1e}")
    assert error <= TOLERANCE


def _check(index_file: Path, content: dict, capsys) -> tuple[int, str]:
    """`convert --check --hf index_file` of `content` written there: its exit status and output."""
    index_file.write_text(json.dumps(content))
    status = dsr1_convert.main(["--check", "--hf", str(index_file)])
    return status, capsys.readouterr().out


def test_check_of_a_v32_index_names_a_missing_indexer_tensor(v32, tmp_path, capsys):
    """`convert --check` of the tiny release's index, without its shards: a listing of shapes and
    dtypes, and the release's own `model.safetensors.index.json` (names only), each passes, and with
    one indexer tensor left out fails naming it."""
    (tmp_path / "config.json").write_text((v32.release / "config.json").read_text())
    listing = {name: {"shape": list(info.shape), "dtype": info.dtype, "file": info.file.name}
               for name, info in CheckpointIndex.open(v32.release).tensors.items()}
    assert _check(tmp_path / "index.json", listing, capsys) == (0, f"{tmp_path / 'index.json'}: OK\n")
    scale = "model.layers.2.self_attn.indexer.wk.weight_scale_inv"  # the MTP layer's
    status, out = _check(tmp_path / "index.json", {k: v for k, v in listing.items() if k != scale}, capsys)
    assert status == 1 and f"has no {scale}" in out

    index = json.loads((v32.release / "model.safetensors.index.json").read_text())
    status, out = _check(tmp_path / "model.safetensors.index.json", index, capsys)
    assert status == 0 and "names only" in out and out.strip().endswith(": OK")
    weight = "model.layers.1.self_attn.indexer.wq_b.weight"
    del index["weight_map"][weight]
    status, out = _check(tmp_path / "model.safetensors.index.json", index, capsys)
    assert status == 1 and f"missing tensor {weight!r} (expected shape [192, 136])" in out


def _v32_index() -> tuple[dict, dict]:
    """R1's release index (shapes and dtypes) with V3.2's indexer added to every layer, the MTP
    layer's too, as V3.2's release stores it; and V3.2's config."""
    with gzip.open(SHARED / "model.safetensors.index-with-shapes.json.gz", "rt") as f:
        index = json.load(f)
    config = json.loads((SHARED / "config.json").read_text())
    config.update(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], index_n_heads=64,
                  index_head_dim=128, index_topk=2048)
    for layer in range(config["num_hidden_layers"] + 1):
        p = f"model.layers.{layer}.self_attn.indexer."
        file = index[f"model.layers.{layer}.input_layernorm.weight"]["file"]
        for name, dtype, shape in (("wq_b.weight", "F8_E4M3", [8192, 1536]),
                                   ("wq_b.weight_scale_inv", "F32", [64, 12]),
                                   ("wk.weight", "F8_E4M3", [128, 7168]), ("wk.weight_scale_inv", "F32", [1, 56]),
                                   ("k_norm.weight", "F32", [128]), ("k_norm.bias", "F32", [128]),
                                   ("weights_proj.weight", "BF16", [64, 7168])):
            index[p + name] = {"shape": shape, "dtype": dtype, "file": file}
    return index, config


@pytest.mark.skipif(not SHARED.exists(), reason="../shared reference not present")
@pytest.mark.extended
def test_check_on_a_v32_release_index(tmp_path, capsys):
    """`convert --check` of V3.2's release index (R1's with the indexer tensors) passes; each indexer
    tensor removed is named, with the shape the config predicts."""
    index, config = _v32_index()
    assert {n[: -len("_scale_inv")] for n in index if n.endswith("_scale_inv")} == {
        n for n in index if reference.is_fp8_in_release(n)}, "the fixture's FP8 rule must be the release's"
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "index.json").write_text(json.dumps(index))
    assert dsr1_convert.main(["--check", "--hf", str(tmp_path / "index.json")]) == 0
    assert capsys.readouterr().out.strip().endswith(": OK")
    del index["model.layers.30.self_attn.indexer.weights_proj.weight"]
    del index["model.layers.61.self_attn.indexer.k_norm.bias"]
    (tmp_path / "index.json").write_text(json.dumps(index))
    assert dsr1_convert.check(tmp_path / "index.json") == [
        "missing tensor 'model.layers.30.self_attn.indexer.weights_proj.weight' (expected shape [64, 7168])",
        "missing tensor 'model.layers.61.self_attn.indexer.k_norm.bias' (expected shape [128])"]


def _fused_fp8(folder: Path, f: int, d: int = 160, experts: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """One layer's routed experts as transformers' FP8 model holds them, fused, in `folder`: returns
    `gate_up_proj [E, 2f, d]` and `down_proj [E, d, f]` as the weights they stand for."""
    rng = np.random.default_rng(0)
    tensors, values = {}, []
    for name, shape in (("gate_up_proj", (experts, 2 * f, d)), ("down_proj", (experts, d, f))):
        blocks = [reference.fp8_blocks(w) for w in rng.standard_normal(shape).astype(np.float32)]
        tensors[f"model.layers.1.mlp.experts.{name}"] = np.stack([q for q, _, _ in blocks])
        tensors[f"model.layers.1.mlp.experts.{name}_scale_inv"] = np.stack([scale for _, scale, _ in blocks])
        values.append(np.stack([w for _, _, w in blocks]))
    write_safetensors(folder / "model.safetensors", {k: (v.shape, v.dtype) for k, v in tensors.items()}, tensors.get)
    return values[0], values[1]


def test_fused_fp8_experts_read_per_expert(tmp_path):
    """transformers' fused FP8 experts (`save_original_format=False`) read as the release's per-expert
    tensors and block scales; where gate and up would share a 128-row scale block, or a fused tensor's
    rows do not split, the error names the tensor."""
    (tmp_path / "ok").mkdir()
    gate_up, down = _fused_fp8(tmp_path / "ok", f=128)
    index = CheckpointIndex.open(tmp_path / "ok")
    assert index.tensors["model.layers.1.mlp.experts.1.up_proj.weight_scale_inv"].shape == (1, 2)
    np.testing.assert_array_equal(index.read("model.layers.1.mlp.experts.1.up_proj.weight"), gate_up[1, 128:])
    np.testing.assert_array_equal(index.read("model.layers.1.mlp.experts.0.gate_proj.weight"), gate_up[0, :128])
    np.testing.assert_array_equal(index.read("model.layers.1.mlp.experts.1.down_proj.weight"), down[1])
    (tmp_path / "shared").mkdir()
    _fused_fp8(tmp_path / "shared", f=136)
    with pytest.raises(dsr1.CheckpointError, match=r"'model\.layers\.1\.mlp\.experts\.gate_up_proj_scale_inv' "
                                                   r"cannot be split per expert: its weight has 136 rows per part"):
        CheckpointIndex.open(tmp_path / "shared")
    bad = TensorInfo("model.layers.1.mlp.experts.gate_up_proj", tmp_path / "m.safetensors", "F32", (8, 5, 4), 0, 640)
    with pytest.raises(dsr1.CheckpointError, match=r"m\.safetensors: fused expert tensor 'model\.layers\.1\.mlp\."
                                                   r"experts\.gate_up_proj' has shape \[8, 5, 4\]"):
        per_expert_view({bad.name: bad})
