"""R1 tokenizer: chat template vs the official jinja template, round trips, streaming, loading."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from dsr1.generation.tokenizer import (
    ASSISTANT,
    BOS,
    EOS,
    USER,
    StreamDecoder,
    Tokenizer,
    load_tokenizer,
    packaged_tokenizer_json,
    render_chat,
)

# A copy of the official deepseek-ai/DeepSeek-R1 tokenizer_config.json, so the test runs without ../shared.
CONFIG = Path(__file__).parent / "data" / "deepseek-r1-tokenizer_config.json"
SHARED_CONFIG = Path(__file__).parents[2] / "shared" / "reference" / "deepseek-r1" / "tokenizer_config.json"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def official() -> dict:
    return json.loads(CONFIG.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def hf(official):
    """transformers' own tokenizer + official template: the reference rendering (text and ids)."""
    transformers = pytest.importorskip("transformers")
    # Its own backend instance: transformers may adjust the one it is given.
    backend = tokenizers.Tokenizer.from_file(str(packaged_tokenizer_json()))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=official["bos_token"]["content"],
        eos_token=official["eos_token"]["content"],
        pad_token=official["pad_token"]["content"],
        chat_template=official["chat_template"],
    )


def jinja_render(official: dict, messages: list[dict], add_generation_prompt: bool) -> str:
    """The template rendered by plain jinja2 the way transformers sets it up, but with messages as given.

    Needed for None values: transformers 5 drops None-valued keys before rendering, which makes the
    template's `message['content'] is none` branch unreachable (it then fails on the missing key).
    """
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(official["chat_template"]).render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=official["bos_token"]["content"],
        eos_token=official["eos_token"]["content"],
    )


def call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


