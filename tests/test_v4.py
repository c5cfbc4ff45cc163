"""DeepSeek-V4 (`dsr1.core.model_v4`) in exact float32 against a transcription of the official inference
code (`tests/reference_v4.py`) and transformers' token-by-token path, on tiny random configs holding
every attention kind (window, CSA, HCA), hash and top-k MoE and 2-4 mHC streams, with sequences of 3-6
windows and index_topk below the entries; its prefill in chunks crossing windows and its decode against
its own whole-sequence forward; its config reading."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsr1 import Config, ConfigError
from dsr1.core import model_v4
from dsr1.core.moe import route
from dsr1.core.sharding import DEFAULT_RULES, make_mesh
from dsr1.programs import model_v4 as programs

from . import reference_v4
from .harness import MIN_ROUTING_MARGIN, TOLERANCE, relative_error

PRO = Path(__file__).parents[2] / "shared" / "reference" / "deepseek-v4-pro" / "config.json"
LENGTHS = np.array([48, 37], np.int32)
MIN_INDEX_MARGIN = 1e-4  # an indexer score gap at the top-k boundary below which float32 may flip a choice


@dataclasses.dataclass(frozen=True)
class V4Fixture:
    name: str
    cfg: Config
    params: dict  # jax arrays, dsr1's layout
    tokens: np.ndarray  # [2, 48], row 1 right-padded with 0
    official: list[np.ndarray]  # per row: the transcription's logits [n, V]
    hf: np.ndarray  # row 0: HF's token-by-token logits [48, V]
    seed: int
    margins: reference_v4.Margins


def build(name: str) -> V4Fixture:
    """The first seed whose routing and index margins (on the official transcription) are safe."""
    cfg = reference_v4.config(name)
    for seed in range(12):
        params = reference_v4.random_params(cfg, seed)
        tokens = np.random.default_rng(3000 + seed).integers(2, cfg.vocab_size, (2, LENGTHS.max())).astype(np.int32)
        tokens[1, LENGTHS[1]:] = 0
        state, margins = reference_v4.official_state(cfg, params), reference_v4.Margins()
        official = [reference_v4.official_logits(cfg, state, tokens[r:r + 1, :n], margins)[0]
                    for r, n in enumerate(LENGTHS)]
        if margins.routing < MIN_ROUTING_MARGIN or margins.index < MIN_INDEX_MARGIN:
            continue
        hf = reference_v4.hf_token_by_token(reference_v4.hf_model(cfg, params), tokens[0].tolist())
        return V4Fixture(name, cfg, jax.tree.map(jnp.asarray, params), tokens, official, hf, seed, margins)
    raise RuntimeError(f"{name}: no seed gave safe routing and index margins")


@pytest.fixture(scope="module", params=["all_kinds", pytest.param("hca_first", marks=pytest.mark.extended)])
def v4(request) -> V4Fixture:
    return build(request.param)


MESH = dict(mesh=make_mesh(1, 1), rules=DEFAULT_RULES)


@pytest.mark.slow
def test_forward_matches_official_and_hf_token_by_token(v4):
    """Every position of both rows within 1e-4 of the official transcription, and of HF's token-by-token path."""
    logits = np.asarray(programs.forward(v4.params, jnp.asarray(v4.tokens), jnp.asarray(LENGTHS), cfg=v4.cfg, **MESH))
    vs_official = [relative_error(logits[r, :n], v4.official[r]) for r, n in enumerate(LENGTHS)]
    vs_hf = relative_error(logits[0], v4.hf)
    print(f"\n[{v4.name}] forward: vs official {max(vs_official):.1e}, vs HF token by token {vs_hf:.1e} "
          f"(seed {v4.seed}, {v4.margins})")
    assert max(vs_official) <= TOLERANCE and vs_hf <= TOLERANCE
    assert relative_error(v4.hf, v4.official[0]) <= TOLERANCE  # the two references agree with each other


# 48 positions fed in chunks crossing windows (8, 12) and entries mid-chunk, with decode steps between:
# two sizes in CI's tier, four more on the extended config.
CHUNKS = {"all_kinds": (5, 1) * 8, "hca_first": (7, 13, 1, 1, 13, 7, 1, 5)}


def _fed_in_chunks(v4: V4Fixture, sizes) -> np.ndarray:
    """Logits `[2, 48, V]` of the rows fed `sizes` tokens at a time (row 1's padding not counted)."""
    cache, out, at = model_v4.init_cache(v4.cfg, 2, int(LENGTHS.max())), [], 0
    for size in sizes:
        counts = np.clip(LENGTHS - at, 0, size).astype(np.int32)
        logits, cache = programs.extend(v4.params, cache, jnp.asarray(v4.tokens[:, at:at + size]), jnp.asarray(counts),
                                        cfg=v4.cfg, **MESH)
        out.append(np.asarray(logits))
        at += size
    assert np.array_equal(np.asarray(cache.lengths), LENGTHS)
    return np.concatenate(out, axis=1)


