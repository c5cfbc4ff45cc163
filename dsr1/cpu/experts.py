"""The CPU backend's routed experts: an expert loop's products in a few kernel calls.

`dsr1.core.moe.loop_experts` sorts a layer's token-expert pairs by expert into blocks of rows, each
block one expert's. Where the experts are laid out for the kernel, it hands the pairs over here: a
decode step's few tokens go as the router chose them (`pairs`: the kernel groups them by expert and
reads each hit expert once, in place), larger batches as every block at once (`blocks`: one kernel
call per product, each block against its expert read in place, each row's output times its routing
weight summed straight into its token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import ffi, products
from .layouts import Bf16Bits, Laid, StackSlice


def takes_pairs(gate: Laid, up: Laid, down: Laid, tokens: int) -> bool:
    """Whether a step of `tokens` tokens goes to the kernel as pairs (bf16 experts, decode)."""
    return all(isinstance(w, Bf16Bits) and w.kernel_reads(tokens) for w in (gate, up, down))


def takes_blocks(gate: Laid, up: Laid, down: Laid, block: int) -> bool:
    """Whether the loop's blocks of `block` rows go to the kernel, all at once."""
    return all(isinstance(w, Laid) and w.block_reads(block) for w in (gate, up, down))


def pairs(x: jax.Array, weights: jax.Array, matrix: jax.Array, gate: Bf16Bits, up: Bf16Bits,
          down: Bf16Bits) -> jax.Array:
    """float32 `[tokens, D]`: each token's routed experts, `matrix [tokens, K]` the index of each pair's
    expert in the stacks' leading axes flattened (negative: another device's, skipped), weighted by
    `weights [tokens, K]` and summed (`ffi.swiglu_pairs`, `ffi.combine_pairs`)."""
    h = ffi.swiglu_pairs(x, matrix, gate.transposed, up.transposed)
    return ffi.combine_pairs(h, matrix, weights, down.transposed)


def blocks(xb: jax.Array, index: jax.Array, used: jax.Array, token: jax.Array, weight: jax.Array,
           gate: Laid, up: Laid, down: Laid, out: jax.Array) -> jax.Array:
    """float32 `out [n_tokens, D]` (zeros) plus: blocks of rows `xb [slots, block, D]`, each against its expert `index`
    (the stacks' leading axes flattened; negative: an empty slot), its first `used` rows counted, each
    row's output times `weight [slots, block]` summed into its token `token [slots, block]`. bf16
    experts of few rows take two calls (gate, up and SwiGLU; down and the weighted sum)."""
    block, n_tokens = xb.shape[1], out.shape[0]
    if all(isinstance(w, Bf16Bits) and w.kernel_reads(block) for w in (gate, up, down)):
        h = ffi.swiglu_rows_dot(xb, gate.transposed, up.transposed, index, used)
        return out + ffi.combine_rows_dot(h, down.transposed, index, token, weight, n_tokens, used)
    h = jax.nn.silu(products.kernel_matmul(xb, gate, index, used)) * products.kernel_matmul(xb, up, index, used)
    if isinstance(down, Bf16Bits) and down.bf16_reads(block) and not down.amx_fits():  # prefill, vdpbf16ps
        return out + ffi.combine_rows_dot(h.astype(jnp.bfloat16), down.transposed, index, token, weight, n_tokens,
                                          used)
    y = products.kernel_matmul(h, down, index, used)
    keep = jnp.arange(block) < used[:, None]
    return out.at[jnp.where(keep, token, n_tokens)].add(y * weight[..., None], mode="drop")


def router_logits(x: jax.Array, router: StackSlice) -> jax.Array | None:
    """float32 `x [N, D] @ router` for a float32 router read in its stack by the kernel (up to
    `ffi.KERNEL_ROWS` rows: slicing it out of the stack, a copy, costs more than the product); None
    where the kernel does not take it."""
    if x.shape[0] <= ffi.KERNEL_ROWS and router.stack.dtype == jnp.float32 and ffi.available():
        return ffi.rows_matmul(x, router.stack, router.index)
    return None
