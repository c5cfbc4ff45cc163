"""The few operations a backend may take over from XLA, and XLA's own implementation of them.

The model core computes everything with XLA, on any platform. A backend (dsr1's CPU kernels,
`dsr1.cpu`) takes over by holding weights in layouts of its own, made from outside the core before
any program runs (`dsr1.api` asks the backend for a mesh of its devices). The core never imports a
backend: it asks the weights.

- A weight in a backend's layout is a `HeldWeight`, which names its `Backend`: that backend computes
  the weight's products (`einsum`, `ragged_dot`, one expert's `expert_matmul`, its widening
  `to_float32`) and gives its shard_map spec.
- The operations over several weights or over the cache (a layer scan's weight copies, the router
  read in its stack, a step's routed experts, a decode step's attention) belong to the backend that
  holds the weights too: `backend_of(weights)`, XLA's (`XLA`, which takes none over) for weights held
  as their dtype says.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax


class Backend:
    """The operations a backend may take over: the products of the weights it holds, and a few over
    several weights or the cache. This base is XLA's: it holds no weights and takes nothing over
    (every `takes_*` / `attends` answers False, there are no copies)."""

    name: ClassVar[str] = "xla"
    # Whether a layer scan on one device leaves the routers in their stack, for `router_in_stack`.
    routers_in_stack: ClassVar[bool] = False

    # Products of one weight held in this backend's layout (`HeldWeight`; XLA holds none).
    def to_float32(self, w: Any) -> jax.Array:
        """The weight's values (or int8 values) as float32."""
        raise NotImplementedError(f"the {self.name} backend holds no weights")

    def einsum(self, spec: str, x: jax.Array, w: Any, **kwargs) -> jax.Array:
        """`jnp.einsum(spec, x, w)`, the held weight `w` the second operand."""
        raise NotImplementedError(f"the {self.name} backend holds no weights")

    def ragged_dot(self, x: jax.Array, w: Any, group_sizes: jax.Array, experts: jax.Array) -> jax.Array:
        """Rows sorted by expert against the held `[E, in, out]` experts `w` (float32 out)."""
        raise NotImplementedError(f"the {self.name} backend holds no weights")

    def expert_matmul(self, x: jax.Array, stack: Any, layer: jax.Array, expert: jax.Array) -> jax.Array:
        """float32 `x @ w` for expert `expert` of layer `layer` of a held `[L, E, in, out]` stack, in place."""
        raise NotImplementedError(f"the {self.name} backend holds no weights")

    def partition_spec(self, w: Any, spec: Any, swapped: Any, scale: Any) -> Any:
        """A held weight's shard_map spec, given the weight's spec, that spec with the last two axes
        swapped and its int8 scales' spec (None for other weights)."""
        raise NotImplementedError(f"the {self.name} backend holds no weights")

    # Operations over several weights, or over the cache.
    def in_place_copies(self, stack: Any) -> tuple[Any, Any]:
        """A layer stack's weights as (what a layer scan slices, copies it reads in place instead, or
        None): `with_layer_copies` puts a layer's copies back."""
        return stack, None

    def with_layer_copies(self, p: Any, copies: Any, layer: jax.Array) -> Any:
        """One layer's weights with their copies (`in_place_copies`) read in place at `layer`."""
        return p

    def router_in_stack(self, stack: Any, layer: jax.Array) -> Any:
        """A layer's router read in place in its stack `[L, D, E]`: a `HeldWeight` whose `einsum`
        computes the router's logits (where `routers_in_stack`; else the scan slices the router)."""
        raise NotImplementedError(f"the {self.name} backend reads no router in its stack")

    def takes_pairs(self, gate: Any, up: Any, down: Any, tokens: int) -> bool:
        """Whether a step of `tokens` tokens' routed experts go to `expert_pairs` as the router chose them."""
        return False

    def expert_pairs(self, x: jax.Array, weights: jax.Array, matrix: jax.Array, gate: Any, up: Any,
                     down: Any) -> jax.Array:
        """float32 `[tokens, D]`: each token's experts (`matrix [tokens, K]`: the index of each pair's
        expert in the stacks' leading axes flattened, negative: skipped), weighted and summed."""
        raise NotImplementedError(f"the {self.name} backend takes no expert pairs")

    def takes_blocks(self, gate: Any, up: Any, down: Any, block: int) -> bool:
        """Whether an expert loop's blocks of `block` sorted rows go to `expert_blocks`, all at once."""
        return False

    def expert_blocks(self, xb: jax.Array, index: jax.Array, used: jax.Array, token: jax.Array,
                      weight: jax.Array, gate: Any, up: Any, down: Any, out: jax.Array) -> jax.Array:
        """`out [n_tokens, D]` plus every block's rows against its expert, weighted, summed into their tokens."""
        raise NotImplementedError(f"the {self.name} backend takes no expert blocks")

    def attends(self, cache: Any, queries: int, one_device: bool) -> bool:
        """Whether `decode_attention` computes a step of `queries` queries per row against `cache`."""
        return False

    def decode_attention(self, q: jax.Array, q_pe: jax.Array, c_kv: jax.Array, k_pe: jax.Array,
                         layer: jax.Array, lengths: jax.Array, own: jax.Array, own_pe: jax.Array, scale: float,
                         **kwargs) -> jax.Array:
        """A decode step's absorbed attention context `[B, H, r]` (see `dsr1.core.attention`)."""
        raise NotImplementedError(f"the {self.name} backend takes no decode attention")


XLA = Backend()


class HeldWeight:
    """A weight in a backend's layout (a pytree of that backend's): the core hands its products to the
    backend it names (`backend`, which its subclasses set)."""

    backend: ClassVar[Backend] = XLA


def is_held(w: Any) -> bool:
    """Whether `w` is held in a backend's layout."""
    return isinstance(w, HeldWeight)


def backend_of(weights: Any) -> Backend:
    """The backend holding `weights` (any pytree of them): the first held weight's, else XLA's."""
    for leaf in jax.tree.leaves(weights, is_leaf=is_held):
        if is_held(leaf):
            return leaf.backend
    return XLA
