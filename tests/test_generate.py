"""dsr1.generate: greedy equals HF generate, seeded sampling, stop conditions, streaming, reasoning."""

from __future__ import annotations

import pytest

import dsr1
from dsr1.generation.batch import generate, split_reasoning
from dsr1.generation.sampling import Sampling
from dsr1.generation.tokenizer import Tokenizer, load_tokenizer

NEW_TOKENS = 24


def hf_greedy(folder, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch
    import transformers
    from transformers import DeepseekV3ForCausalLM

    transformers.logging.set_verbosity_error()
    model = DeepseekV3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=1,
                                 pad_token_id=0)[0, len(p):].tolist()
            out.append(ids[: ids.index(1)] if 1 in ids else ids)  # EOS ends a row; it is not output
    return out


@pytest.fixture(scope="module")
def prompts(all_fixtures):
    fx = all_fixtures["grouped_qlora"]
    return [fx.tokens[r, :n].tolist()[:m] for r, (n, m) in enumerate(zip(fx.lengths, (31, 12, 5)))]


@pytest.mark.slow
def test_greedy_equals_hf_generate(fixture, prompts):
    expected = hf_greedy(fixture.folder, prompts, NEW_TOKENS)
    for kv_cache_dtype in (None, "int8"):
        model = dsr1.load(fixture.folder, dtype="float32", kv_cache_dtype=kv_cache_dtype, progress=False)
        result = generate(model, prompts, max_new_tokens=NEW_TOKENS, chunk_size=5)
        got = [c.tokens for c in result.completions]
        same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
        first_diff = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None) for g, e in zip(got, expected)]
        print(f"\n[{fixture.name}] greedy vs HF generate, cache {kv_cache_dtype or 'float32'}: {same} of "
              f"{sum(map(len, expected))} tokens equal; first difference per row: {first_diff}")
        if kv_cache_dtype is None:
            assert got == expected
            for c, e in zip(result.completions, expected):
                assert c.finish_reason == ("stop" if len(e) < NEW_TOKENS else "length")


@pytest.fixture(scope="module")
def tiny():
    return dsr1.init_random(dsr1.Config.preset("tiny"), seed=0, dtype="float32")


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_row_independent(tiny):
    s = Sampling(temperature=1.0, top_p=0.95, seed=7)
    a = generate(tiny, [[5, 6, 7, 8]], max_new_tokens=12, sampling=s).completions[0].tokens
    b = generate(tiny, [[5, 6, 7, 8]], max_new_tokens=12, sampling=s).completions[0].tokens
    batch = generate(tiny, [[9, 9, 9], [5, 6, 7, 8]], max_new_tokens=12,
                     sampling=[Sampling(temperature=0.7, seed=1), s]).completions
    other = generate(tiny, [[5, 6, 7, 8]], max_new_tokens=12, sampling=Sampling(temperature=1.0, top_p=0.95, seed=8))
    assert a == b == batch[1].tokens
    assert other.completions[0].tokens != a


@pytest.mark.slow
def test_rows_stop_on_their_own_budget(tiny):
    result = generate(tiny, [[5, 6], [7, 8, 9]], sampling=[Sampling(max_new_tokens=3), Sampling(max_new_tokens=11)],
                      chunk_size=4)
    assert [len(c.tokens) for c in result.completions] == [3, 11]
    assert [c.finish_reason for c in result.completions] == ["length", "length"]


@pytest.mark.slow
def test_stop_token_ends_a_row(tiny):
    free = generate(tiny, [[5, 6, 7]], max_new_tokens=10).completions[0].tokens
    stop = free[4]
    cut = generate(tiny, [[5, 6, 7]], max_new_tokens=10, sampling=Sampling(stop_token_ids=(stop,))).completions[0]
    assert cut.tokens == free[: free.index(stop)] and cut.finish_reason == "stop"


@pytest.mark.slow
def test_stop_strings_cut_exactly_and_streaming_matches(tiny):
    prompt = "The quick brown fox"
    free = generate(tiny, [prompt], max_new_tokens=40).completions[0]
    assert len(free.text) > 30
    stop = free.text[20:24]
    streamed: list[str] = []
    result = generate(tiny, [prompt], max_new_tokens=40, sampling=Sampling(stop_strings=("zzzz-never", stop)),
                      stream=lambda row, text: streamed.append(text), chunk_size=3)
    cut = result.completions[0]
    assert cut.text == free.text[: free.text.index(stop)]
    assert cut.finish_reason == "stop"
    assert "".join(streamed) == cut.text, "the stream must never show text that a stop string later cuts"


