"""`python -m dsr1.bench load`: the release-layout FP8 writer and the read-vs-load measurement."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import dsr1
from dsr1.bench.cli import main
from dsr1.bench.loading import checkpoint_files, read_bandwidth, write_fp8_checkpoint
from dsr1.weights import convert as dsr1_convert
from dsr1.weights import store as dsr1_store
from dsr1.weights.release import dequantize_fp8, quantize_fp8


def test_quantize_fp8_inverts_dequantize():
    w = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)  # partial edge blocks
    q, scale = quantize_fp8(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and scale.shape == (3, 2)
    np.testing.assert_allclose(dequantize_fp8(q, scale), w, rtol=0.07, atol=0.07 * np.abs(w).max() / 64)


def test_fp8_checkpoint_is_a_release_layout(tmp_path):
    cfg = dsr1.Config.preset("tiny")
    folder = write_fp8_checkpoint(tmp_path / "ckpt", cfg)
    assert dsr1_convert.check(folder) == []
    files = checkpoint_files(folder)
    read = read_bandwidth(files)
    assert read.bytes == sum(f.stat().st_size for f in files) and read.gbps > 0


@pytest.mark.slow
def test_load_command_on_the_tiny_preset(tmp_path, capsys):
    out = tmp_path / "load.json"
    assert main(["load", "--preset", "tiny", "--repeats", "1", "--keep", str(tmp_path / "ckpt"),
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    files = checkpoint_files(tmp_path / "ckpt")
    assert row["read_gb"] * 1e9 == sum(f.stat().st_size for f in files)
    assert 0 < row["load_gb"] < row["read_gb"] and row["load_gbs"] > 0 and row["ratio"] > 0
    assert "load / read" in capsys.readouterr().out


@pytest.mark.slow
def test_load_command_also_measures_the_converted_checkpoint(tmp_path, capsys):
    out = tmp_path / "load.json"
    keep = tmp_path / "ckpt"
    assert main(["load", "--preset", "tiny", "--repeats", "1", "--keep", str(keep), "--converted",
                 "--json", str(out)]) == 0
    converted = json.loads(out.read_text())["converted"]
    assert converted["folder"] == str(tmp_path / "ckpt-converted") and dsr1_store.is_converted(converted["folder"])
    (row,) = converted["rows"]
    files = checkpoint_files(tmp_path / "ckpt-converted")
    assert converted["files"] == len(files) and row["read_gb"] * 1e9 == sum(f.stat().st_size for f in files)
    assert row["load_gbs"] > 0 and converted["best_ratio"] == row["ratio"]
    assert "converted (" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--converted converts the random checkpoint"):
        main(["load", "--model", str(keep), "--converted"])
