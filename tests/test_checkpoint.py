"""Release-layout loading: FP8 block dequantization, and clear errors on broken checkpoints."""

from __future__ import annotations

import json
import logging
import math
import os

import ml_dtypes
import numpy as np
import pytest

import dsr1
from dsr1 import CheckpointError
from dsr1.weights.release import CheckpointIndex, dequantize_fp8, dequantize_fp8_into, expected_tensors

from .reference import hf_config, release_tensors, write_checkpoint

SMALL = hf_config({"num_hidden_layers": 2, "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
                   "num_experts_per_tok": 2})


@pytest.fixture
def tensors():
    return release_tensors(SMALL, seed=0)


def test_fp8_blocks_with_partial_edges():
    rng = np.random.default_rng(0)
    rows, cols = 300, 200  # 3 x 2 blocks, the last of each partial (44 rows, 72 columns)
    w = rng.standard_normal((rows, cols)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, (3, 2)).astype(np.float32)
    expected = np.empty((rows, cols), np.float32)
    for i in range(rows):
        for j in range(cols):
            expected[i, j] = float(w[i, j]) * scale[i // 128, j // 128]
    np.testing.assert_array_equal(dequantize_fp8(w, scale), expected)
    with pytest.raises(CheckpointError, match=r"w_scale_inv: shape \[2, 2\], expected \[3, 2\]"):
        dequantize_fp8(w, scale[:2], "w")


def test_fp8_region_into_a_transposed_view_is_the_transpose():
    """The loader writes the release's [out, in] blocks into dsr1's [in, out] through a transposed view,
    walking that view in memory order: the same bits as dequantizing then transposing, for any region."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 200)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, (3, 2)).astype(np.float32)
    whole = dequantize_fp8(w, scale).astype(ml_dtypes.bfloat16)
    for region in [(slice(None), slice(None)), (slice(100, 260), slice(60, 200)), (slice(0, 128), slice(0, 5))]:
        rows, cols = whole[region].shape
        out = np.zeros((cols, rows), ml_dtypes.bfloat16)
        dequantize_fp8_into(out.T, w, scale, region)
        np.testing.assert_array_equal(out.view(np.uint16), whole[region].T.view(np.uint16))


def test_fp8_tensor_is_dequantized_on_read(tmp_path, tensors):
    import torch
    from safetensors.torch import save_file

    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    w = tensors[name]
    scale = np.full((math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128)), 0.5, np.float32)
    fp8 = torch.from_numpy(w / 0.5).to(torch.float8_e4m3fn)
    write_checkpoint(tmp_path, SMALL, {k: v for k, v in tensors.items() if k != name})
    save_file({name: fp8, name + "_scale_inv": torch.from_numpy(scale)}, str(tmp_path / "fp8.safetensors"))
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"].update({name: "fp8.safetensors", name + "_scale_inv": "fp8.safetensors"})
    index_file.write_text(json.dumps(index))
    got = CheckpointIndex.open(tmp_path).read(name)
    np.testing.assert_array_equal(got, fp8.float().numpy() * 0.5)
    assert np.abs(got - w).max() <= 0.07 * np.abs(w).max()  # e4m3 keeps 3 mantissa bits
    dsr1.load(tmp_path, dtype="float32", progress=False)  # and the model loads with it


def test_expected_tensors_cover_the_checkpoint(tensors):
    assert set(expected_tensors(dsr1.Config.from_dict(SMALL))) == set(tensors)


def test_missing_tensor(tmp_path, tensors):
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    write_checkpoint(tmp_path, SMALL, {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(CheckpointError, match=rf"missing tensor '{name}' \(expected shape \[24, 48\]\)"):
        dsr1.load(tmp_path, progress=False)


def test_wrong_shape_names_file_tensor_and_both_shapes(tmp_path, tensors):
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name][:, :-1]
    write_checkpoint(tmp_path, SMALL, tensors, shards=1)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in model-00001-of-000001.safetensors has shape "
                                               r"\[48, 19\], config predicts \[48, 20\]"):
        dsr1.load(tmp_path, progress=False)


def test_config_disagreeing_with_tensors(tmp_path, tensors):
    write_checkpoint(tmp_path, {**SMALL, "hidden_size": 64}, tensors)
    match = r"(?s)does not match its config \(44 problems\):.*config predicts \[220, 64\]"
    with pytest.raises(CheckpointError, match=match):
        dsr1.load(tmp_path, progress=False)


def test_truncated_shard(tmp_path, tensors):
    write_checkpoint(tmp_path, SMALL, tensors)
    shard = tmp_path / "model-00002-of-000002.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=rf"{shard}: truncated: tensor '.+' ends at byte"):
        dsr1.load(tmp_path, progress=False)


def test_corrupt_header(tmp_path, tensors):
    write_checkpoint(tmp_path, SMALL, tensors)
    shard = tmp_path / "model-00001-of-000002.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\xfe{!"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard}: corrupt safetensors header"):
        dsr1.load(tmp_path, progress=False)
    shard.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match=rf"{shard}: truncated safetensors file"):
        dsr1.load(tmp_path, progress=False)


def test_missing_shard(tmp_path, tensors):
    write_checkpoint(tmp_path, SMALL, tensors)
    (tmp_path / "model-00002-of-000002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-000002.safetensors: missing checkpoint shard"):
        dsr1.load(tmp_path, progress=False)


def test_folder_without_index_or_shards(tmp_path, tensors):
    write_checkpoint(tmp_path, SMALL, tensors)
    (tmp_path / "model.safetensors.index.json").unlink()
    dsr1.load(tmp_path, progress=False)  # shards are found by their headers
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        dsr1.load(tmp_path, progress=False)


def test_tied_embeddings_read_the_embedding(tmp_path, tensors):
    del tensors["lm_head.weight"]
    write_checkpoint(tmp_path, {**SMALL, "tie_word_embeddings": True}, tensors)
    model = dsr1.load(tmp_path, dtype="float32", progress=False)
    np.testing.assert_array_equal(np.asarray(model.params["lm_head"]), tensors["model.embed_tokens.weight"].T)


def test_wrong_dtype_names_tensor_and_dtype(tmp_path, tensors):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    write_checkpoint(tmp_path, SMALL, {k: v for k, v in tensors.items() if k != name})
    import torch
    from safetensors.torch import save_file

    save_file({name: torch.zeros(tensors[name].shape, dtype=torch.int32)}, str(tmp_path / "int.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = "int.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in int.safetensors has dtype I32, expected one of"):
        dsr1.load(tmp_path, progress=False)


def test_load_reports_the_bytes_it_read(tmp_path, tensors, caplog):
    """`dsr1.load` logs a Throughput whose bytes are the tensors' bytes in the shards: every byte of
    the files but their headers, when the model reads every tensor."""
    write_checkpoint(tmp_path, SMALL, tensors)
    with caplog.at_level(logging.INFO, logger="dsr1.weights"):
        dsr1.load(tmp_path, progress=False)
    (read,) = [r.throughput for r in caplog.records if hasattr(r, "throughput")]
    shards = sorted(tmp_path.glob("*.safetensors"))
    headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in shards)
    assert read.bytes == sum(f.stat().st_size for f in shards) - headers
    assert read.bytes == sum(info.end - info.begin for info in CheckpointIndex.open(tmp_path).tensors.values())
    assert read.seconds > 0 and read.gbps == read.bytes / read.seconds / 1e9
    assert f"({read.gbps:.2f} GB/s)" in caplog.text


@pytest.mark.slow
def test_loaded_transposed_copies_are_the_transposes_and_the_view_is_complete(tmp_path):
    """On CPU the loader writes each layer's `[..., out, in]` copy as it reads it (FP8 experts
    dequantized by threads): every copy is the transpose of its bits, and the compute view is the one
    `dsr1.cpu.view` makes of the same weights (same leaves, same copies)."""
    import jax

    from dsr1 import cpu
    from dsr1.bench.loading import write_fp8_checkpoint
    from dsr1.cpu import Bf16Bits

    cfg = dsr1.Config.preset("tiny")
    write_fp8_checkpoint(tmp_path, cfg)
    model = dsr1.load(tmp_path, progress=False)
    copies = [w for w in jax.tree.leaves(model.params, is_leaf=lambda x: isinstance(x, Bf16Bits))
              if isinstance(w, Bf16Bits) and w.transposed is not None and w.kernel_spec is None]
    assert len(copies) >= 6  # the experts' and the dense MLP's gate, up and down at least
    for w in copies:
        np.testing.assert_array_equal(np.asarray(w.transposed), np.swapaxes(np.asarray(w.bits), -1, -2))
    plain = jax.tree.map(lambda w: jax.numpy.asarray(np.asarray(w)) if isinstance(w, Bf16Bits) else w, model.params,
                         is_leaf=lambda x: isinstance(x, Bf16Bits))
    again = cpu.view(plain, cfg, model.mesh)
    assert jax.tree.structure(again) == jax.tree.structure(model.params)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_region_of_each_weight_reads_only_its_box_and_equals_the_whole_weights_slice(tmp_path, tensors):
    """`read_region` of any weight (heads, experts, columns, rows of FP8 and bf16 tensors) is the
    same slice of the whole weight, and the index logs only the box of the tensor that holds it."""
    import torch
    from safetensors.torch import save_file

    from dsr1.weights.release import read_region, tensor_regions, unit_sources
    from dsr1.weights.safetensors_io import ReadLog

    cfg = dsr1.Config.from_dict(SMALL)
    fp8 = {n: w for n, w in tensors.items() if n.endswith("_proj.weight") and n.startswith("model.layers.")}
    stored = {n: torch.from_numpy(w) for n, w in tensors.items() if n not in fp8}
    for n, w in fp8.items():
        scale = np.full((math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128)), 0.5, np.float32)
        stored[n], stored[n + "_scale_inv"] = torch.from_numpy(w / 0.5).to(torch.float8_e4m3fn), torch.from_numpy(scale)
    save_file(stored, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    index = CheckpointIndex.open(tmp_path)
    for unit, layer in [("globals", None), ("dense_layers", 0), ("moe_layers", 1)]:
        for spec, src in unit_sources(cfg, unit):
            shape = spec.shape
            whole = read_region(index, src, shape, layer or 0, (), np.float32)
            regions = [tuple(slice(0, max(1, n // 2)) if i == axis else slice(None) for i, n in enumerate(shape))
                       for axis in range(len(shape))] + [tuple(slice(n // 2, n) for n in shape)]
            for region in regions:
                index.log.regions.clear()
                part = read_region(index, src, shape, layer or 0, region, np.float32)
                np.testing.assert_array_equal(part, whole[region], err_msg=f"{src.name} {region}")
                boxes = tensor_regions(src, shape, layer or 0, region)
                logged = ReadLog([r for r in index.log.regions if not r[0].name.endswith("_scale_inv")])
                if all(box is not None for _, box in boxes):  # exactly the boxes
                    assert logged.bytes() == ReadLog([(index.info(n), box) for n, box in boxes]).bytes()
                else:  # at most the tensors whole
                    assert logged.bytes() <= sum(index.info(n).end - index.info(n).begin for n in dict(boxes))