SYS = {"role": "system", "content": "You are a helpful assistant."}
CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is 2+2?"}],
    "system_user": [SYS, {"role": "user", "content": "Hi"}],
    "only_system": [SYS],
    "two_systems_one_late": [
        SYS,
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Answer in French."},  # moved to the top, after a blank line
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "Ça va ?"},
    ],
    "multi_turn_reasoning": [
        {"role": "user", "content": "Solve x+1=3."},
        {"role": "assistant", "content": "<think>\nSubtract 1.\n</think>\n\nx = 2."},
        {"role": "user", "content": "And x+2=5?"},
        {"role": "assistant", "content": "<think>a</think>mid<think>b</think>\n\nx = 3."},  # after the last one
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "No reasoning here; <think> alone is kept."},
    ],
    "unicode_and_empty": [
        {"role": "system", "content": ""},
        {"role": "system", "content": "系统提示 🙂"},
        {"role": "user", "content": "你好，世界！👨‍👩‍👧 e\u0301 مرحبا"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "  leading and trailing spaces \n"},
    ],
    "tools": [
        SYS,
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "東京"})],
        },
        {"role": "tool", "content": '{"temp": 18}'},
        {"role": "tool", "content": '{"temp": 25}'},
        {"role": "assistant", "content": "<think>keep me</think>Paris 18, Tokyo 25."},  # reasoning kept here
        {"role": "user", "content": "And Rome?"},
        # A second tool-call message: the template (ns.is_first never resets) drops its content and its
        # <｜Assistant｜><｜tool▁calls▁begin｜> prefix; and no second <｜tool▁outputs▁begin｜> below.
        {"role": "assistant", "content": "Checking Rome.", "tool_calls": [call("get_weather", {"city": "Rome"})]},
        {"role": "tool", "content": '{"temp": 21}'},
    ],
    "tool_then_user": [
        {"role": "user", "content": "Run it"},
        {"role": "assistant", "content": "", "tool_calls": [call("run", {})]},
        {"role": "tool", "content": "ok"},
        {"role": "user", "content": "Now summarise"},  # no <｜tool▁outputs▁end｜> before this user turn
    ],
    "empty_tool_calls": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "ignored", "tool_calls": []},
    ],
    "special_strings_in_content": [{"role": "user", "content": f"say {EOS} and {USER} literally"}],
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_official(tok, hf, official, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    text = tok.render_chat(messages, add_generation_prompt=add_generation_prompt)
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == want
    assert text == jinja_render(official, messages, add_generation_prompt)
    want_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    want_ids = want_ids["input_ids"] if isinstance(want_ids, Mapping) else want_ids
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ids == list(want_ids)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1


def test_generation_prompt_and_reasoning_strip(tok):
    messages = CONVERSATIONS["multi_turn_reasoning"][:3]
    text = render_chat(messages)
    assert text.startswith(BOS + USER) and text.endswith(ASSISTANT + "<think>\n")
    assert "Subtract" not in text and f"{ASSISTANT}\n\nx = 2.{EOS}" in text
    ids = tok.apply_chat_template(messages)
    assert ids[-3:] == [tok.encode(ASSISTANT)[0], tok.think_start_id, *tok.encode("\n")]
    assert render_chat(messages, add_generation_prompt=False).endswith(USER + "And x+2=5?")
    # After tool outputs the template never adds a generation prompt, it closes the outputs instead.
    assert render_chat(CONVERSATIONS["tools"]).endswith("<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")


def test_none_values(tok, hf, official):
    # content None on a tool call: the template's `is none` branch (transformers 5 cannot render it).
    with_none = [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": None, "tool_calls": [call("f", {"a": 1})]},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": "done"},
    ]
    for agp in (True, False):
        assert render_chat(with_none, agp) == jinja_render(official, with_none, agp)
    assert f"{ASSISTANT}<｜tool▁calls▁begin｜>" in render_chat(with_none)
    # tool_calls None (OpenAI responses carry it) counts as absent, as in transformers.
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "tool_calls": None}]
    assert render_chat(plain) == hf.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\]\['role'\].*'robot'"),
        ([{"role": "user"}], r"messages\[0\]\['content'\] is missing"),
        ([SYS, {"role": "assistant", "content": None}], r"messages\[1\]\['content'\] must be a string"),
        ([{"role": "tool", "content": ["x"]}], r"messages\[0\]\['content'\] must be a string, got list"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f",
                                                               "arguments": {"a": 1}}}]}],
         r"messages\[0\]\['tool_calls'\]\[0\]\.function\.arguments must be a string"),
        ([{"role": "assistant", "content": "", "tool_calls": {"type": "function"}}],
         r"messages\[0\]\['tool_calls'\] must be a list"),
        (["user: hi"], r"messages\[0\] must be a dict"),
        ({"role": "user", "content": "hi"}, r"messages must be a list"),
    ],
)
def test_bad_messages(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_special_ids(tok, official):
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.encode(official["bos_token"]["content"]) == [tok.bos_id]
    assert tok.encode(official["eos_token"]["content"]) == [tok.eos_id]
    assert (tok.think_start_id, tok.think_end_id) == (128798, 128799)
    assert tok.encode("<think>\nhm</think>")[0] == 128798 and tok.encode("</think>") == [128799]
    assert tok.encode(USER + ASSISTANT) == [128803, 128804]
    assert tok.vocab_size == 128815  # the model's 129280 embedding rows include unused padding
    assert tok.encode("Hi", add_bos=True) == [0, *tok.encode("Hi")]
    assert tok.encode("Hello world") == [19923, 2058]
    assert tok.decode([0, 19923, 1], skip_special_tokens=True) == "Hello"
    assert tok.decode(np.array([0, 19923, 1])) == f"{BOS}Hello{EOS}"


TEXTS = [
    "Hello, world! The quick brown fox; 3.14159 * 2 = 6.28318.",
    "深度求索的推理模型。日本語のテキストも。한국어 문장입니다.",
    "Emoji: 😀🚀 family 👨‍👩‍👧‍👦 flag 🇫🇷 skin 👍🏽 keycap 1️⃣",
    "Mixed 中文 and English, café naïve e\u0301\u0302 a\u0308 Z\u0335\u0321\u031b, Ελληνικά, العربية, עברית",
    "def f(x):\n\treturn {'k': [x, \"\\n\"]}  # tabs\r\n and   spaces   ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 𠜎𠜱𠝹 (astral CJK), lone U+FFFD in text: \ufffd.",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids) and tok.bos_id not in ids
    assert tok.decode(ids) == text


def stream(tok: Tokenizer, ids: list[int], sizes: list[int], skip: bool = False) -> list[str]:
    sd, pieces, at = StreamDecoder(tok, skip_special_tokens=skip), [], 0
    for size in sizes:
        pieces.append(sd.push(ids[at : at + size] if size != 1 else ids[at]))  # ints and lists both accepted
        at += size
    return [*pieces, sd.flush()]


def random_sizes(rng: random.Random, n: int) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(min(rng.randint(1, 5), n - sum(sizes)))
    return sizes


@pytest.mark.parametrize("text", TEXTS)
def test_stream_matches_decode(tok, text):
    ids = tok.encode(text)
    for sizes in [[1] * len(ids), *(random_sizes(random.Random(seed), len(ids)) for seed in range(5))]:
        pieces = stream(tok, ids, sizes)
        assert "".join(pieces) == text
        if "\ufffd" not in text:
            assert not any("\ufffd" in p for p in pieces)


def test_stream_is_exercised_by_split_characters(tok):
    # The streaming test above is only meaningful if some tokens end mid-character.
    ids = tok.encode(TEXTS[2] + TEXTS[1])
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)
    pieces = stream(tok, ids, [1] * len(ids))
    assert "" in pieces[:-1]  # something was held back
    assert "".join(pieces) == TEXTS[2] + TEXTS[1]


