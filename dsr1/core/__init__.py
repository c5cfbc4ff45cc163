"""The model core: DeepSeek-V3 as pure functions of (weights, inputs) on a device mesh.

config -> sharding (mesh, logical axes) -> params (every weight declared once) -> quant (int8)
-> layers, rope, attention (MLA), moe (DeepSeekMoE) -> model (forward, prefill, decode) over a
cache (the latent KV cache).
"""
