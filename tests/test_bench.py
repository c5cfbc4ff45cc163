"""`dsr1.bench`: the byte accounting against a hand computation from the config, the decode and
compare-hf commands end to end on a small config."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import dsr1
from dsr1.bench import accounting, bandwidth, cli, compare_hf, decode_attention, prefill, report, serve, timing
from dsr1.cpu import ffi as cpu_kernels

# The tiny preset with a small vocabulary: every test here stays fast.
CFG = dataclasses.replace(dsr1.Config.preset("tiny"), vocab_size=512)
BF16, INT8 = 2, 1


@pytest.fixture(scope="module")
def models() -> dict[str, dsr1.Model]:
    return {"bf16": dsr1.init_random(CFG, seed=0), "int8": dsr1.init_random(CFG, seed=0, quant="int8")}


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(CFG.to_hf_dict()))
    return path


def hand_fixed_bytes(c: dsr1.Config, item: int, head_item: int) -> int:
    """Every weight a decode step reads whatever its tokens (bf16: `item` bytes per value, the
    lm_head `head_item`; the router and its bias are float32), written out from the architecture."""
    d, h, q, r = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    attention = (d * q + q + q * h * (c.qk_nope_head_dim + c.qk_rope_head_dim)  # q_a, q_a_norm, q_b
                 + d * (r + c.qk_rope_head_dim) + r  # kv_a, kv_a_norm
                 + h * c.qk_nope_head_dim * r + h * c.v_head_dim * r  # W_UK, W_UV
                 + h * c.v_head_dim * d + 2 * d) * item  # o, attn_norm, mlp_norm
    dense_mlp = 3 * d * c.intermediate_size * item
    moe_fixed = (d * c.n_routed_experts + c.n_routed_experts) * 4 + 3 * d * c.shared_intermediate_size * item
    head = d * c.vocab_size * head_item + d * item  # lm_head, final_norm
    return (c.num_hidden_layers * attention + c.num_dense_layers * dense_mlp + c.num_moe_layers * moe_fixed
            + head)


@pytest.mark.slow
def test_bf16_bytes_match_hand_computation(models):
    c, params = CFG, models["bf16"].params
    d, f = c.hidden_size, c.moe_intermediate_size
    assert accounting.expert_bytes(params) == 3 * d * f * BF16
    # A product reads the lm_head's bf16 bits (or, with dsr1's CPU backend, their transposed copy: the
    # same bytes).
    kernel = cpu_kernels.available()
    one_row_head = BF16
    assert accounting.fixed_weight_bytes(params, 2) == hand_fixed_bytes(c, BF16, BF16)
    assert accounting.fixed_weight_bytes(params, 1) == hand_fixed_bytes(c, BF16, one_row_head)
    # One row, 4 distinct experts in the first MoE layer, 2 in the second (ids need not be real routes).
    ids = np.array([[[0, 1, 2, 3]], [[7, 7, 9, 9]]])
    got = accounting.step_bytes(params, c, None, lengths=np.array([10]), tokens=np.array([42]), expert_ids=ids)
    cache = 10 * c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * BF16
    fixed = hand_fixed_bytes(c, BF16, one_row_head)
    assert got == accounting.StepBytes(fixed, 6 * 3 * d * f * BF16, d * BF16, cache, 3.0)
    assert got.total == fixed + 6 * 3 * d * f * BF16 + d * BF16 + cache
    # The whole model minus the embedding table, the experts not hit, and with the CPU backend the
    # matrices' transposed copies (a one-row product reads those instead of the bits: the same bytes,
    # counted once).
    unread = (c.vocab_size - 1) * d * BF16 + (c.num_moe_layers * c.n_routed_experts - 6) * 3 * d * f * BF16
    if kernel:
        # Transposed: q_a and kv_a of every layer, the dense MLPs, the shared and routed experts.
        copies = (c.num_hidden_layers * d * (c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim)
                  + c.num_dense_layers * 3 * d * c.intermediate_size
                  + c.num_moe_layers * 3 * d * (c.shared_intermediate_size + c.n_routed_experts * f)) * BF16
        if kernel:  # the attention weights laid out for their decode products
            h, r = c.num_attention_heads, c.kv_lora_rank
            per_layer = (c.q_lora_rank * h * c.qk_head_dim + h * c.qk_nope_head_dim * r  # (W_UV: laid out already)
                         + h * c.v_head_dim * d)
            copies += c.num_hidden_layers * per_layer * BF16
        unread += d * c.vocab_size * BF16 + copies  # the lm_head's transposed bits read instead
    assert got.total - got.cache == models["bf16"].weight_bytes() - unread


@pytest.mark.slow
def test_int8_weights_and_cache_count_fewer_bytes(models):
    c = CFG
    d, f, r, rope = c.hidden_size, c.moe_intermediate_size, c.kv_lora_rank, c.qk_rope_head_dim
    # int8 values plus float32 scales of the output channels: gate and up [f], down [d].
    assert accounting.expert_bytes(models["int8"].params) == 3 * d * f * INT8 + (2 * f + d) * 4
    assert accounting.cache_token_bytes(c, jnp.bfloat16, "int8") == r * INT8 + 4 + rope * BF16
    assert accounting.cache_token_bytes(c, jnp.bfloat16, None) == (r + rope) * BF16
    ids = np.array([[[0, 1, 2, 3], [2, 3, 4, 5]]] * c.num_moe_layers)
    args = dict(lengths=np.array([64, 64]), tokens=np.array([3, 4]), expert_ids=ids)
    full = accounting.step_bytes(models["bf16"].params, c, None, **args)
    quant = accounting.step_bytes(models["int8"].params, c, None, **args)
    quant_cache = accounting.step_bytes(models["int8"].params, c, "int8", **args)
    assert full.distinct_experts == quant.distinct_experts == 6
    assert quant.experts < full.experts and quant.fixed_weights < full.fixed_weights
    assert quant.embed == full.embed  # the embedding table stays in the model's dtype
    assert quant_cache.cache < quant.cache == full.cache
    assert quant_cache.total < quant.total < full.total


@pytest.mark.slow
def test_decode_point_accounting(models):
    """A real run: at most min(B*K, E) distinct experts per layer, bytes between the hit-free floor
    and the whole model, and achieved GB/s = bytes per step / step time."""
    c, model = CFG, models["bf16"]
    batch, context, steps = 3, 16, 3
    row = timing.bench_decode_point(model, batch, context, steps, copy_gbs=10.0, read_gbs=4.0, seed=1)
    assert 1 <= row["distinct_experts_per_layer"] <= min(batch * c.num_experts_per_tok, c.n_routed_experts)
    assert row["bytes"]["experts"] <= c.num_moe_layers * min(batch * c.num_experts_per_tok, c.n_routed_experts) \
        * accounting.expert_bytes(model.params)
    mean_len = context + (steps - 1) / 2
    assert row["bytes"]["cache"] == round(batch * mean_len * c.num_hidden_layers
                                          * accounting.cache_token_bytes(c, model.dtype, None))
    assert row["bytes_per_step"] == sum(row["bytes"].values())
    step_s = row["step_ms"] / 1e3
    assert row["achieved_gbs"] == pytest.approx(row["bytes_per_step"] / step_s / 1e9)
    assert row["pct_of_copy_bw"] == pytest.approx(100 * row["achieved_gbs"] / 10.0)
    assert row["pct_of_read_bw"] == pytest.approx(100 * row["achieved_gbs"] / 4.0)
    assert row["tok_s"] == pytest.approx(batch * row["tok_s_per_seq"]) and row["tok_s_per_seq"] > 0


def test_decode_row_arithmetic():
    nbytes = accounting.StepBytes(fixed_weights=600, experts=300, embed=50, cache=50, distinct_experts=2.0)
    row = timing.decode_row(batch=4, context=8, steps=10, seconds=2e-6, nbytes=nbytes, copy_gbs=10.0,
                           read_gbs=8.0)
    assert row["step_ms"] == pytest.approx(2e-4)
    assert row["achieved_gbs"] == pytest.approx(5.0)  # 1000 B per 0.2 us
    assert row["pct_of_copy_bw"] == pytest.approx(50.0)
    assert row["pct_of_read_bw"] == pytest.approx(62.5)
    assert row["tok_s"] == pytest.approx(4 / 2e-7)


@pytest.mark.slow
def test_random_cache_shape_and_dtype(models):
    for kv in (None, "int8"):
        model = dataclasses.replace(models["bf16"], kv_cache_dtype=kv)
        cache = timing.random_cache(model, batch=2, context=5, max_len=9)
        assert cache.c_kv.shape == (CFG.num_hidden_layers, 2, 9, CFG.kv_lora_rank)
        assert cache.c_kv.dtype == (jnp.int8 if kv else jnp.uint16)  # bf16 on CPU: its bits (`stores_bits`)
        assert cache.k_pe.dtype == jnp.uint16
        assert (cache.c_scale is None) == (kv is None)
        assert np.asarray(cache.lengths).tolist() == [5, 5]


def test_copy_and_read_bandwidths_are_positive():
    assert bandwidth.copy_bandwidth(nbytes=2**22, repeats=2) > 0
    assert bandwidth.read_bandwidth(nbytes=2**22, repeats=2) > 0


def test_compare_row_puts_dsr1_decode_against_the_read_floor():
    """Decode seconds and bytes per step give the floor (bytes / read bandwidth) and the ratio to HF a
    step at the floor would give."""
    tokens = np.zeros((2, 5), np.int32)  # 4 decode steps
    ours = compare_hf.GenerateTiming(prefill_s=0.5, decode_s=0.04, tokens=tokens, step_bytes=20_000_000)
    hf = compare_hf.GenerateTiming(prefill_s=1.0, decode_s=0.2, tokens=tokens)
    row = compare_hf.compare_row(2, ours, hf, prefill_flop=1e9, peak_flop_s=1e10, read_gbs=4.0)
    assert row["dsr1_step_ms"] == pytest.approx(10.0) and row["hf_step_ms"] == pytest.approx(50.0)
    assert row["floor_step_ms"] == pytest.approx(5.0)  # 20 MB at 4 GB/s
    assert row["pct_of_read_bw"] == pytest.approx(50.0) and row["dsr1_mb_per_step"] == pytest.approx(20.0)
    assert row["ratio"] == pytest.approx(5.0) and row["ratio_at_floor"] == pytest.approx(10.0)
    assert row["prefill_ratio"] == pytest.approx(2.0) and row["prefill_pct_of_peak"] == pytest.approx(20.0)
    cells = [c.strip() for c in report.compare_floor_table([row]).splitlines()[-1].split("|")[1:-1]]
    assert row["read_gbs"] == 4.0 and cells[:5] == ["2", "20.0", "4.00", "10.00", "5.00"]


@pytest.mark.slow
def test_cli_decode_writes_json(tmp_path, config_file, capsys):
    out = tmp_path / "decode.json"
    assert cli.main(["decode", "--config", str(config_file), "--batch", "1,2", "--context", "4", "--steps", "2",
                       "--repeats", "1", "--copy-mb", "4", "--kv-cache-dtype", "int8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "achieved GB/s" in printed and "% of copy BW" in printed and "% of read BW" in printed
    assert "device: " in printed
    result = json.loads(out.read_text())
    assert result["device"]["platform"] == "cpu" and result["copy_gbs"] > 0 and result["read_gbs"] > 0
    assert result["kv_cache_dtype"] == "int8"
    assert [(r["batch"], r["context"]) for r in result["rows"]] == [(1, 4), (2, 4)]
    for row in result["rows"]:
        assert set(timing.DECODE_COLUMNS) <= set(row)
        assert row["tok_s"] > 0 and row["mb_per_step"] > 0 and row["achieved_gbs"] > 0


@pytest.mark.slow
def test_prefill_peak_is_of_the_dtype_prefill_computes_in():
    """On CPU bf16 weights compute a prefill's products in bf16 (`quant.native_bf16`), int8 ones in
    float32 (widened); the peak the prefill is set against is measured in that dtype."""
    assert prefill.compute_dtype(dsr1.init_random(CFG, dtype="bfloat16")) == jnp.bfloat16
    assert prefill.compute_dtype(dsr1.init_random(CFG, dtype="float32")) == jnp.float32
    assert prefill.compute_dtype(dsr1.init_random(CFG, dtype="bfloat16", quant="int8")) == jnp.float32


@pytest.mark.slow
def test_cli_prefill_reports_flops_against_the_peak(tmp_path, config_file, capsys):
    """`--layers 1` keeps the config's shape with one layer, a MoE one (the dense layer is dropped)."""
    out = tmp_path / "prefill.json"
    assert cli.main(["prefill", "--config", str(config_file), "--layers", "1", "--batch", "1,2", "--tokens", "5",
                     "--repeats", "1", "--dtype", "float32", "--json", str(out)]) == 0
    assert "% of matmul peak" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["config"]["num_hidden_layers"] == 1 and result["config"]["first_k_dense_replace"] == 0
    one_layer = dataclasses.replace(CFG, num_hidden_layers=1, first_k_dense_replace=0)
    assert result["compute_dtype"] == "float32" and result["matmul_peak_flop_s"] > 0
    assert [(r["batch"], r["tokens"]) for r in result["rows"]] == [(1, 5), (2, 5)]
    for row in result["rows"]:
        assert set(prefill.PREFILL_COLUMNS) <= set(row)
        seconds = row["ms"] / 1e3
        assert row["gflop"] == pytest.approx(prefill.prefill_flops(one_layer, row["batch"], 5) / 1e9)
        assert row["pct_of_peak"] == pytest.approx(100 * row["gflop"] * 1e9 / seconds / result["matmul_peak_flop_s"])
    with pytest.raises(SystemExit, match="--layers shapes random weights"):
        cli.main(["prefill", "--model", str(tmp_path), "--layers", "2"])


