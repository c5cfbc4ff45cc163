"""FP8 release checkpoints, `python -m dsr1 convert` (safetensors per unit, resumable, atomic) and `--check`."""

from __future__ import annotations

import errno
import gzip
import json
import logging
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

import dsr1
from dsr1.core.sharding import DEFAULT_RULES
from dsr1.cpu import Bf16Bits
from dsr1.weights import convert as dsr1_convert
from dsr1.weights import store
from dsr1.weights.loading import load_params
from dsr1.weights.release import CheckpointIndex
from dsr1.weights.safetensors_io import read_header, read_tensor, write_safetensors
from dsr1.weights.throughput import path_bytes

from .harness import (
    DECODE_PREFIX,
    TOLERANCE,
    decode_logits,
    free_port,
    prompt_batch,
    relative_error,
    start_processes,
    subprocess_env,
    wait_processes,
)
from .reference import (
    hf_config,
    is_fp8_in_release,
    reference_logits,
    release_tensors,
    write_checkpoint,
    write_release,
)

SHARED_INDEX = (Path(__file__).parents[2] / "shared" / "reference" / "deepseek-r1"
                / "model.safetensors.index-with-shapes.json.gz")
# Dims that are not multiples of 128, so every FP8 weight has partial edge blocks.
FP8_CONFIG = hf_config({"hidden_size": 160, "intermediate_size": 200, "moe_intermediate_size": 136,
                        "q_lora_rank": 136, "kv_lora_rank": 136, "num_attention_heads": 2, "qk_nope_head_dim": 48,
                        "qk_rope_head_dim": 16, "v_head_dim": 40, "n_routed_experts": 8, "n_group": 2,
                        "topk_group": 1, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                        "num_nextn_predict_layers": 1,
                        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                                "quant_method": "fp8", "weight_block_size": [128, 128]}})


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """An FP8 release-layout folder (with MTP layer) and a float32 folder of its dequantized weights."""
    root = tmp_path_factory.mktemp("fp8")
    folder = root / "release"
    dequantized = write_release(folder, FP8_CONFIG, release_tensors(FP8_CONFIG, seed=3, mtp=True))
    plain_config = {k: v for k, v in FP8_CONFIG.items() if k != "quantization_config"}
    reference = write_checkpoint(root / "dequantized", plain_config, dequantized)
    tokens, lengths = prompt_batch(FP8_CONFIG["vocab_size"], seed=3)
    return folder, reference, tokens, lengths, reference_logits(reference, tokens)[0]


@pytest.mark.slow
def test_fp8_release_matches_hf_on_dequantized_weights(fp8):
    folder, _, tokens, lengths, ref = fp8
    index = CheckpointIndex.open(folder)
    assert sum(info.dtype == "F8_E4M3" for info in index.tensors.values()) > 20
    assert dsr1_convert.check(folder) == [], "the FP8 fixture must be a complete release layout"
    model = dsr1.load(folder, dtype="float32", progress=False)
    logits = np.asarray(model.forward(tokens, lengths))
    errors = [relative_error(logits[r, :n], ref[r, :n]) for r, n in enumerate(lengths)]
    decoded = decode_logits(model, tokens, lengths, DECODE_PREFIX)
    dec_err = max(relative_error(v, ref[k]) for k, v in decoded.items())
    print(f"\nFP8 release (dims 160/136/200, partial 128-blocks) vs HF on dequantized weights: forward "
          f"{max(errors):.2e}, decode {dec_err:.2e}")
    assert max(errors) <= TOLERANCE and dec_err <= TOLERANCE


@pytest.mark.slow
def test_ue8m0_release_loads_as_its_dequantized_weights(tmp_path):
    """V3.1's release (`scale_fmt: "ue8m0"`: power-of-two scales stored as float32) loads with the same
    dequantization: the loaded weights equal the fp8 values times their scales, bit for bit."""
    config = {**FP8_CONFIG, "num_hidden_layers": 1, "num_nextn_predict_layers": 0,
              "quantization_config": {**FP8_CONFIG["quantization_config"], "scale_fmt": "ue8m0"}}
    dequantized = write_release(tmp_path / "release", config, release_tensors(config, seed=4), ue8m0=True)
    plain = write_checkpoint(tmp_path / "plain", {k: v for k, v in config.items() if k != "quantization_config"},
                             dequantized)
    loaded = dsr1.load(tmp_path / "release", dtype="float32", progress=False).params
    assert _leaves_equal(loaded, dsr1.load(plain, dtype="float32", progress=False).params)


