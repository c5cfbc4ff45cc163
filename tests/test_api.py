"""The public API: input checks with clear errors, cache layout, and numpy/jax token inputs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsr1
from dsr1.generation.output import visible_text

from .harness import TINY, count_products

CFG = dsr1.Config.preset("tiny")


@pytest.fixture(scope="module")
def model():
    return dsr1.init_random(CFG, seed=0, dtype="float32")


@pytest.mark.slow
def test_random_init_depends_on_seed_only():
    model, again, other = (dsr1.init_random(TINY, seed=seed, dtype="float32") for seed in (0, 0, 1))
    np.testing.assert_array_equal(np.asarray(again.params["embed"]), np.asarray(model.params["embed"]))
    assert not np.array_equal(np.asarray(other.params["embed"]), np.asarray(model.params["embed"]))
    assert model.dtype == jnp.float32 and dsr1.init_random(TINY).dtype == jnp.bfloat16


def test_an_r1_expert_layer_is_drawn_in_slices_along_embed():
    """One layer of R1's gate experts, 3.8 G values, in 56 slices of 128 rows of the embedding axis (the
    expert axis is split over devices: a slice of it would leave devices idle)."""
    from dsr1.core import params

    r1_gate = params.per_layer(params.float_specs(dsr1.Config.preset("deepseek-r1"))["moe_layers"]["moe"]["gate"])
    assert r1_gate.shape == (256, 7168, 2048) and params._slicing(r1_gate) == (1, 128)


@pytest.fixture
def small_slices(monkeypatch):
    """Random weights drawn in slices of at most 2048 values (the programs compiled meanwhile are dropped after)."""
    from dsr1.core import params

    monkeypatch.setattr(params, "RANDOM_CHUNK_ELEMENTS", 2048)
    jax.clear_caches()
    yield
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.slow
def test_large_weights_are_drawn_in_slices_and_int8_stacks_layer_by_layer(small_slices):
    """XLA's temporaries for one random draw come to ~32 bytes per value, so a weight over
    RANDOM_CHUNK_ELEMENTS is drawn slice by slice along an axis the default rules never split, and an
    int8 stack is drawn and quantized one layer at a time: the same int8 values as quantizing the
    float32 weights of the same seed."""
    from dsr1.core import params, quant

    gate_spec = params.per_layer(params.float_specs(TINY)["moe_layers"]["moe"]["gate"])
    assert params._slicing(gate_spec) == (1, 2)  # [16, 128, 64] in 64 slices of 2 rows under the patched size

    f32 = dsr1.init_random(TINY, seed=3, dtype="float32")
    gate = np.asarray(f32.params["moe_layers"]["moe"]["gate"])  # [L, E, D, F]
    slices = gate[0].reshape(16, 64, 2, 64).transpose(1, 0, 2, 3).reshape(64, -1)
    assert len({s.tobytes() for s in slices}) == 64, "every slice is a fresh draw"
    assert not np.array_equal(gate[0], gate[1]), "every layer is a fresh draw"
    assert np.std(gate) == pytest.approx(128 ** -0.5, rel=0.03)

    int8 = dsr1.init_random(TINY, seed=3, dtype="float32", quant="int8")
    expected = params.quantize_like(params.param_specs(TINY, "int8"), f32.params)

    def is_int8(w):
        return isinstance(w, quant.Int8Weight)

    held = jax.tree.leaves(int8.params, is_leaf=is_int8)
    copies = [w for w in held if is_int8(w) and w.transposed is not None]
    assert copies, "the int8 matrices of x @ W products keep their values transposed on CPU"
    for w in copies:
        np.testing.assert_array_equal(np.asarray(w.transposed), np.swapaxes(np.asarray(w.q), -1, -2))
    stored = [dataclasses.replace(w, transposed=None) if is_int8(w) else w for w in held]
    for got, want in zip(jax.tree.leaves(stored), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_numpy_and_jax_tokens_agree(model):
    tokens = np.arange(12, dtype=np.int64).reshape(2, 6) + 5
    a = np.asarray(model.forward(tokens))
    b = np.asarray(model.forward(jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (2, 6, CFG.vocab_size) and a.dtype == np.float32


@pytest.mark.slow
def test_cache_holds_only_latents(model):
    _, cache = model.prefill(np.ones((2, 5), np.int32), max_len=32)
    assert cache.c_kv.shape == (CFG.num_hidden_layers, 2, 32, CFG.kv_lora_rank)
    assert cache.k_pe.shape == (CFG.num_hidden_layers, 2, 32, CFG.qk_rope_head_dim)
    per_token = CFG.num_hidden_layers * (CFG.kv_lora_rank + CFG.qk_rope_head_dim) * 4
    assert cache.nbytes() == per_token * 2 * 32


@pytest.mark.slow
def test_default_max_len_leaves_room_to_decode(model):
    _, cache = model.prefill(np.ones((1, 5), np.int32))
    assert cache.max_len == 5 + 256


@pytest.mark.parametrize("tokens,message", [
    (np.array([[1, 2, CFG.vocab_size]]), rf"token id {CFG.vocab_size} at index \(0, 2\) is outside the vocabulary"),
    (np.array([[1, -3]]), r"token id -3 at index \(0, 1\) is outside"),
    (np.array([1, 2]), "tokens must be an integer array of rank 2"),
    (np.array([[1.0, 2.0]]), "tokens must be an integer array of rank 2"),
])
def test_bad_tokens(model, tokens, message):
    with pytest.raises(ValueError, match=message):
        model.forward(tokens)


@pytest.mark.parametrize("lengths,message", [
    ([3, 7], r"lengths \[3, 7\] must be within \[1, 6\]"),
    ([0, 2], r"lengths \[0, 2\] must be within"),
    ([3], "lengths must be 2 integers"),
])
def test_bad_lengths(model, lengths, message):
    with pytest.raises(ValueError, match=message):
        model.prefill(np.ones((2, 6), np.int32), lengths)


def test_bad_max_len(model):
    with pytest.raises(ValueError, match="max_len=4 must be at least the prompt length 6"):
        model.prefill(np.ones((1, 6), np.int32), max_len=4)
    with pytest.raises(ValueError, match=f"at most max_position_embeddings={CFG.max_position_embeddings}"):
        model.prefill(np.ones((1, 6), np.int32), max_len=CFG.max_position_embeddings + 1)


@pytest.mark.slow
def test_decode_errors(model):
    _, cache = model.prefill(np.ones((2, 3), np.int32), max_len=4)
    with pytest.raises(ValueError, match="decode got 3 tokens for a cache of batch 2"):
        model.decode(cache, [1, 2, 3])
    with pytest.raises(ValueError, match=rf"token id {CFG.vocab_size} at index \(1,\)"):
        model.decode(cache, [1, CFG.vocab_size])
    _, cache = model.decode(cache, [1, 2])
    with pytest.raises(ValueError, match="cache is full: a row has length 4 = max_len 4"):
        model.decode(cache, [1, 2])


def test_mesh_must_match_devices():
    with pytest.raises(ValueError, match="mesh axis expert=3 does not divide the 1 devices"):
        dsr1.make_mesh(expert=3)
    with pytest.raises(ValueError, match="mesh expert=1 x tensor=1 does not match the 2 devices"):
        dsr1.make_mesh(expert=1, tensor=1, devices=jax.devices() * 2)


@pytest.mark.slow
def test_bf16_weights_read_like_arrays():
    """On CPU a bf16 model holds its matrices as `Bf16Bits` (see `dsr1.cpu.layouts`); what a user reads
    of a weight (shape, dtype, size, sharding, this process's shards, its values) is the bf16 array's."""
    model = dsr1.init_random(TINY, seed=0)
    gate = model.params["moe_layers"]["moe"]["gate"]
    assert gate.dtype == jnp.bfloat16 and gate.ndim == len(gate.shape) and gate.size == np.prod(gate.shape)
    assert gate.addressable_shards[0].data.shape == gate.sharding.shard_shape(gate.shape)
    assert np.asarray(gate).dtype == jnp.bfloat16 and np.asarray(gate).shape == gate.shape


@pytest.mark.parametrize("rows", [1, 3])
def test_large_bf16_matmul_widens_in_column_blocks(rows):
    """A bf16 weight on one device larger than `WIDEN_CHUNK_ELEMENTS` is widened a block of output
    columns at a time (its float32 copy would go to memory and back); the product equals widening it
    whole, a partial last block included."""
    import jax

    from dsr1.core import products, quant  # noqa: F401
    from dsr1.cpu import layouts  # noqa: F401
    from dsr1.cpu import products as cpu_products  # noqa: F401

    rng = np.random.default_rng(rows)
    cols = 3 * (cpu_products.WIDEN_CHUNK_ELEMENTS // 256) + 200  # three whole blocks of 256 rows, and a tail
    w = jnp.asarray(rng.standard_normal((256, cols)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, rows, 256)), jnp.float32)
    bits = layouts.as_bits(w)
    assert bits.one_device and cpu_products._is_matmul("...d,dv->...v")
    assert not cpu_products._is_matmul("bthn,hnr->bthr")
    product = jax.jit(lambda x, w: products.einsum("...d,dv->...v", x, w, preferred_element_type=jnp.float32))
    assert "while" in product.lower(x, bits).as_text()  # the loop over column blocks
    # Sharded weights (several devices) are widened whole: a block of a sharded axis would gather them.
    assert "while" not in product.lower(x, layouts.Bf16Bits(bits.bits)).as_text()
    got = product(x, bits)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert got.shape == (2, rows, cols)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def _expected_products(kernel: bool, rows_traced: tuple[int, ...], kernel_rows: int) -> dict[str, list[int]]:
    """Which products read the transposed copy: with the kernel up to `KERNEL_ROWS` rows, else one row
    (no expert loop here: none of its fused products)."""
    fused = {"swiglu_rows_dot": [], "combine_rows_dot": [], "swiglu_pairs": [], "combine_pairs": []}
    if kernel:
        return {"rowwise_matmul": [], "kernel_matmul": [r for r in rows_traced if r <= kernel_rows], **fused}
    return {"rowwise_matmul": [r for r in rows_traced if r == 1], "kernel_matmul": [], **fused}


@pytest.mark.slow
def test_output_heads_keep_a_copy_for_few_rows(cpu_kernel, monkeypatch):
    """With dsr1's CPU backend the lm_head (and an MTP head) also holds its bits transposed, which
    products of up to `KERNEL_ROWS` rows read; products of more rows widen the bf16 bits. Without it
    the heads are plain bf16 arrays (no second form). All give the float32 product of the bf16 values."""
    from dsr1.core import products, quant  # noqa: F401
    from dsr1.cpu import layouts  # noqa: F401
    from dsr1.cpu import products as cpu_products  # noqa: F401
    from dsr1.cpu.ffi import KERNEL_ROWS

    cfg = dataclasses.replace(TINY, num_nextn_predict_layers=1)
    model = dsr1.init_random(cfg, seed=0, mtp=True)
    head, mtp_head = model.params["lm_head"], model.params["mtp"]["head"]
    if not cpu_kernel:
        assert isinstance(head, jax.Array) and head.dtype == jnp.bfloat16 and head.nbytes == head.size * 2
        assert isinstance(mtp_head, jax.Array)
        return
    assert isinstance(head, layouts.Bf16Bits) and mtp_head.transposed is not None
    np.testing.assert_array_equal(np.asarray(head.transposed), np.asarray(head.bits).T)
    assert head.nbytes == head.size * 4 and head.bytes_read(1) == head.size * 2
    assert head.bytes_read(2) == head.size * 2
    product = jax.jit(lambda x, w: products.einsum("...d,dv->...v", x, w, preferred_element_type=jnp.float32))
    rng = np.random.default_rng(0)
    for rows in (1, 2, KERNEL_ROWS, KERNEL_ROWS + 1):
        x = jnp.asarray(rng.standard_normal((rows, 1, head.shape[0])), jnp.float32)
        program = product.lower(x, head).as_text()
        reads_copy = rows <= KERNEL_ROWS
        assert ("shift_left" in program) != reads_copy  # bits widened only where the copy is not read
        assert ("dsr1_rows_dot_bf16" in program) == reads_copy
        want = np.asarray(x, np.float64) @ np.asarray(head, np.float64)
        np.testing.assert_allclose(np.asarray(product(x, head)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_matrices_keep_transposed_bits_for_few_rows(cpu_kernel, monkeypatch):
    """With dsr1's CPU backend the bf16 matrices that products contract over their second-to-last axis
    (the routed experts, the dense and shared MLPs, `q_a`, `kv_a`, the lm_head) also hold their bits
    transposed (the attention weights a copy laid out for their decode products); products of up to
    `KERNEL_ROWS` rows read that copy (`cpu_products.kernel_matmul`), more rows read the bits, and all
    give the float32 product of the bf16 values. Without the backend no weight holds a copy."""
    import jax

    from dsr1.core import products, quant  # noqa: F401
    from dsr1.cpu import layouts  # noqa: F401
    from dsr1.cpu import products as cpu_products  # noqa: F401
    from dsr1.cpu.ffi import KERNEL_ROWS

    params = dsr1.init_random(TINY, seed=0).params
    if not cpu_kernel:
        assert all(isinstance(w, jax.Array) for w in jax.tree.leaves(params, is_leaf=layouts.is_laid))
        return
    layers = params["moe_layers"]
    kept = {name: w.transposed is not None for name, w in (("kv_a", layers["kv_a"]), ("q_a", layers["q_a"]),
                                                          ("shared up", layers["moe"]["shared"]["up"]),
                                                          ("experts", layers["moe"]["down"]),
                                                          ("dense mlp", params["dense_layers"]["mlp"]["down"]),
                                                          ("q_b", layers["q_b"]), ("o", layers["o"]),
                                                          ("wk_b", layers["wk_b"]), ("lm_head", params["lm_head"]),
                                                          ("embed", params["embed"]))}
    assert kept == {"kv_a": True, "q_a": True, "shared up": True, "experts": True, "dense mlp": True,
                    "q_b": cpu_kernel, "o": cpu_kernel, "wk_b": cpu_kernel, "lm_head": cpu_kernel, "embed": False}
    # (the attention weights' copies are laid out for their decode products: tests/test_cpu_kernels.py)
    w = jax.tree.map(lambda a: a[0], layers["moe"]["shared"]["down"])
    np.testing.assert_array_equal(np.asarray(w.transposed), np.asarray(w.bits).T)
    assert w.nbytes == 2 * w.bits.nbytes and w.bytes_read(1) == w.bits.nbytes
    # A program given bf16 arrays would transpose them on every call: no copy there.
    traced = jax.jit(lambda a: layouts.as_bits(a, keep_transposed=True))(jnp.asarray(w, jnp.bfloat16))
    assert traced.transposed is None
    calls = count_products(monkeypatch, cpu_products)
    rng = np.random.default_rng(0)
    all_rows = (1, 2, KERNEL_ROWS, KERNEL_ROWS + 1)
    for rows in all_rows:
        x = jnp.asarray(rng.standard_normal((rows, 1, w.shape[0])), jnp.float32)
        got = jax.jit(lambda x, w: products.einsum("...d,dv->...v", x, w, preferred_element_type=jnp.float32))(x, w)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert calls == _expected_products(cpu_kernel, all_rows, KERNEL_ROWS)


@pytest.mark.slow
def test_int8_matrices_keep_transposed_values_for_few_rows(cpu_kernel, monkeypatch):
    """The same for int8 weights: the matrices of `x @ W` products also hold their int8 values
    transposed (`layouts.with_transposed`; the other weights not), products multiply against that copy
    with the kernel (of any number of rows, `Int8Rows.kernel_reads`) and scale their output, and all
    forms equal the float64 product of `q * scale`. Without the backend: plain `Int8Weight`s."""
    import jax

    from dsr1.core import products, quant  # noqa: F401
    from dsr1.cpu import layouts  # noqa: F401
    from dsr1.cpu import products as cpu_products  # noqa: F401
    from dsr1.cpu.ffi import KERNEL_ROWS

    layers = dsr1.init_random(TINY, seed=0, dtype="float32", quant="int8").params["moe_layers"]
    if not cpu_kernel:
        assert all(type(w) is quant.Int8Weight for w in (layers["q_a"], layers["moe"]["gate"]))
        return
    kept = {name: layers[name].transposed is not None for name in ("q_a", "kv_a", "q_b", "o")}
    assert kept == {"q_a": True, "kv_a": True, "q_b": False, "o": False}
    assert layers["q_a"].one_device
    w = jax.tree.map(lambda a: a[0], layers["moe"]["shared"]["down"])
    np.testing.assert_array_equal(np.asarray(w.transposed), np.asarray(w.q).T)
    assert w.nbytes == 2 * w.q.nbytes + w.scale.nbytes and w.bytes_read(1) == w.q.nbytes + w.scale.nbytes
    assert layouts.with_transposed(w) is w  # idempotent
    traced = jax.jit(lambda q, s: layouts.with_transposed(quant.Int8Weight(q, s)))(w.q, w.scale)
    assert traced.transposed is None  # a program given int8 arrays would transpose them on every call
    calls = count_products(monkeypatch, cpu_products)
    rng = np.random.default_rng(0)
    dequantized = np.asarray(w.q, np.float64) * np.asarray(w.scale, np.float64)
    all_rows = (1, 2, KERNEL_ROWS, KERNEL_ROWS + 1)
    for rows in all_rows:
        x = jnp.asarray(rng.standard_normal((rows, 1, w.shape[0])), jnp.float32)
        got = jax.jit(lambda x, w: products.einsum("...d,dv->...v", x, w, preferred_element_type=jnp.float32))(x, w)
        np.testing.assert_allclose(np.asarray(got), np.asarray(x, np.float64) @ dequantized, rtol=1e-5, atol=1e-5)
    assert calls == _expected_products(cpu_kernel, all_rows, max(all_rows))


@pytest.mark.slow
def test_bf16_products_of_many_rows_compute_in_bf16():
    """On CPU a product of at least `NATIVE_BF16_ROWS` rows (4x that for a weight widened in blocks) is
    a bf16 dot with the activations rounded to bf16, as GPU and TPU compute it; fewer rows widen the
    weight and keep float32 activations. Both equal the float64 product of what they compute."""
    import jax

    from dsr1.core import moe, products, quant  # noqa: F401
    from dsr1.cpu import layouts  # noqa: F401
    from dsr1.cpu import products as cpu_products  # noqa: F401

    rng = np.random.default_rng(0)
    small = layouts.as_bits(jnp.asarray(rng.standard_normal((64, 96)), jnp.bfloat16))
    large = layouts.as_bits(jnp.asarray(rng.standard_normal((256, cpu_products.WIDEN_CHUNK_ELEMENTS // 256 + 1)),
                                        jnp.bfloat16))
    n = cpu_products.NATIVE_BF16_ROWS
    assert [cpu_products.native_bf16(small, r) for r in (n - 1, n)] == [False, True]
    assert [cpu_products.native_bf16(large, r) for r in (4 * n - 1, 4 * n)] == [False, True]
    assert not cpu_products.native_bf16(jnp.zeros((64, 96), jnp.bfloat16), n)  # GPU/TPU arrays: native already
    for rows in (n - 1, n):
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
        for name, product in (("einsum", lambda x, w: products.einsum("...d,dv->...v", x, w,
                                                                   preferred_element_type=jnp.float32)),
                              ("expert block", lambda x, w: moe._expert_matmul(
                                  x, jax.tree.map(lambda a: a[None, None], w), jnp.int32(0), jnp.int32(0)))):
            hlo = jax.jit(product).lower(x, small).as_text()
            assert ("bf16" in hlo.split("dot_general")[1].split("\n")[0]) == (rows >= n), (name, rows)
            lhs = np.asarray(x.astype(jnp.bfloat16) if rows >= n else x, np.float64)
            want = lhs @ np.asarray(small, np.float64)
            np.testing.assert_allclose(np.asarray(jax.jit(product)(x, small)), want, rtol=1e-5, atol=1e-4)



@pytest.fixture(scope="module")
def demo():
    return dsr1.load(dsr1.demo_checkpoint(), progress=False)


@pytest.mark.slow
def test_a_loaded_model_carries_its_checkpoint_tokenizer(demo):
    """The demo folder's own 4,096-token BPE comes with the model and is the default of `generate` and
    the serving engine: its text continues in English, not R1's ids read as the demo vocabulary's."""
    assert demo.tokenizer is not None and demo.tokenizer.vocab_size == demo.cfg.vocab_size == 4096
    prompt = "To be, or not to be,"
    c = dsr1.generate(demo, [prompt], max_new_tokens=16).completions[0]
    assert c.prompt_tokens == len(demo.tokenizer.encode(prompt, add_bos=True))
    # The text shown is the demo tokenizer's decode without special tokens and <think> markers.
    shown = visible_text(demo.tokenizer.decode(c.tokens, skip_special_tokens=True), thinking=False)
    assert c.text == shown and c.text.isascii()
    words = c.text.split()
    assert len(words) >= 3 and sum(w.strip(",.;:!?'").isalpha() for w in words) >= len(words) - 1, c.text
    assert dsr1.serving.Engine(demo, num_pages=8).tokenizer is demo.tokenizer


@pytest.mark.slow
def test_r1_tokenizer_is_the_default_without_one_and_is_refused_by_a_smaller_vocabulary(demo, model, tmp_path):
    """Random weights and folders without a tokenizer.json use R1's tokenizer; a model whose vocabulary
    cannot hold R1's ids refuses it with a clear error instead of generating noise."""
    from dsr1.generation.tokenizer import checkpoint_tokenizer
    from dsr1.weights.convert import convert

    assert model.tokenizer is None and checkpoint_tokenizer(tmp_path) is None
    assert checkpoint_tokenizer(dsr1.demo_checkpoint() / "config.json").vocab_size == 4096
    converted = convert(dsr1.demo_checkpoint(), tmp_path / "converted", progress=False)
    assert checkpoint_tokenizer(converted).vocab_size == 4096  # a converted folder keeps the release's tokenizer
    bare = dataclasses.replace(demo, tokenizer=None)  # what a folder without tokenizer.json loads as
    with pytest.raises(ValueError, match="tokenizer has 128815 token ids but the model's vocabulary holds 4096"):
        dsr1.generate(bare, ["To be, or not to be,"], max_new_tokens=2)
    ids = dsr1.generate(bare, [[0, 5, 6]], max_new_tokens=2).completions[0]
    assert ids.text == "" and len(ids.tokens) == 2  # token ids in, token ids out
    assert dsr1.generate(model, ["Hi"], max_new_tokens=2).completions[0].prompt_tokens == 2  # R1's BOS + "Hi"


@pytest.mark.slow
def test_demo_chat_shows_no_reasoning_markers(demo):
    """The demo model answers R1's chat template inside a `<think>` block it closes: the streamed and
    the final text show its reasoning and answer without the markers (never a bare `</think>`)."""
    pieces: list[str] = []
    result = dsr1.generate(demo, ["Good morrow, my lord. What news from the court?"], chat=True, max_new_tokens=24,
                           chunk_size=4, stream=lambda row, text: pieces.append(text))
    c = result.completions[0]
    assert "</think>" in demo.tokenizer.decode(c.tokens) and "think>" not in c.text
    assert "".join(pieces) == c.text == "\n\n".join(part for part in (c.reasoning, c.answer) if part)