@pytest.mark.slow
def test_cli_moe_runs_every_kernel_to_the_same_output(tmp_path, config_file, capsys):
    out = tmp_path / "moe.json"
    assert cli.main(["moe", "--config", str(config_file), "--tokens", "1,5", "--dtype", "float32", "--repeats", "1",
                     "--json", str(out)]) == 0
    assert "rel. diff = max |out - ragged_dot's out|" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    kernels = ("ragged_dot", "loop", "gather", "capacity", "dense")
    assert [(r["kernel"], r["tokens"]) for r in rows] == [(k, n) for n in (1, 5) for k in kernels]
    per_expert = 3 * CFG.hidden_size * CFG.moe_intermediate_size * 4  # float32 gate, up, down
    for row in rows:
        assert 1 <= row["experts_hit"] <= min(row["tokens"] * CFG.num_experts_per_tok, CFG.n_routed_experts)
        assert row["mb_hit"] == pytest.approx(row["experts_hit"] * per_expert / 1e6)
        assert row["max_rel_diff"] < 1e-5 and row["ms"] > 0
    # int8 experts: each kernel applies the per-expert output scales its own way (dense sums over experts after)
    assert cli.main(["moe", "--config", str(config_file), "--tokens", "5", "--dtype", "float32", "--quant", "int8",
                     "--repeats", "1", "--json", str(out)]) == 0
    assert all(r["max_rel_diff"] < 1e-5 for r in json.loads(out.read_text())["rows"])
    with pytest.raises(SystemExit):
        cli.main(["moe", "--kernels", "ragged_dot,grouped"])