def _leaves_equal(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("quant,dtype", [(None, "float32"), (None, "bfloat16"), ("int8", "bfloat16")])
@pytest.mark.slow
def test_converted_equals_direct_load(fp8, tmp_path, quant, dtype):
    folder, _, tokens, lengths, _ = fp8
    out = dsr1_convert.convert(folder, tmp_path / "out", quant=quant, dtype=dtype, progress=False)
    manifest = store.read_manifest(out)
    assert manifest["quant"] == quant and manifest["mtp"] and (out / "mtp" / "0002.safetensors").is_file()
    direct = dsr1.load(folder, dtype=dtype, quant=quant, mtp=True, progress=False)
    restored = dsr1.load(out, dtype=dtype, mtp=True, progress=False)
    assert restored.quant == quant
    assert _leaves_equal(direct.params, restored.params), "restored weights differ from a direct load"
    np.testing.assert_array_equal(np.asarray(restored.forward(tokens, lengths)),
                                  np.asarray(direct.forward(tokens, lengths)))
    if quant == "int8":
        bf16 = dsr1.load(folder, progress=False)
        print(f"\nweight bytes (main model): bf16 {bf16.weight_bytes():,}, int8 "
              f"{dsr1.load(out, progress=False).weight_bytes():,}")


def test_mtp_subtree_holds_layer_num_hidden_layers(fp8):
    folder, *_ = fp8
    model = dsr1.load(folder, dtype="float32", mtp=True, progress=False)
    index = CheckpointIndex.open(folder)
    mtp = model.params["mtp"]
    np.testing.assert_array_equal(np.asarray(mtp["eh_proj"][0]), index.read("model.layers.2.eh_proj.weight").T)
    np.testing.assert_array_equal(np.asarray(mtp["block"]["moe"]["router_bias"][0]),
                                  index.read("model.layers.2.mlp.gate.e_score_correction_bias"))
    assert "mtp" not in dsr1.load(folder, progress=False).params


class Interrupt(Exception):
    pass


def _failing_save(monkeypatch, after: int, error: BaseException) -> list[Path]:
    saved: list[Path] = []
    original = store.save_unit

    def save(file, tree):
        if len(saved) == after:
            raise error
        original(file, tree)
        saved.append(file)

    monkeypatch.setattr(store, "save_unit", save)
    return saved


def test_interrupted_run_resumes_after_last_finished_layer(fp8, tmp_path, monkeypatch, capsys):
    folder, *_ = fp8
    out = tmp_path / "out"
    saved = _failing_save(monkeypatch, after=2, error=Interrupt())
    with pytest.raises(Interrupt):
        dsr1_convert.convert(folder, out, progress=False)
    assert [p.stem for p in saved] == ["globals", "0000"] and not out.exists()
    with pytest.raises((dsr1.CheckpointError, dsr1.ConfigError)):  # the partial folder is not a checkpoint
        dsr1.load(out.with_name("out.partial"), progress=False)
    monkeypatch.undo()
    saved = _failing_save(monkeypatch, after=-1, error=Interrupt())
    dsr1_convert.convert(folder, out, progress=True)
    assert [p.stem for p in saved] == ["0001", "0002"], "finished units must not be converted again"
    assert "converting release" in capsys.readouterr().err  # the progress bar
    assert not out.with_name("out.partial").exists()
    fresh = dsr1_convert.convert(folder, tmp_path / "fresh", progress=False)
    assert _leaves_equal(dsr1.load(out, mtp=True, progress=False).params,
                         dsr1.load(fresh, mtp=True, progress=False).params)


@pytest.mark.slow
def test_full_disk_leaves_previous_output_untouched(fp8, tmp_path, monkeypatch, capsys):
    folder, _, tokens, lengths, _ = fp8
    out = dsr1_convert.convert(folder, tmp_path / "out", progress=False)
    before = np.asarray(dsr1.load(out, progress=False).forward(tokens, lengths))
    _failing_save(monkeypatch, after=1, error=OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(dsr1_convert.ConversionError, match=r"layers/0000.*model\.layers\.0\..*No space left"):
        dsr1_convert.convert(folder, out, quant="int8", progress=False)
    assert dsr1_convert.main(["--hf", str(folder), "--out", str(out), "--quant", "int8"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert store.read_manifest(out)["quant"] is None
    np.testing.assert_array_equal(np.asarray(dsr1.load(out, progress=False).forward(tokens, lengths)), before)


def _as_numpy(w) -> np.ndarray:
    return np.asarray(w.bits).view(ml_dtypes.bfloat16) if isinstance(w, Bf16Bits) else np.asarray(w)


def test_a_bfloat16_conversion_loads_as_float32(fp8, tmp_path):
    folder, *_ = fp8
    out = dsr1_convert.convert(folder, tmp_path / "out", progress=False)
    as_bf16 = dsr1.load(out, progress=False).params
    as_f32 = dsr1.load(out, dtype="float32", progress=False).params
    gate = as_f32["moe_layers"]["moe"]["gate"]
    assert gate.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(gate), _as_numpy(as_bf16["moe_layers"]["moe"]["gate"]).astype(np.float32))


@pytest.mark.parametrize("converted", [False, True], ids=["release", "converted"])
@pytest.mark.slow
def test_cpu_loads_compile_no_program_unless_quantizing(fp8, tmp_path, caplog, converted):
    """On CPU devices a stack is filled in place on the host and handed over as the device buffer:
    loading compiles nothing. Making int8 on load runs the device path (zeros, then one quantizing
    update per layer), which compiles once: a second load of the same shapes compiles nothing."""
    folder, *_ = fp8
    path = dsr1_convert.convert(folder, tmp_path / "out", progress=False) if converted else folder
    cfg, mesh = dsr1.Config.from_hf(folder), dsr1.make_mesh()

    def compilations(quant: str | None) -> list[str]:
        caplog.clear()
        with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
            load_params(path, cfg, mesh, DEFAULT_RULES, "bfloat16", quant=quant, mtp=True, progress=False)
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]

    assert compilations(None) == []
    jax.clear_caches()
    assert compilations("int8")
    assert compilations("int8") == []


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", None), ("bfloat16", "int8")])
@pytest.mark.slow
def test_fp8_experts_dequantized_on_the_devices_equal_the_host_path(fp8, monkeypatch, dtype, quant):
    """On accelerators (here CPU devices taken for them) the release's FP8 routed experts go to the
    devices as stored, codes and block scales (`Fp8Experts`, partial edge blocks included), and are
    dequantized there (then quantized, for int8 on load): the same weights, bit for bit, as the host
    path."""
    from dsr1.weights import loading, release

    folder, *_ = fp8
    host = dsr1.load(folder, dtype=dtype, quant=quant, mtp=True, progress=False)
    stored = []
    dequantize = release.dequantize_experts
    monkeypatch.setattr(loading, "dequantize_experts", lambda w: stored.append(w.codes.shape) or dequantize(w))
    monkeypatch.setattr(loading.LoadPlan, "accelerators", property(lambda plan: True))
    jax.clear_caches()  # the stack programs are traced again, with the recording dequantize
    devices = dsr1.load(folder, dtype=dtype, quant=quant, mtp=True, progress=False)
    cfg = dsr1.Config.from_hf(folder)
    n, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert set(stored) == {(n, f, d), (n, d, f)}  # gate/up `[E, out=f, in=d]`, down `[E, d, f]`
    assert _leaves_equal(host.params, devices.params)
    stored.clear()
    again = dsr1.load(folder, dtype=dtype, quant=quant, mtp=True, progress=False)
    assert stored == []  # the second load runs the programs of the first: nothing traced or compiled
    assert _leaves_equal(host.params, again.params)


@pytest.mark.slow
def test_fp8_experts_dequantized_on_eight_devices(fp8, tmp_path):
    """The same on 8 fake devices (expert 4 x tensor 2): each device's codes are the transpose of its
    part of the weight, its scales the whole layer's; the logits equal a single-device load's."""
    folder, _, tokens, lengths, _ = fp8
    inputs, out = tmp_path / "inputs.npz", tmp_path / "out.npz"
    np.savez(inputs, tokens=tokens, lengths=lengths, prefix=DECODE_PREFIX)
    proc = subprocess.run([sys.executable, "-m", "tests.mesh_worker", "--folder", str(folder), "--inputs", str(inputs),
                           "--out", str(out), "--expert=4", "--tensor=2", "--assemble-on-devices"],
                          env=subprocess_env(8), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = dict(np.load(out))
    assert list(result["mesh_shape"]) == [4, 2] and int(result["devices"]) == 8
    want = np.asarray(dsr1.load(folder, dtype="float32", progress=False).forward(tokens, lengths))
    valid = np.arange(want.shape[1])[None, :] < np.asarray(lengths)[:, None]
    assert relative_error(result["forward"][valid], want[valid]) <= 1e-5


def test_loading_names_the_unit_and_tensor_that_do_not_match(fp8, tmp_path):
    folder, *_ = fp8
    out = dsr1_convert.convert(folder, tmp_path / "out", progress=False)
    dense, moe = out / store.unit_file("dense_layers", 0), out / store.unit_file("moe_layers", 1)
    header, original = read_header(dense), dense.read_bytes()
    n = header["attn_norm"].shape[0]
    write_safetensors(dense, {k: ((n + 1,) if k == "attn_norm" else v.shape, read_tensor(v).dtype)
                              for k, v in header.items()},
                      lambda k: np.ones(n + 1, ml_dtypes.bfloat16) if k == "attn_norm" else read_tensor(header[k]))
    with pytest.raises(dsr1.CheckpointError, match=rf"layers/0000\.safetensors: tensor 'attn_norm' is BF16\[{n + 1}\], "
                                                   rf"the model needs bfloat16\[{n}\]"):
        dsr1.load(out, progress=False)
    dense.write_bytes(moe.read_bytes())  # a MoE layer where the dense layer belongs
    with pytest.raises(dsr1.CheckpointError, match=r"layers/0000\.safetensors: tensor 'mlp\.\w+' is missing"):
        dsr1.load(out, progress=False)
    dense.write_bytes(original)
    moe.unlink()
    with pytest.raises(dsr1.CheckpointError, match=r"layers/0001\.safetensors: missing unit of a converted checkpoint "
                                                   r"\(1 of 4 missing\)"):
        dsr1.load(out, progress=False)


def test_a_checkpoint_of_an_older_format_asks_for_a_new_conversion(fp8, tmp_path):
    folder, *_ = fp8
    out = dsr1_convert.convert(folder, tmp_path / "out", progress=False)
    store.write_json(out / store.MANIFEST, {**store.read_manifest(out), "format": "dsr1-orbax"})
    with pytest.raises(dsr1.CheckpointError, match=r"dsr1\.json: not a dsr1-safetensors v1 manifest \(found "
                                                   r"'dsr1-orbax' v1\); convert the release checkpoint again"):
        dsr1.load(out, progress=False)
    assert dsr1_convert.main(["--hf", str(folder), "--out", str(out)]) == 0  # replaced by a fresh conversion
    assert store.read_manifest(out)["format"] == store.FORMAT


def test_refuses_to_replace_a_foreign_folder(fp8, tmp_path):
    folder, *_ = fp8
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(dsr1_convert.ConversionError, match="exists and is not a dsr1 checkpoint"):
        dsr1_convert.convert(folder, tmp_path / "mine", progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.skipif(not SHARED_INDEX.exists(), reason="../shared reference not present")
@pytest.mark.slow
def test_check_on_the_real_r1_index(tmp_path, capsys):
    assert dsr1_convert.main(["--check", "--hf", str(SHARED_INDEX)]) == 0
    assert capsys.readouterr().out.strip().endswith(": OK")
    with gzip.open(SHARED_INDEX, "rt") as f:
        index = json.load(f)
    assert len(index) == 91991
    assert {n[: -len("_scale_inv")] for n in index if n.endswith("_scale_inv")} == {
        n for n in index if is_fp8_in_release(n)}, "the fixture's FP8 rule must be the release's"
    broken = dict(index)
    del broken["model.layers.7.mlp.experts.100.up_proj.weight"]
    del broken["model.layers.9.self_attn.q_b_proj.weight_scale_inv"]
    broken["model.layers.5.self_attn.o_proj.weight"] = {**index["model.layers.5.self_attn.o_proj.weight"],
                                                        "shape": [7168, 16000]}
    broken["model.layers.3.mlp.experts.256.up_proj.weight"] = index["model.layers.3.mlp.experts.0.up_proj.weight"]
    (tmp_path / "index.json").write_text(json.dumps(broken))
    (tmp_path / "config.json").write_text((SHARED_INDEX.parent / "config.json").read_text())
    problems = dsr1_convert.check(tmp_path / "index.json")
    assert len(problems) == 4
    assert any("experts.100.up_proj.weight' (expected shape [2048, 7168])" in p for p in problems)
    assert any("has no model.layers.9.self_attn.q_b_proj.weight_scale_inv" in p for p in problems)
    assert any("[7168, 16000], config predicts [7168, 16384]" in p for p in problems)
    assert any("unexpected tensor 'model.layers.3.mlp.experts.256.up_proj.weight'" in p for p in problems)


MEMORY_CONFIG = dict(hidden_size=512, moe_intermediate_size=512, n_routed_experts=32, n_group=4, topk_group=2,
                     num_experts_per_tok=4, first_k_dense_replace=0, q_lora_rank=64, kv_lora_rank=64,
                     num_attention_heads=4, vocab_size=256)
PEAK = ("import sys; from dsr1.weights.convert import convert; convert(sys.argv[1], sys.argv[2], progress=False); "
        "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])")


@pytest.mark.slow
def test_peak_memory_follows_one_layer_not_the_model(tmp_path):
    """Four times the layers (50 MiB each in bf16) must raise the converter's peak RSS by less than two layers;
    holding the model would add 600 MiB to a ~370 MiB process. The run-to-run noise of the peak alone is
    +-30 MiB (the same 4-layer conversion measured 344 and 364 MiB, 8 layers 372 and 401, 16 layers 389 and
    393), so comparing 4 with 8 layers against a one-layer bound failed once at +55 MiB: the gap must be large
    against that noise. VmHWM is the process's own peak (ru_maxrss would include the parent's at fork)."""
    peaks = {}
    for layers in (4, 16):
        cfg = hf_config({**MEMORY_CONFIG, "num_hidden_layers": layers})
        folder = write_checkpoint(tmp_path / f"hf{layers}", cfg, release_tensors(cfg, seed=0), shards=layers,
                                  dtype="bfloat16")
        proc = subprocess.run([sys.executable, "-c", PEAK, str(folder), str(tmp_path / f"out{layers}")],
                              env=subprocess_env(1), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        peaks[layers] = int(proc.stdout.split()[-1]) / 1024
    print(f"\nconverter peak RSS: 4 layers {peaks[4]:.0f} MiB, 16 layers {peaks[16]:.0f} MiB "
          f"(+{peaks[16] - peaks[4]:.0f} MiB); one layer is 50 MiB in bf16")
    assert peaks[16] - peaks[4] < 100


@pytest.mark.skipif(not SHARED_INDEX.exists(), reason="../shared reference not present")
@pytest.mark.slow
def test_check_ignores_saved_rope_buffers(tmp_path, capsys):
    """Kimi-K2's release saves `self_attn.rotary_emb.inv_freq` in every layer; HF recomputes and
    ignores them, so `--check` must too (it once reported 61 false problems and exited 1)."""
    with gzip.open(SHARED_INDEX, "rt") as f:
        index = json.load(f)
    config = json.loads((SHARED_INDEX.parent / "config.json").read_text())
    template = index["model.norm.weight"]
    for layer in range(config["num_hidden_layers"]):
        index[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = {**template, "shape": [32], "dtype": "F32"}
    index["model.layers.0.self_attn.rotary_emb.cos_cached"] = {**template, "shape": [32], "dtype": "F32"}
    (tmp_path / "index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    assert dsr1_convert.check(tmp_path / "index.json") == [
        "unexpected tensor 'model.layers.0.self_attn.rotary_emb.cos_cached' in " + template["file"]]


def test_quant_flag_is_none_or_int8(fp8, tmp_path, capsys):
    """`--quant none` (the default) keeps every weight in `--dtype`; `bf16` is no longer a quant mode."""
    folder, *_ = fp8
    with pytest.raises(SystemExit):
        dsr1_convert.main(["--hf", str(folder), "--out", str(tmp_path / "out"), "--quant", "bf16"])
    assert "invalid choice: 'bf16'" in capsys.readouterr().err
    assert dsr1_convert.main(["--hf", str(folder), "--out", str(tmp_path / "out"), "--dtype", "float32"]) == 0
    model = dsr1.load(tmp_path / "out", dtype="float32", progress=False)
    assert model.quant is None and model.params["moe_layers"]["moe"]["gate"].dtype == np.float32


def test_conversion_and_its_load_report_bytes_and_gbps(fp8, tmp_path, caplog):
    """The converter reads every tensor of the release folder (scales included) and reports the
    bytes of the unit folders it wrote; loading the result reports reading those same files."""
    folder, *_ = fp8
    out, stats = dsr1_convert.convert_with_stats(folder, tmp_path / "out", progress=False)
    index = CheckpointIndex.open(folder)
    assert stats.read.bytes == sum(info.end - info.begin for info in index.tensors.values())
    units = [out / u for u in store.read_manifest(out)["units"]]
    assert stats.written.bytes == path_bytes(units) > 0
    assert stats.read.gbps > 0 and stats.written.gbps > 0 and stats.read.seconds == stats.written.seconds
    with caplog.at_level(logging.INFO, logger="dsr1.weights"):
        dsr1.load(out, mtp=True, progress=False)
    (read,) = [r.throughput for r in caplog.records if hasattr(r, "throughput")]
    # One device holds every weight: the load reads every tensor of the unit files (their headers aside).
    tensors = [info for u in units for info in read_header(u).values()]
    assert read.bytes == sum(info.end - info.begin for info in tensors) > 0.99 * stats.written.bytes
    assert read.gbps > 0
    assert dsr1_convert.main(["--hf", str(folder), "--out", str(tmp_path / "again")]) == 0


def test_each_of_four_processes_reads_only_its_share(fp8, tmp_path):
    """Four processes load the release folder and its conversion, each asking the disk only for
    what its device holds plus the tensors every device holds whole. Mesh 4x1: each process holds
    two whole experts, so it reads exactly those experts (FP8 scales included) and every other
    tensor. Mesh 2x2: the experts' and the heads' columns are split across processes too; each
    reads at most 1.1x what its plan says its device holds (`loading.planned_reads`), a fraction of
    the checkpoint."""
    folder = fp8[0]
    converted = dsr1_convert.convert(folder, tmp_path / "converted", progress=False)
    out = tmp_path / "reports"
    out.mkdir()
    procs = start_processes("tests.read_worker", ["--folder", str(folder), "--folder", str(converted),
                                                  "--mesh", "4x1", "--mesh", "2x2", "--out", str(out),
                                                  "--num-processes=4", f"--port={free_port()}"], count=4, devices=1)
    wait_processes(procs)
    reports = [json.loads((out / f"{p}.json").read_text()) for p in range(4)]
    index = CheckpointIndex.open(folder)
    size = {name: info.end - info.begin for name, info in index.tensors.items()}
    expert_of = {name: int(name.split(".experts.")[1].split(".")[0]) for name in size if ".experts." in name}
    whole = sum(size.values())
    for p, report in enumerate(reports):
        got = report["release 4x1"]
        mine = {name for name, e in expert_of.items() if e // 2 == p}
        assert {n for n in got["tensors"] if n in expert_of} == mine  # its two experts, no other
        assert all(got["tensors"][n] == size[n] for n in got["tensors"])  # each read whole
        assert got["read"] == got["planned"] == sum(size[n] for n in size if n not in expert_of or n in mine)
        for key, case in report.items():
            assert case["planned"] <= case["read"] <= 1.1 * case["planned"], (p, key, case["read"], case["planned"])
        split = report["release 2x2"]
        experts_read = sum(b for n, b in split["tensors"].items() if n in expert_of)
        assert experts_read <= 1.1 * sum(size[n] for n in expert_of) / 4 + sum(size[n] for n in expert_of
                                                                               if n.endswith("_scale_inv"))
        assert split["read"] < 0.6 * whole
        assert report["converted 2x2"]["read"] < 0.6 * path_bytes([converted])
