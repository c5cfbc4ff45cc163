"""Generation: R1's tokenizer and chat template, on-device sampling, and `generate` over a
static batch.
"""
