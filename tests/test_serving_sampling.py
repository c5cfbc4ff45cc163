"""The sampling parameters a vLLM client sends, honoured by `dsr1.generate` and the serving engine
alike (token rules on device, grammar masks from llguidance, prompt log-probabilities from prefill).

The tiny random model in float32 checks the token rules and prompt log-probabilities against
`generate` and `Model.forward`; the demo model (its own tokenizer, an MTP module) checks JSON-schema
grammars, alone, mixed with free requests, and with MTP drafts.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import dsr1
from dsr1.generation.output import RowOutput
from dsr1.generation.sampling import Sampling
from dsr1.generation.tokenizer import load_tokenizer
from dsr1.serving import Engine

from .harness import TINY
from .test_serving import SHAPES, checked_engines

BUDGET = 8


@pytest.fixture(scope="module")
def tiny():
    return dsr1.init_random(TINY, seed=0, dtype="float32")


@pytest.fixture
def make_engine(tiny):
    yield from checked_engines(tiny, SHAPES)


PROMPT = [5, 17, 99, 3, 250, 42, 7, 11, 64]


def both(model, engine: Engine, sampling: Sampling, prompt=PROMPT) -> tuple[list[int], str, list[int], str]:
    """`generate`'s tokens and finish reason, then the engine's, for one greedy request."""
    done = dsr1.generate(model, [prompt], sampling=sampling).completions[0]
    request = engine.submit(prompt, sampling=sampling)
    engine.run()
    return done.tokens, done.finish_reason, request.tokens, request.finish_reason


def test_sampling_fields_are_validated_and_normalized():
    s = Sampling(logit_bias={7: 250.0, 3: -1.5}, allowed_token_ids=[9, 4, 9], bad_words_ids=[[1, 2], [5]],
                 min_tokens=3, max_new_tokens=4)
    assert s.logit_bias == ((3, -1.5), (7, 100.0))  # sorted, clipped to OpenAI's [-100, 100]
    assert s.allowed_token_ids == (4, 9) and s.bad_words_ids == ((1, 2), (5,))
    assert hash(s) == hash(Sampling(logit_bias=[(3, -1.5), (7, 300)], allowed_token_ids=(4, 9),
                                    bad_words_ids=((1, 2), (5,)), min_tokens=3, max_new_tokens=4))
    for bad, field in [(dict(min_tokens=5, max_new_tokens=4), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
                       (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={1: float("nan")}), "logit_bias"),
                       (dict(logit_bias=[1, 2]), "logit_bias"), (dict(allowed_token_ids=[-3]), "allowed_token_ids"),
                       (dict(bad_words_ids=[[]]), "bad_words_ids"), (dict(bad_words_ids=[list(range(9))]),
                                                                      "bad_words_ids"),
                       (dict(ignore_eos=1), "ignore_eos"), (dict(skip_special_tokens="no"), "skip_special_tokens")]:
        with pytest.raises(ValueError, match=field):
            Sampling(**bad)


@pytest.mark.slow
def test_token_rules_change_the_output_as_vllms_do_in_generate_and_the_engine(tiny, make_engine):
    engine = make_engine(decode_steps=2)
    free = Sampling(max_new_tokens=BUDGET)
    plain, _, served, _ = both(tiny, engine, free)
    assert plain == served and len(plain) == BUDGET
    favourite = next(t for t in range(2, 500) if t not in plain)

    # logit_bias: +100 on one token makes greedy pick it every time.
    biased = both(tiny, engine, Sampling(max_new_tokens=BUDGET, logit_bias={favourite: 100.0}))
    assert biased[0] == biased[2] == [favourite] * BUDGET

    # allowed_token_ids: every token is one of them, and the choice among them is the model's.
    allowed = (favourite, plain[1], 300)
    got = both(tiny, engine, Sampling(max_new_tokens=BUDGET, allowed_token_ids=allowed))
    assert got[0] == got[2] and set(got[0]) <= set(allowed) and plain[1] in got[0]

    # bad_words_ids: a one-token word is never sampled; a longer one's last token not after its others.
    banned = both(tiny, engine, Sampling(max_new_tokens=BUDGET, bad_words_ids=[[plain[0]]]))
    assert banned[0] == banned[2] and plain[0] not in banned[0]
    pair = both(tiny, engine, Sampling(max_new_tokens=BUDGET, bad_words_ids=[[plain[0], plain[1]]]))
    assert pair[0] == pair[2] and pair[0][0] == plain[0] and pair[0][1] != plain[1]

    # min_tokens: a stop token cannot end the output before min_tokens tokens.
    stop = plain[2]
    early = both(tiny, engine, Sampling(max_new_tokens=BUDGET, stop_token_ids=[stop]))
    assert early[0] == early[2] == plain[:2] and early[1] == early[3] == "stop"
    held = both(tiny, engine, Sampling(max_new_tokens=BUDGET, stop_token_ids=[stop], min_tokens=5))
    assert held[0] == held[2] and len(held[0]) >= 5 and stop not in held[0][:5]

    # ignore_eos: EOS made certain ends the output at once, unless ignored (then it is not masked either).
    eos = tiny.cfg.eos_token_id
    ended = both(tiny, engine, Sampling(max_new_tokens=BUDGET, logit_bias={eos: 100.0}))
    assert ended[0] == ended[2] == [] and ended[1] == ended[3] == "stop"
    ignored = both(tiny, engine, Sampling(max_new_tokens=BUDGET, logit_bias={eos: 100.0}, ignore_eos=True))
    assert ignored[0] == ignored[2] == [eos] * BUDGET and ignored[1] == ignored[3] == "length"


@pytest.mark.slow
def test_a_free_request_is_unchanged_by_neighbours_with_rules(tiny, make_engine):
    engine = make_engine()
    alone = engine.submit(PROMPT, max_new_tokens=BUDGET)
    engine.run()
    free = engine.submit(PROMPT, max_new_tokens=BUDGET)
    ruled = [engine.submit(PROMPT[::-1], sampling=Sampling(max_new_tokens=BUDGET, logit_bias={9: 5.0},
                                                           bad_words_ids=[[alone.tokens[0]]], min_tokens=3))]
    engine.run()
    assert free.tokens == alone.tokens and ruled[0].tokens[0] != alone.tokens[0]


def test_stop_strings_kept_on_request_and_special_tokens_skipped_by_default():
    tokenizer = load_tokenizer(dsr1.demo_checkpoint())
    ids = tokenizer.encode("the end. more")
    cut = RowOutput(tokenizer, Sampling(stop_strings=["end."]))
    kept = RowOutput(tokenizer, Sampling(stop_strings=["end."], include_stop_str_in_output=True))
    for row in (cut, kept):
        row.add(ids)
    assert cut.text == "the " and kept.text == "the end."
    special = [*ids, tokenizer.eos_id]
    skipped, shown = RowOutput(tokenizer, Sampling()), RowOutput(tokenizer, Sampling(skip_special_tokens=False))
    for row in (skipped, shown):
        row.add(special)
        row.finish()
    eos_text = tokenizer.decode([tokenizer.eos_id])
    assert skipped.text == "the end. more" and shown.text == "the end. more" + eos_text


@pytest.mark.slow
def test_prompt_logprobs_equal_forward_with_chunked_prefill_and_a_cached_prefix(tiny, make_engine):
    rng = np.random.default_rng(3)
    prompt = rng.integers(2, tiny.cfg.vocab_size, 21).tolist()  # three chunks of 8
    logp = np.asarray(jax.nn.log_softmax(tiny.forward(np.array([prompt]))[0], axis=-1))
    engine = make_engine()
    warm = engine.submit(prompt, max_new_tokens=2)  # its pages enter the prefix cache
    engine.run()
    first = engine.submit(prompt, max_new_tokens=2, prompt_logprobs=3)
    plain = engine.submit(prompt, max_new_tokens=2)
    engine.run()
    assert plain.cached_tokens > 0 and first.cached_tokens == 0, "the cache is bypassed only when asked"
    entries = first.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:]):
        assert entry.token == prompt[position + 1]
        assert entry.logprob == pytest.approx(logp[position, prompt[position + 1]], abs=1e-4)
        best = np.argsort(-logp[position])[:3]
        assert [t for t, _ in entry.top] == best.tolist()
        assert np.allclose([v for _, v in entry.top], logp[position, best], atol=1e-4)
    assert first.tokens == plain.tokens == warm.tokens
    assert engine.kv_cache_usage > 0 and engine.last_step_time is not None


# ---- grammars on the demo model -------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo():
    return dsr1.load(dsr1.demo_checkpoint(), dtype="float32", mtp=True), load_tokenizer(dsr1.demo_checkpoint())


def _grammar() -> str:
    llguidance = pytest.importorskip("llguidance")
    return llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})


DEMO = dict(max_seqs=4, page_size=8, num_pages=64, prefill_chunk=16, prefill_rows=2)
PROMPTS = ["To be, or not to be,", "Once upon a time", "The king said", "Friends, Romans,"]


@pytest.mark.slow
def test_json_schema_answers_validate_and_free_neighbours_are_unchanged(demo):
    jsonschema = pytest.importorskip("jsonschema")
    model, tokenizer = demo
    engine = Engine(model, tokenizer=tokenizer, **DEMO)
    alone = [engine.submit(p, max_new_tokens=12) for p in PROMPTS[:2]]
    engine.run()
    grammar = _grammar()
    mixed = [engine.submit(p, max_new_tokens=40, grammar=grammar) for p in PROMPTS]
    free = [engine.submit(p, max_new_tokens=12) for p in PROMPTS[:2]]
    engine.run()
    for request in mixed:
        jsonschema.validate(json.loads(request.text), SCHEMA)
        assert request.finish_reason == "stop"
    assert [r.tokens for r in free] == [r.tokens for r in alone]
    engine.check()


@pytest.mark.extended
def test_constrained_decoding_with_drafts_equals_without(demo):
    model, tokenizer = demo
    grammar = _grammar()
    outputs = []
    for draft_tokens in (0, 1):
        engine = Engine(model, tokenizer=tokenizer, draft_tokens=draft_tokens, **DEMO)
        requests = [engine.submit(p, max_new_tokens=40, grammar=grammar) for p in PROMPTS[:2]]
        requests.append(engine.submit(PROMPTS[2], max_new_tokens=12))
        engine.run()
        outputs.append([r.tokens for r in requests])
    assert outputs[0] == outputs[1]