@pytest.mark.slow
def test_prefill_in_chunks_and_decode_equal_whole_prefill(v4):
    """Chunks of several sizes and decode steps (1 token) between them, crossing windows and entries
    anywhere, give the whole-sequence forward's logits at every position of both rows."""
    whole = np.asarray(programs.forward(v4.params, jnp.asarray(v4.tokens), jnp.asarray(LENGTHS), cfg=v4.cfg, **MESH))
    chunked = _fed_in_chunks(v4, CHUNKS[v4.name])
    errors = [relative_error(chunked[r, :n], whole[r, :n]) for r, n in enumerate(LENGTHS)]
    print(f"\n[{v4.name}] chunked prefill and decode: {max(errors):.1e} of the whole prefill")
    assert max(errors) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.extended
def test_greedy_equals_hf_token_by_token_greedy(v4):
    """A 6-token prompt continued by 20 greedy tokens (26 positions: 2-3 windows, entries of both kinds)."""
    prompt = v4.tokens[0, :6]
    expected = reference_v4.hf_greedy_token_by_token(reference_v4.hf_model(v4.cfg, jax.tree.map(np.asarray, v4.params)),
                                                     prompt.tolist(), 20)
    logits, cache = programs.prefill(v4.params, jnp.asarray(prompt[None]), jnp.array([6]), cfg=v4.cfg, max_len=32,
                                     **MESH)
    got = []
    for _ in range(20):
        got.append(int(np.argmax(np.asarray(logits)[0])))
        logits, cache = programs.decode(v4.params, cache, jnp.array([got[-1]], jnp.int32), cfg=v4.cfg, **MESH)
    assert got == expected


@pytest.mark.slow
@pytest.mark.extended
def test_mtp_matches_official(v4):
    """The MTP module on the model's own streams, each position with the next token: within 1e-4 of the
    official `MTPBlock` at every position of both rows, whole and in two chunks (its window crossed)."""
    if not v4.cfg.num_nextn_predict_layers:
        pytest.skip("the MTP module runs on the config that has one")
    np_params = reference_v4.random_params(v4.cfg, v4.seed, mtp=True)
    params, state = jax.tree.map(jnp.asarray, np_params), reference_v4.official_state(v4.cfg, np_params)
    n, last = LENGTHS - 1, int(LENGTHS.max()) - 1
    streams, _ = programs.streams(params, model_v4.init_cache(v4.cfg, 2, last), jnp.asarray(v4.tokens[:, :last]),
                                  jnp.asarray(n), cfg=v4.cfg, **MESH)
    official = []
    for r in range(2):
        _, h = reference_v4.official_logits(v4.cfg, state, v4.tokens[r:r + 1, :n[r]], streams=True)
        official.append(reference_v4.official_mtp_logits(v4.cfg, state, h, v4.tokens[r:r + 1, 1:n[r] + 1])[0])
    fed, cache = [], None
    for a, b in ((0, last), (0, 20), (20, last)):
        cache = model_v4.init_mtp_cache(v4.cfg, 2, last) if a == 0 else cache
        logits, cache = programs.mtp_extend(params, cache, streams[:, a:b], jnp.asarray(v4.tokens[:, a + 1:b + 1]),
                                            jnp.asarray(np.clip(n - a, 0, b - a).astype(np.int32)), cfg=v4.cfg, **MESH)
        fed.append(np.asarray(logits))
    whole, chunked = fed[0], np.concatenate(fed[1:], axis=1)
    errors = [relative_error(got[r, :n[r]], official[r]) for got in (whole, chunked) for r in range(2)]
    print(f"\n[{v4.name}] MTP: vs official {max(errors):.1e}")
    assert max(errors) <= TOLERANCE


# ---- config and routing (quick) ---------------------------------------------------------------------

def test_release_config_reads_every_v4_field():
    if not PRO.exists():
        pytest.skip("../shared reference not present")
    cfg = Config.from_hf(PRO)
    assert cfg.compressed_attention and not cfg.sparse_attention
    assert (cfg.head_dim, cfg.o_groups, cfg.o_lora_rank, cfg.sliding_window, cfg.hc_mult) == (512, 16, 1024, 128, 4)
    assert cfg.compress_ratios[:3] == (128, 128, 4) and len(cfg.compress_ratios) == 62 and cfg.compress_ratios[-1] == 0
    assert (cfg.index_topk, cfg.num_hash_layers, cfg.swiglu_limit, cfg.scoring_func) == (1024, 3, 10.0, "sqrtsoftplus")
    assert (cfg.rope_theta, cfg.compress_rope_theta, cfg.rope_scaling.factor) == (10000.0, 160000.0, 16.0)
    assert Config.from_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("name", sorted(reference_v4.CONFIGS))
def test_hf_fields_read_back(name):
    """transformers' V4 fields (`layer_types`, `compress_rates`, `mlp_layer_types`) give the same config."""
    cfg = reference_v4.config(name)
    raw = cfg.to_hf_dict()
    del raw["compress_ratios"], raw["num_hash_layers"]
    assert Config.from_dict(raw) == cfg


