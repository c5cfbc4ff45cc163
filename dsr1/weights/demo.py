"""The embedded demo model: a small DeepSeek-V3-architecture model trained on Shakespeare by
`python -m dsr1.train`, shipped inside the package in the release layout of a HF folder, so that
everything runs with real weights where no checkpoint can be downloaded.
"""

from __future__ import annotations

from pathlib import Path

DEMO_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# The one command that regenerates the shipped folder (docs/benchmarks.md has its figures).
REGENERATE = ("python -m dsr1.train --out runs/demo --steps 1000 --schedule-steps 1200 --batch 16 "
              "--seq-len 256 --export dsr1/demo_model")


def demo_checkpoint() -> Path:
    """The folder of the embedded demo model (`config.json`, `model.safetensors` with the MTP layer,
    `tokenizer.json`, `tokenizer_config.json`): pass it to `dsr1.load` (`mtp=True` for drafts)."""
    folder = Path(__file__).resolve().parent.parent / "demo_model"
    missing = [name for name in DEMO_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder}: the demo model lacks {', '.join(missing)}; regenerate it with "
                                f"`{REGENERATE}`")
    return folder
