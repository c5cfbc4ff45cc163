"""Weights on disk: safetensors files in the release layout (FP8 blocks included), loading them
into shardings, dsr1's own store (safetensors in dsr1's layout), and the converter between the two.
"""