def test_random_checkpoint_loads_in_dsr1(tmp_path):
    folder = compare_hf.write_random_checkpoint(tmp_path / "ckpt", CFG, seed=3)
    model = dsr1.load(folder, progress=False)
    assert model.cfg == CFG
    embed = np.asarray(model.params["embed"], np.float32)
    assert embed.shape == (CFG.vocab_size, CFG.hidden_size) and 0.9 < embed.std() < 1.1
    norm = np.asarray(model.params["final_norm"], np.float32)
    assert (norm == 1).all()


@pytest.mark.slow
def test_cli_compare_hf(tmp_path, config_file, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "compare.json"
    assert cli.main(["compare-hf", "--config", str(config_file), "--batch", "2", "--new-tokens", "4",
                       "--prompt-len", "6", "--repeats", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "dsr1 / HF" in printed and "dsr1 / HF at the floor" in printed
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["matmul_peak_flop_s"] > 0 and "read GB/s" in printed
    assert [r["batch"] for r in rows] == [2]
    for row in rows:
        assert row["dsr1_tok_s"] > 0 and row["hf_tok_s"] > 0
        assert row["ratio"] == pytest.approx(row["dsr1_tok_s"] / row["hf_tok_s"])
        assert row["dsr1_mb_per_step"] > 0
        assert row["read_gbs"] > 0
        assert row["floor_step_ms"] == pytest.approx(row["dsr1_mb_per_step"] / row["read_gbs"])
        flop = prefill.prefill_flops(CFG, 2, 6)
        assert row["prefill_gflop_s"] == pytest.approx(flop / row["dsr1_prefill_s"] / 1e9)
        assert row["prefill_pct_of_peak"] == pytest.approx(100 * flop / row["dsr1_prefill_s"]
                                                           / result["matmul_peak_flop_s"])
        # The same weights: the prefill's greedy token agrees (a different checkpoint would agree
        # with probability ~1/512 per row).
        assert row["same_first_token"] >= 0.5


def test_serve_workload_is_seeded_and_mixed():
    spec = serve.WorkloadSpec(requests=200, rate=10.0, prompt_len=(8, 64), output_len=(2, 100), shared_prefix=6,
                              shared_fraction=0.5, seed=4)
    a, b = serve.make_workload(spec, 512), serve.make_workload(spec, 512)
    assert a == b, "the same seed draws the same workload"
    assert a.arrivals[0] == 0 and np.all(np.diff(a.arrivals) >= 0)
    assert 7 < len(a) / a.arrivals[-1] < 14, "Poisson arrivals at about the asked rate (10/s)"
    assert all(8 <= len(p) <= 64 for p in a.prompts) and all(2 <= n <= 100 for n in a.max_new_tokens)
    with_prefix = [p for p, s in zip(a.prompts, a.shared) if s]
    assert 60 < len(with_prefix) < 140 and len({p[:6] for p in with_prefix}) == 1
    assert np.median(a.max_new_tokens) < np.mean(a.max_new_tokens), "exponential: many short, a few long"
    uniform = serve.make_workload(dataclasses.replace(spec, output_dist="uniform"), 512)
    assert uniform.prompts == a.prompts and uniform.max_new_tokens != a.max_new_tokens


@pytest.mark.slow
def test_cli_serve_compares_continuous_and_static(tmp_path, config_file, capsys):
    out = tmp_path / "serve.json"
    assert cli.main(["serve", "--config", str(config_file), "--dtype", "float32", "--requests", "6", "--rate", "inf",
                     "--prompt-len", "8,40", "--output-len", "2,12", "--shared-prefix", "16", "--max-seqs", "4",
                     "--page-size", "4", "--num-pages", "64", "--prefill-chunk", "16", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "continuous / static throughput" in printed and "TTFT p99 ms" in printed and "static (generate" in printed
    result = json.loads(out.read_text())
    continuous, static = result["rows"]
    # Greedy, the same requests: both generate the same number of tokens (their tokens are compared
    # against generate in test_serving).
    assert continuous["tokens"] == static["tokens"] > 0 and continuous["requests"] == static["requests"] == 6
    assert result["throughput_ratio"] == pytest.approx(continuous["tok_s"] / static["tok_s"])
    for row in (continuous, static):
        assert row["tok_s"] > 0 and 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]
    assert continuous["prefix_hit_rate"] > 0 and continuous["host_ms_per_step"] > 0
    assert continuous["device_ms_per_step"] > 0 and result["engine_stats"]["finished"] == 6
    assert result["arrival_bound"] == []  # all at once: nothing waits for arrivals


def test_a_run_that_waits_for_arrivals_is_flagged():
    """A run that ends right after its last request arrived measured the arrival rate, not the server."""
    def timings(end: float) -> list[serve.RequestTiming]:
        return [serve.RequestTiming(arrival, arrival + 0.01, min(arrival + 0.05, end), 5)
                for arrival in np.linspace(0.0, 3.0, 10)] + [serve.RequestTiming(3.0, 3.01, end, 5)]

    waiting, busy = serve.summarize(timings(3.2)), serve.summarize(timings(6.0))
    assert waiting["after_last_arrival_s"] == pytest.approx(0.2) and serve.arrival_bound(waiting)
    assert busy["after_last_arrival_s"] == pytest.approx(3.0) and not serve.arrival_bound(busy)


@pytest.mark.slow
def test_shared_prefix_of_2000_tokens_cuts_the_second_time_to_first_token_5x():
    """The first request prefills 2,008 tokens in 32 chunks; the second finds 2,000 of them cached and
    prefills 8: its time to first token is a couple of steps instead of 32 (float32 on CPU)."""
    model = dsr1.init_random(CFG, seed=0, dtype="float32")
    shape = serve.EngineShape(max_seqs=2, page_size=16, num_pages=160, prefill_chunk=64, prefill_rows=1)
    result = serve.prefix_ttft(model, 2000, shape)
    print(f"\n[serve] 2,000-token shared prefix: {result}")
    assert result["second_cached_tokens"] == 2000
    assert result["ratio"] >= 5, f"second request's TTFT only {result['ratio']:.1f}x lower"


@pytest.mark.slow
def test_cli_attention_times_every_implementation_against_xlas(tmp_path, capsys):
    """XLA's path, the flash kernel (in Pallas' interpreter here) under two tilings and the CPU kernel
    (where built) at two batch sizes; each close to XLA's context; bad tilings are named."""
    out = tmp_path / "attention.json"
    assert cli.main(["attention", "--rows", "1,3", "--positions", "50", "--heads", "16", "--rank", "32", "--rope",
                     "16", "--tilings", "16x32x4x1,16x16x4x2t", "--interpret", "--calls", "2", "--repeats", "1",
                     "--json", str(out)]) == 0
    assert "flash 16x32x4x1" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    names = ["xla", "flash 16x32x4x1", "flash 16x16x4x2t"] + (["cpu kernel"] if cpu_kernels.available() else [])
    assert [(r["implementation"], r["rows"]) for r in rows] == [(n, b) for b in (1, 3) for n in names]
    for row in rows:
        assert set(decode_attention.ATTENTION_COLUMNS) <= set(row) and row["ms"] > 0 and row["tflop_s"] > 0
        # The flash kernel rounds its probabilities to bf16 before they are normalized (~2^-9 apart).
        assert row["max_rel_diff"] < {"xla": 1e-7, "cpu kernel": 1e-5}.get(row["implementation"], 2 ** -8)
    with pytest.raises(SystemExit):
        cli.main(["attention", "--tilings", "32x64x4"])


@pytest.mark.slow
def test_cli_attention_with_an_int8_cache(tmp_path):
    """`--kv-cache-dtype int8`: XLA's path with the scales, the flash kernel (interpreted here, plain
    and transposed products) and the CPU kernel (where built), close to it; the cache read counts 1
    byte a latent and 4 a scale."""
    out = tmp_path / "attention.json"
    assert cli.main(["attention", "--rows", "2", "--positions", "70", "--heads", "16", "--rank", "64", "--rope",
                     "16", "--kv-cache-dtype", "int8", "--tilings", "16x32x4x2,16x32x4x2t", "--interpret", "--calls",
                     "2", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kv_cache_dtype"] == "int8"
    rows = result["rows"]
    flash = ["flash 16x32x4x2", "flash 16x32x4x2t"]
    assert [r["implementation"] for r in rows] == ["xla", *flash] + (["cpu kernel"] if cpu_kernels.available() else [])
    for row in rows:
        bytes_read = row["cache_gbs"] * 1e9 * row["ms"] / 1e3
        assert bytes_read == pytest.approx(2 * 70 * (64 + 2 * 16 + 4), rel=1e-6)
        # The CPU kernel sums scores in another order: a probability at a bf16 rounding tie may round the
        # other way (here one head's, 1.9e-4), every other output equal. The flash kernel rounds its
        # probabilities to bf16 before they are normalized (~2^-9 apart), as with a bf16 cache.
        assert row["max_rel_diff"] < (1e-7 if row["implementation"] == "xla" else 2 ** -8)


@pytest.mark.slow
def test_int8_reference_scales_scores_and_probabilities():
    """The bench's XLA reference with an int8 cache equals float64 of dequantized keys: the scales
    multiply the latent scores, then the probabilities before the bf16 rounding (1 for the own key)."""
    x = decode_attention.random_inputs(2, 9, 4, 32, 8, seed=3, kv_cache_dtype="int8")
    assert x.c.dtype == jnp.int8 and x.c_scale.shape == (2, 9)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    key_scale = np.concatenate([f64(x.c_scale), np.ones((2, 1))], axis=1)[:, None]
    keys = np.concatenate([f64(x.c), f64(x.own_c)[:, None]], axis=1)
    rotary = np.concatenate([f64(x.pe), f64(x.own_pe)[:, None]], axis=1)
    s = (np.einsum("bhr,bsr->bhs", f64(x.q), keys) * key_scale + np.einsum("bhp,bsp->bhs", f64(x.q_pe), rotary)) * 0.2
    probs = np.exp(s - s.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True) * key_scale).astype(np.float32).astype(jnp.bfloat16)
    want = np.einsum("bhs,bsr->bhr", f64(probs), keys)
    got = f64(decode_attention.xla_context(x, 0.2))
    assert np.quantile(np.abs(got - want), 0.999) < 1e-6 * np.abs(want).max()
    assert np.abs(got - want).max() < 2 ** -8 * np.abs(want).max()  # a probability at a bf16 rounding tie at most


@pytest.mark.slow
def test_cli_attention_reports_a_tiling_that_fails(tmp_path, capsys, monkeypatch):
    """A tiling the device cannot run is reported and skipped; the others still run."""
    def flash(x, scale, tiling, interpret=False):
        raise RuntimeError(f"out of shared memory for {tiling}")

    monkeypatch.setattr(decode_attention, "flash_context", flash)
    out = tmp_path / "attention.json"
    assert cli.main(["attention", "--rows", "1", "--positions", "8", "--heads", "16", "--rank", "32", "--rope", "16",
                     "--tilings", "16x32x4x1", "--interpret", "--calls", "1", "--repeats", "1", "--json",
                     str(out)]) == 0
    assert "failed: flash 16x32x4x1 at 1 rows x 8 positions: RuntimeError: out of shared memory" in \
        capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [r["implementation"] for r in result["rows"]][0] == "xla" and len(result["failed"]) == 1


@pytest.mark.slow
def test_cli_control_sends_table_deltas_to_every_follower(tmp_path, capsys):
    """The control plane's benchmark: followers in their own processes receive every step; the page
    tables travel as changed entries, far fewer bytes than whole."""
    out = tmp_path / "control.json"
    assert cli.main(["control", "--processes", "3", "--slots", "8", "--max-seq-len", "4096", "--steps", "24",
                     "--interval-ms", "1", "--prompt-len", "64", "--json", str(out)]) == 0
    assert "| processes | send_us | latency_us" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["processes"] for r in rows] == [3]
    for row in rows:
        assert 0 < row["send_us"] and 0 < row["latency_us"] <= row["latency_p99_us"]
        assert row["bytes_per_step"] < row["full_table_bytes_per_step"] / 4, row