def test_stream_chat_and_skip_special(tok):
    ids = tok.apply_chat_template(CONVERSATIONS["tools"]) + tok.encode("<think>\n嗯🤔</think>答案") + [tok.eos_id]
    for skip in (False, True):
        assert "".join(stream(tok, ids, random_sizes(random.Random(7), len(ids)), skip)) == tok.decode(ids, skip)


def test_stream_arbitrary_ids(tok):
    # Any sequence, invalid UTF-8 included (bare byte tokens, truncated characters), concatenates to decode().
    byte_tokens = [i for i in range(tok.vocab_size) if len(tok.backend.id_to_token(i) or "") == 1][:300]
    rng = random.Random(0)
    for _ in range(200):
        pool = byte_tokens if rng.random() < 0.5 else range(tok.vocab_size)
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 30))]
        for sizes in ([1] * len(ids), random_sizes(rng, len(ids))):
            assert "".join(stream(tok, ids, sizes)) == tok.decode(ids)
    truncated = tok.encode("好😀")[:-1]  # ends mid-emoji: held back until flush, which gives decode()'s U+FFFD
    sd = StreamDecoder(tok)
    assert "".join(sd.push(i) for i in truncated) == "好"
    assert sd.flush() == "\ufffd" == tok.decode(truncated)[-1]
    assert sd.flush() == ""


@pytest.mark.slow
def test_load_tokenizer_prefers_folder(tmp_path):
    spec = json.loads(packaged_tokenizer_json().read_text(encoding="utf-8"))
    spare = next(t for t in spec["added_tokens"] if t["id"] == 128797)
    assert spare["content"] == "<｜place▁holder▁no▁797｜>"
    spare["content"] = "<｜marker｜>"  # tells the folder's copy from the packaged one
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    local = load_tokenizer(tmp_path)
    assert local.backend.token_to_id("<｜marker｜>") == 128797
    assert load_tokenizer(tmp_path / "tokenizer.json").backend.token_to_id("<｜marker｜>") == 128797
    assert load_tokenizer(str(tmp_path)).encode("Hello world") == [19923, 2058]
    assert load_tokenizer().backend.token_to_id("<｜marker｜>") is None
    empty = tmp_path / "no_tokenizer_here"
    empty.mkdir()
    assert load_tokenizer(empty).backend.token_to_id("<｜marker｜>") is None  # falls back to the package
    missing = tmp_path / "does-not-exist"
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_tokenizer(missing)


def test_data_copy_matches_shared_reference():
    if not SHARED_CONFIG.is_file():
        pytest.skip("../shared reference not present")
    assert json.loads(CONFIG.read_text(encoding="utf-8")) == json.loads(SHARED_CONFIG.read_text(encoding="utf-8"))


def test_token_bytes_join_to_the_decoded_text(tok):
    tokenizer = tok
    ids = tokenizer.encode("Hello 超声波 world 🤖 <think> x", add_bos=True)
    assert b"".join(tokenizer.token_bytes(i) for i in ids).decode() == tokenizer.decode(ids)
    assert tokenizer.token_bytes(tokenizer.eos_id) == EOS.encode()
    assert tokenizer.token_bytes(tokenizer.vocab_size + 5) == b""  # the model's padded embedding rows
    with pytest.raises(ValueError, match="negative"):
        tokenizer.token_bytes(-1)
