"""Config.from_hf on the DeepSeek-V3 family, presets, and clear errors on what dsr1 cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsr1 import Config, ConfigError
from dsr1.core.rope import attention_factor, inverse_frequencies

DATA = Path(__file__).parent / "data"
SHARED_R1 = Path(__file__).parents[2] / "shared" / "reference" / "deepseek-r1" / "config.json"
R1 = json.loads((DATA / "deepseek-r1-config.json").read_text())

# The fields that distinguish the other checkpoints of the family (from their released config.json).
MOONLIGHT = {**R1, "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408,
             "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
             "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1,
             "topk_group": 1, "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "vocab_size": 163840,
             "rope_theta": 50000.0, "rope_scaling": None, "max_position_embeddings": 8192,
             "num_nextn_predict_layers": 0}
KIMI_K2 = {**R1, "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64, "n_routed_experts": 384,
           "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827, "first_k_dense_replace": 1,
           "rope_theta": 50000.0, "max_position_embeddings": 131072, "eos_token_id": 163585,
           "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
R1_NEW_HF = {k: v for k, v in R1.items() if k not in ("rope_scaling", "rope_theta")} | {
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, **{k: v for k, v in R1["rope_scaling"].items()
                                                                       if k != "type"}}}


def write(tmp_path: Path, raw: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_r1_release_config_equals_preset(tmp_path):
    assert Config.from_hf(write(tmp_path, R1)) == Config.preset("deepseek-r1")
    assert Config.from_hf(tmp_path / "config.json") == Config.preset("deepseek-r1")


@pytest.mark.skipif(not SHARED_R1.exists(), reason="../shared reference not present")
def test_shared_reference_config_equals_preset():
    assert Config.from_hf(SHARED_R1) == Config.preset("deepseek-r1")


def test_r1_facts():
    cfg = Config.preset("deepseek-r1")
    assert (cfg.num_dense_layers, cfg.num_moe_layers, cfg.qk_head_dim) == (3, 58, 192)
    # YaRN softmax scale: 1/sqrt(192) * (0.1 ln 40 + 1)^2
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 3.6888794541139363 + 1) ** 2, rel=1e-12)
    assert attention_factor(cfg) == 1.0
    inv = inverse_frequencies(cfg)
    assert inv.shape == (32,) and inv[0] == 1.0  # the fastest pair is never interpolated
    assert inv[-1] == pytest.approx(10000 ** (-62 / 64) / 40, rel=1e-6)  # the slowest is divided by factor


# V3-0324, R1-0528, V3.1 and V3.1-Terminus: R1's fields; V3.1's FP8 scales are powers of two ("ue8m0").
V31 = {**R1, "quantization_config": {**R1["quantization_config"], "scale_fmt": "ue8m0"}}


def test_v3_line_configs_are_r1s_architecture(tmp_path):
    assert Config.from_hf(write(tmp_path, V31)) == Config.preset("deepseek-r1") == Config.preset("deepseek-v3.1")


@pytest.mark.parametrize("quant,message", [
    ({"scale_fmt": "e4m3"}, "quantization_config.scale_fmt='e4m3' is not supported"),
    ({"weight_block_size": [64, 64]}, r"quantization_config.weight_block_size=\[64, 64\] is not supported"),
    ({"fmt": "e5m2"}, "quantization_config.fmt='e5m2' is not supported"),
])
def test_unknown_quantization_fails_naming_the_field(tmp_path, quant, message):
    folder = write(tmp_path, {**V31, "quantization_config": {**V31["quantization_config"], **quant}})
    with pytest.raises(ConfigError, match=message) as info:
        Config.from_hf(folder)
    assert str(folder / "config.json") in str(info.value)


def test_newer_hf_rope_parameters(tmp_path):
    assert Config.from_hf(write(tmp_path, R1_NEW_HF)) == Config.preset("deepseek-r1")


@pytest.mark.parametrize("raw,checks", [
    (MOONLIGHT, dict(q_lora_rank=None, n_group=1, n_shared_experts=2, num_dense_layers=1)),
    (KIMI_K2, dict(n_routed_experts=384, n_group=1, num_attention_heads=64, eos_token_id=163585)),
    ({**R1, "norm_topk_prob": False, "first_k_dense_replace": 0}, dict(norm_topk_prob=False, num_dense_layers=0)),
    ({**R1, "first_k_dense_replace": 61}, dict(num_moe_layers=0)),
])
def test_family_configs(tmp_path, raw, checks):
    cfg = Config.from_hf(write(tmp_path, raw))
    for field, value in checks.items():
        assert getattr(cfg, field) == value, field


def test_moonlight_plain_rope(tmp_path):
    cfg = Config.from_hf(write(tmp_path, MOONLIGHT))
    assert cfg.rope_scaling.factor == 1.0 and cfg.softmax_scale == pytest.approx(192**-0.5)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "llama"}, "model_type='llama' is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    ({"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
    ({"n_group": 3}, "n_routed_experts=256 is not divisible by n_group=3"),
    ({"topk_group": 9}, "topk_group=9"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2}}, "rope type 'dynamic'"),
    ({"rope_scaling": {"type": "yarn", "factor": 2}}, "missing field 'original_max_position_embeddings'"),
    ({"hidden_size": None}, "missing field 'hidden_size'"),
])
def test_unsupported_configs_fail_clearly(tmp_path, change, message):
    folder = write(tmp_path, {**R1, **change})
    with pytest.raises(ConfigError, match=message) as info:
        Config.from_hf(folder)
    assert str(folder / "config.json") in str(info.value)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        Config.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Config.from_hf(tmp_path)


def test_presets():
    tiny = Config.preset("tiny")
    assert tiny.num_dense_layers == 1 and tiny.num_moe_layers == 2 and tiny.n_group > tiny.topk_group
    with pytest.raises(ConfigError, match="unknown preset 'r2'"):
        Config.preset("r2")


def test_hf_dict_round_trip(tmp_path):
    for name in ("tiny", "deepseek-r1"):
        cfg = Config.preset(name)
        assert Config.from_hf(write(tmp_path, cfg.to_hf_dict())) == cfg


V32 = {**R1, "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], "index_n_heads": 64,
       "index_head_dim": 128, "index_topk": 2048}


def test_v32_release_config_is_r1_with_the_indexer(tmp_path):
    cfg = Config.from_hf(write(tmp_path, V32))
    assert cfg == Config.preset("deepseek-v3.2") and cfg.sparse_attention
    assert not Config.preset("deepseek-r1").sparse_attention
    for name in ("tiny-v3.2", "deepseek-v3.2"):
        preset = Config.preset(name)
        assert preset.to_hf_dict()["model_type"] == "deepseek_v32"
        assert Config.from_hf(write(tmp_path, preset.to_hf_dict())) == preset


@pytest.mark.parametrize("change,message", [
    ({"index_topk": None}, "missing field 'index_topk'"),
    ({"q_lora_rank": None}, "needs q_lora_rank"),
    ({"index_head_dim": 32}, "index_head_dim=32 must be at least qk_rope_head_dim=64"),
])
def test_v32_configs_fail_clearly(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_hf(write(tmp_path, {**V32, **change}))