@pytest.mark.slow
def test_streaming_multibyte_text_equals_final_text(tiny):
    pieces: dict[int, list[str]] = {0: [], 1: []}
    result = generate(tiny, ["你好，世界 🌍", "naïve café"], max_new_tokens=30, chunk_size=2,
                      sampling=Sampling(temperature=1.0, seed=3), stream=lambda r, t: pieces[r].append(t))
    for row, c in enumerate(result.completions):
        assert "".join(pieces[row]) == c.text
        assert all("\ufffd" not in p for p in pieces[row]) or "\ufffd" in c.text


@pytest.mark.slow
def test_chat_output_separates_reasoning(tiny):
    result = generate(tiny, ["Why is the sky blue?"], chat=True, max_new_tokens=8)
    c = result.completions[0]
    assert c.reasoning == c.text.strip("\n") and c.answer == ""  # the chat prompt opened <think>
    assert result.prefill_tokens == c.prompt_tokens


@pytest.mark.slow
def test_v31_thinking_switch_decides_the_reasoning_split(tiny):
    """V3.1's template: thinking on, the prompt ends `<think>` and the output is reasoning until `</think>`;
    off (its default), the prompt ends `</think>` and the output is all answer."""
    tokenizer = Tokenizer(load_tokenizer().backend, "deepseek-v3.1")
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    on, off = (generate(tiny, [ask], tokenizer=tokenizer, max_new_tokens=8,
                        chat_template_kwargs=kwargs).completions[0] for kwargs in ({"thinking": True}, None))
    assert on.reasoning == on.text.strip("\n") and on.answer == ""
    assert off.reasoning == "" and off.answer == off.text
    with pytest.raises(ValueError, match="chat_template_kwargs.thinking: the deepseek-r1 chat template has no"):
        generate(tiny, [ask], max_new_tokens=8, chat_template_kwargs={"thinking": True})


def test_split_reasoning():
    assert split_reasoning("Let me think.\n</think>\n\nBlue.", thinking=True) == ("Let me think.", "Blue.")
    assert split_reasoning("<think>\nhmm\n</think>ok", thinking=False) == ("hmm", "ok")
    assert split_reasoning("still thinking", thinking=True) == ("still thinking", "")
    assert split_reasoning("plain answer", thinking=False) == ("", "plain answer")


def test_errors(tiny):
    with pytest.raises(ValueError, match="at least one prompt"):
        generate(tiny, [])
    with pytest.raises(ValueError, match="2 Sampling settings for 1 prompts"):
        generate(tiny, [[1, 2]], sampling=[Sampling(), Sampling()])
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        generate(tiny, [[1, 2]], max_new_tokens=tiny.cfg.max_position_embeddings)
    with pytest.raises(ValueError, match="Sampling.temperature"):
        Sampling(temperature=-1)


RAW_OUTPUTS = [  # (raw text, the prompt opened <think>, the text as displayed)
    ("</think>\n\nGood morrow.", True, "Good morrow."),
    ("Let me think.\n</think>\n\nBlue.", True, "Let me think.\n\nBlue."),
    ("<think>\nhmm\n</think>ok", False, "hmm\n\nok"),
    ("\nstill thinking\n", True, "still thinking"),
    ("plain </think>answer", False, "plain answer"),
    ("<thi", False, "<thi"),
]


@pytest.mark.parametrize("raw, thinking, shown", RAW_OUTPUTS)
def test_visible_text_streams_without_markers(raw, thinking, shown):
    """Every prefix's display extends the previous one (so it can be streamed), none shows a marker,
    and the last is the completion's text."""
    from dsr1.generation.output import visible_text

    assert visible_text(raw, thinking) == shown
    previous = ""
    for end in range(len(raw) + 1):
        now = visible_text(raw[:end], thinking, final=False)
        assert now.startswith(previous) and shown.startswith(now), (raw[:end], now)
        assert "<think>" not in now and "</think>" not in now
        previous = now