@pytest.mark.parametrize("field, value, message", [
    ("scoring_func", "softmax", "scoring_func='softmax' is not supported"),
    ("num_key_value_heads", 2, "num_key_value_heads=2 is not supported"),
    ("compress_ratios", [0, 4], "compress_ratios has 2 entries"),
    ("compress_ratios", [0, 8, 16, 4], "several HCA ratios"),
    ("o_groups", 3, "o_groups=3 must divide num_attention_heads=4"),
    ("index_topk", None, "missing field 'index_topk'"),
    ("n_shared_experts", 2, "n_shared_experts=2 is not supported"),
])
def test_unsupported_fields_name_the_field(field, value, message):
    raw = {**reference_v4.CONFIGS["all_kinds"], field: value}
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        Config.from_dict(raw, source="v4/config.json")


@pytest.mark.slow
@pytest.mark.extended
def test_every_expert_kernel_clamps_swiglu():
    """The SwiGLU clamp (gate <= limit, up in [-limit, limit]) in every routed-expert kernel, as NumPy computes it."""
    from dsr1.core import moe

    rng = np.random.default_rng(1)
    n, d, f, e, k, limit = 6, 8, 4, 5, 2, 0.5
    p = {name: jnp.asarray(3 * rng.standard_normal(shape), jnp.float32)
         for name, shape in (("gate", (e, d, f)), ("up", (e, d, f)), ("down", (e, f, d)))}
    x = rng.standard_normal((n, d)).astype(np.float32)
    experts = np.stack([rng.permutation(e)[:k] for _ in range(n)]).astype(np.int32)
    weights = rng.random((n, k)).astype(np.float32)
    want = np.zeros((n, d), np.float32)
    for i in range(n):
        for j in range(k):
            g, u = x[i] @ np.asarray(p["gate"][experts[i, j]]), x[i] @ np.asarray(p["up"][experts[i, j]])
            g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            want[i] += weights[i, j] * ((g / (1 + np.exp(-g)) * u) @ np.asarray(p["down"][experts[i, j]]))
    for kernel in (moe.loop_experts, moe.ragged_experts, moe.dense_experts, moe.gather_experts, moe.capacity_experts):
        got = moe.routed_experts(p, jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts), MESH["mesh"],
                                 MESH["rules"], kernel=kernel, limit=limit)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5, err_msg=kernel.__name__)


def test_mla_configs_write_no_v4_fields():
    """An R1 or V3.2 config.json written by dsr1 holds none of V4's fields (transformers' V3 would read `head_dim`)."""
    from dsr1.core.config import V4_FIELDS

    for name in ("deepseek-r1", "tiny-v3.2"):
        d = Config.preset(name).to_hf_dict()
        assert not {"compress_ratios", *V4_FIELDS} & set(d) and d["scoring_func"] == "sigmoid"


def test_model_api_refuses_v4_clearly(tmp_path):
    """`dsr1.load` and `init_random` name the config instead of failing inside MLA's code."""
    import dsr1

    (tmp_path / "config.json").write_text(json.dumps(reference_v4.CONFIGS["all_kinds"]))
    with pytest.raises(ConfigError, match="DeepSeek-V4 .* is not served by dsr1.Model yet"):
        dsr1.load(tmp_path, progress=False)
    with pytest.raises(ConfigError, match="init_random: DeepSeek-V4"):
        dsr1.init_random(reference_v4.config("all_kinds"))


def test_hash_routing_and_sqrtsoftplus_scores():
    """Hash layers take their table's experts and weight them by the router's normalised
    `sqrt(softplus)` scores; top-k layers choose on the scores plus the bias."""
    cfg = reference_v4.config("all_kinds")
    rng = np.random.default_rng(0)
    x, router = rng.standard_normal((5, cfg.hidden_size)), rng.standard_normal((cfg.hidden_size, cfg.n_routed_experts))
    scores = np.sqrt(np.log1p(np.exp(x @ router)))
    table = np.array([[1, 6]] * 5, np.int32)
    weights, experts = route(jnp.asarray(x, jnp.float32), jnp.asarray(router, jnp.float32), None, cfg,
                             hashed=jnp.asarray(table))
    want = scores[:, [1, 6]] / scores[:, [1, 6]].sum(-1, keepdims=True) * cfg.routed_scaling_factor
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-5)
    assert np.array_equal(np.asarray(experts), table)
    bias = np.zeros(cfg.n_routed_experts, np.float32)
    bias[3] = 100.0
    _, chosen = route(jnp.asarray(x, jnp.float32), jnp.asarray(router, jnp.float32), jnp.asarray(bias), cfg)
    assert (np.asarray(chosen) == 3).any(-1).all()
    assert json.dumps(cfg.to_hf_dict())  # a V4 config writes as JSON
    assert cfg.hca_ratio == 8 and dataclasses.replace(cfg, compress_ratios=(0, 4, 2, 4, 0)).hca_ratio == 2
