"""DeepSeekMoE: group-limited sigmoid routing and dropless routed experts with `ragged_dot`.

Routing (DeepSeek-V3): `s = sigmoid(x W_gate)` in float32. Selection uses `s + bias` (the
correction bias): groups are scored by their two best biased scores, the best `topk_group` groups
are kept and the top `num_experts_per_tok` experts taken among them. The weights are the
*unbiased* `s` of the chosen experts, normalized when `norm_topk_prob`, times
`routed_scaling_factor`. Shared experts always run.

Experts run under `shard_map`: each device sorts the token-expert pairs routed to its local experts,
runs `ragged_dot` for gate/up and down on its slice of the expert ffw, and the partial outputs are
summed over the expert and tensor mesh axes. Where `ragged_dot` is a dense product over every expert
(XLA:CPU, XLA:GPU), other kernels run instead (`default_kernel`, chosen by the mesh's platform): on
CPU a loop over blocks of the sorted pairs slices each hit expert in place (`loop_experts`; experts
in a backend's layouts hand their blocks to it, `dsr1.core.backend`); on GPU decode gathers the pairs'
experts (`gather_experts`) and larger batches fill per-expert buffers (`capacity_experts`); on
TPU, where `ragged_dot` on a layer's slice of the stacks copies the whole slice first, a Pallas
grouped matmul reads each layer's experts in place, only those with pairs (`grouped_experts`).

With `ShardingRules(moe_dispatch="all_to_all")` the rows are split over the expert axis instead, and
each device sends its rows' token-expert pairs to the devices holding their experts
(`ragged_all_to_all`), runs the same kernels on the pairs it received only, and gets the results back
the same way (`_dispatched_experts`; docs/layouts.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .backend import HeldWeight, backend_of, is_held
from .config import Config
from .eplb import physical_experts
from .layers import mlp, swiglu
from .products import einsum, grouped_dot, ragged_dot, to_float32
from .quant import Int8Weight
from .sharding import ShardingRules

# A per-device routed-expert computation: (x, weights, experts, gate, up, down, layer, rules) -> [N, D].
ExpertKernel = Callable[..., jax.Array]


def route(x: jax.Array, router: jax.Array | HeldWeight, bias: jax.Array | None,
          cfg: Config, hashed: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`x [N, D]` -> `(weights [N, K] float32, expert ids [N, K] int32)`. `router [D, E]`, or a layer's
    router read in its stack by a backend (`Backend.router_in_stack`: see `router_logits`). Scores by
    `cfg.scoring_func`: `sigmoid`, or V4's `sqrt(softplus)`. `hashed [N, K]`: the experts chosen
    already (V4's hash layers, by token id); the weights are still the router's scores of those."""
    with jax.named_scope("router"):
        logits = router_logits(x, router)
        scores = jnp.sqrt(jax.nn.softplus(logits)) if cfg.scoring_func == "sqrtsoftplus" else jax.nn.sigmoid(logits)
        if hashed is not None:
            return _weights(scores, hashed, cfg), hashed.astype(jnp.int32)
        biased = scores + bias
        if cfg.topk_group < cfg.n_group:
            n, e = biased.shape
            grouped = biased.reshape(n, cfg.n_group, e // cfg.n_group)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
            _, kept = jax.lax.top_k(group_scores, cfg.topk_group)
            group_mask = jax.nn.one_hot(kept, cfg.n_group, dtype=jnp.bool_).any(axis=1)
            expert_mask = jnp.repeat(group_mask, e // cfg.n_group, axis=1)
            biased = jnp.where(expert_mask, biased, -jnp.inf)
        _, experts = jax.lax.top_k(biased, cfg.num_experts_per_tok)
    return _weights(scores, experts, cfg), experts.astype(jnp.int32)


def _weights(scores: jax.Array, experts: jax.Array, cfg: Config) -> jax.Array:
    """The chosen experts' scores, normalized when `norm_topk_prob`, times `routed_scaling_factor`."""
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor


def router_logits(x: jax.Array, router: jax.Array | HeldWeight) -> jax.Array:
    """`x [N, D] @ router` in float32 (a router held by a backend: that backend's product)."""
    x = x.astype(jnp.float32)
    if is_held(router):
        return router.backend.einsum("nd,de->ne", x, router, precision=jax.lax.Precision.HIGHEST)
    return jnp.matmul(x, router, precision=jax.lax.Precision.HIGHEST)


def _local_pairs(experts: jax.Array, n_local: int, rules: ShardingRules) -> tuple[jax.Array, jax.Array]:
    """Each token-expert pair's index among this device's experts, and whether it is local."""
    first = jax.lax.axis_index(rules.experts) * n_local if rules.experts else 0
    local = experts.reshape(-1) - first
    return local, (local >= 0) & (local < n_local)


def _sorted_pairs(experts: jax.Array, n_local: int, rules: ShardingRules):
    """The token-expert pairs sorted by local expert (other devices' pairs last, as expert `n_local`):
    each sorted pair's token, local expert and whether it is local; the order; and how many pairs
    each local expert holds."""
    local, is_local = _local_pairs(experts, n_local, rules)
    local = jnp.where(is_local, local, n_local)  # other devices' pairs sort last and are dropped
    order = jnp.argsort(local)
    group_sizes = jnp.bincount(local, length=n_local + 1)[:n_local].astype(jnp.int32)
    return order // experts.shape[1], local[order], is_local[order], order, group_sizes


def _combine(n_tokens: int, token: jax.Array, y: jax.Array, weight: jax.Array) -> jax.Array:
    """Sum each sorted pair's expert output, times its routing weight, into its token's row."""
    return jnp.zeros((n_tokens, y.shape[-1]), jnp.float32).at[token].add(y * weight[:, None])


def ragged_experts(x, weights, experts, gate, up, down, layer, rules: ShardingRules, *, limit: float = 0.0):
    """Sort the pairs by expert and run grouped matmuls (`ragged_dot`) on the layer's experts (every
    kernel's `limit`: the SwiGLU clamp, `layers.swiglu`)."""
    gate, up, down = (jax.tree.map(lambda a: a[layer], w) for w in (gate, up, down))
    token, expert, is_local, order, group_sizes = _sorted_pairs(experts, gate.shape[0], rules)
    xs = x[token]
    h = swiglu(ragged_dot(xs, gate, group_sizes, expert), ragged_dot(xs, up, group_sizes, expert), limit)
    y = ragged_dot(h.astype(x.dtype), down, group_sizes, expert)
    return _combine(x.shape[0], token, y, jnp.where(is_local, weights.reshape(-1)[order], 0.0))


def grouped_experts(x, weights, experts, gate, up, down, layer, rules: ShardingRules, *, interpret: bool = False,
                    limit: float = 0.0):
    """`ragged_experts` by the TPU grouped-matmul kernel (`products.grouped_dot`): the layer's experts
    read in place from their stacks, only those that got pairs (XLA:TPU's `ragged_dot` on a layer's
    slice copies the whole local stack first). The kernel's cost estimate counts the local experts a
    step hits on average with its pairs spread uniformly over every device's experts (`experts` holds
    the step's pairs: every token's, or every pair this device may receive). `interpret`: Pallas'
    interpreter (tests, on CPU)."""
    n_local = gate.shape[1]
    token, expert, is_local, order, group_sizes = _sorted_pairs(experts, n_local, rules)
    xs = x[token]
    n_experts = n_local * (jax.lax.axis_size(rules.experts) if rules.experts else 1)
    hit = n_local * (1 - (1 - 1 / n_experts) ** experts.size)

    def dot(rows, w):
        return grouped_dot(rows, w, group_sizes, expert, layer, groups_hit=hit, interpret=interpret)

    h = swiglu(dot(xs, gate), dot(xs, up), limit)
    y = dot(h.astype(x.dtype), down)
    return _combine(x.shape[0], token, y, jnp.where(is_local, weights.reshape(-1)[order], 0.0))


def dense_experts(x, weights, experts, gate, up, down, layer, rules: ShardingRules, *, limit: float = 0.0):
    """Every local expert on every token, each output scaled by the token's routing weight for that
    expert (zero where it was not chosen): plain batched matmuls, differentiable, experts/K times the
    routed FLOPs. Training on CPU runs it: there `ragged_dot` computes every expert for every *pair*,
    K times more again, and the expert loop has no reverse mode."""
    gate, up, down = (jax.tree.map(lambda a: a[layer], w) for w in (gate, up, down))
    n_local = gate.shape[0]
    local, is_local = _local_pairs(experts, n_local, rules)
    chosen = jax.nn.one_hot(jnp.where(is_local, local, n_local), n_local, dtype=jnp.float32)  # [N*K, E]
    mix = (chosen * weights.reshape(-1, 1)).reshape(*experts.shape, n_local).sum(1)  # [N, E]
    f32 = jnp.float32
    h = swiglu(einsum("nd,edf->enf", x, gate, preferred_element_type=f32),
               einsum("nd,edf->enf", x, up, preferred_element_type=f32), limit)
    h = (h * mix.T[:, :, None]).astype(x.dtype)
    return einsum("enf,efd->nd", h, down, preferred_element_type=f32)


MIN_BLOCK_ROWS = 2  # a decode batch's experts mostly hold 1-2 of its pairs


def loop_block_rows(n_tokens: int, n_pairs: int, n_local: int) -> int:
    """Rows per step of the expert loop. Every block holds one expert's rows, so a step reads one
    expert and a hit expert with n rows takes ceil(n / block) steps: the average rows per expert,
    rounded up to a power of two (at least `MIN_BLOCK_ROWS`, at most the tokens), keeps the padded
    rows below twice the pairs plus one block per expert. Small blocks matter in decode: at batch 8
    (48 pairs on 64 experts) a block of all 8 tokens would compute ~6x the routed rows."""
    mean_rows = -(-n_pairs // n_local)
    return min(n_tokens, max(MIN_BLOCK_ROWS, 1 << (mean_rows - 1).bit_length()))  # next power of two


def _expert_slice(w: Any, layer: jax.Array, expert: jax.Array) -> Any:
    """One expert of one layer of a stacked `[L, E, ...]` weight, sliced in place (no stack copy)."""
    return jax.tree.map(lambda a: a[layer, expert], w)


def _expert_matmul(x: jax.Array, stack: Any, layer: jax.Array, expert: jax.Array) -> jax.Array:
    """float32 `x @ w` for expert `expert` of layer `layer` of a stacked `[L, E, in, out]` weight, sliced
    in place: in the weight's own dtype with float32 sums, as `ragged_dot` (a stack in a backend's
    layout: that backend's product, `Backend.expert_matmul`)."""
    if is_held(stack):
        return stack.backend.expert_matmul(x, stack, layer, expert)
    w = _expert_slice(stack, layer, expert)
    if isinstance(w, Int8Weight):
        return jnp.dot(x, w.q.astype(x.dtype), preferred_element_type=jnp.float32) * w.scale
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _blocks(group_sizes: jax.Array, block: int):
    """The loop's blocks of sorted pairs, `block` rows each, every block one expert's: their number,
    and for block numbers `j` (scalar or array) the expert, the first sorted pair and how many of
    the block's rows are that expert's (the rest belong to the next expert or are padding)."""
    blocks = -(-group_sizes // block)
    block_ends = jnp.cumsum(blocks)
    pair_starts = jnp.cumsum(group_sizes) - group_sizes

    def block_at(j: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        # One comparison of every slot with every expert: the default binary search is a loop of
        # log2(experts) steps, ~60 small XLA:CPU thunks per layer.
        expert = jnp.searchsorted(block_ends, j, side="right", method="compare_all")
        first_row = (j - (block_ends[expert] - blocks[expert])) * block
        return expert, pair_starts[expert] + first_row, group_sizes[expert] - first_row

    return block_ends[-1], block_at


def loop_experts(x, weights, experts, gate, up, down, layer, rules: ShardingRules, *, limit: float = 0.0):
    """CPU: sort the pairs by expert, then a loop over blocks of sorted rows, each block one expert's,
    which slices that expert of `layer` from the stacks in place and runs its rows. Reads each hit
    expert once per block and computes only its (padded) rows: its cost follows the pairs and the hit
    experts, not the expert count (XLA:CPU's `ragged_dot` computes every expert). Experts in a
    backend's layouts take a decode step's pairs as the router chose them (`Backend.expert_pairs`),
    or every block at once (`Backend.expert_blocks`), where its kernels read them."""
    n_local, n_tokens = gate.shape[1], x.shape[0]
    varying = functools.partial(jax.lax.pcast, axis_name=rules.moe_reduce_axes(), to="varying")
    # The kernels group an expert's rows and sum each row by how many there are; the loop's blocks
    # have one shape whatever the routing. A backend's kernels have no SwiGLU clamp.
    kernels = not rules.batch_invariant and not limit
    backend = backend_of(gate)
    if kernels and backend.takes_pairs(gate, up, down, n_tokens):  # decode, bf16
        local, is_local = _local_pairs(experts, n_local, rules)
        matrix = jnp.where(is_local, layer * n_local + local, -1).reshape(experts.shape)  # others' experts: skipped
        return varying(backend.expert_pairs(x, weights, matrix, gate, up, down))
    token, _, is_local, order, group_sizes = _sorted_pairs(experts, n_local, rules)
    block = loop_block_rows(n_tokens, experts.size, n_local)
    n_blocks, block_at = _blocks(group_sizes, block)
    xs = jnp.pad((x.astype(jnp.float32) if is_held(gate) else x)[token], ((0, block), (0, 0)))
    weight = jnp.where(is_local, weights.reshape(-1)[order], 0.0)
    if kernels and backend.takes_blocks(gate, up, down, block):
        n_pairs = token.shape[0]
        slots = jnp.arange(n_pairs // block + min(n_local, n_pairs))  # blocks <= pairs / block + hit experts
        expert, start, mine = block_at(slots)
        rows = start[:, None] + jnp.arange(block)  # [slots, block] sorted pairs
        index = jnp.where(slots < n_blocks, layer * n_local + expert, -1)
        pair = jnp.minimum(rows, n_pairs - 1)
        used = jnp.where(slots < n_blocks, mine, 0)  # a block's rows past its expert's: not computed
        out = varying(jnp.zeros((n_tokens, down.shape[-1]), jnp.float32))
        return backend.expert_blocks(xs[rows], index, used, token[pair], weight[pair], gate, up, down, out)

    def step(j, ys):
        expert, start, mine = block_at(j)
        rows = jax.lax.dynamic_slice_in_dim(xs, start, block)
        h = swiglu(_expert_matmul(rows, gate, layer, expert), _expert_matmul(rows, up, layer, expert), limit)
        y = _expert_matmul(h.astype(rows.dtype), down, layer, expert)
        # A block's trailing rows belong to the next expert: keep what is there (written later).
        old = jax.lax.dynamic_slice_in_dim(ys, start, block)
        return jax.lax.dynamic_update_slice_in_dim(ys, jnp.where((jnp.arange(block) < mine)[:, None], y, old),
                                                   start, axis=0)

    # The outputs differ per device (its experts, its ffw slice): the loop carry says so from the start.
    ys = jax.lax.fori_loop(0, n_blocks, step, varying(jnp.zeros((xs.shape[0], down.shape[-1]), jnp.float32)))
    return _combine(n_tokens, token, ys[:token.shape[0]], weight)


def gather_experts(x, weights, experts, gate, up, down, layer, rules: ShardingRules, *, limit: float = 0.0):
    """GPU decode: each token-expert pair's expert of `layer` gathered from the stacks and contracted
    by a float32 multiply-reduce, all pairs in one product. A step reads each pair's expert once and
    spreads the work over the whole chip: the expert loop's one-row matmuls use a few of a GPU's cores,
    and `ragged_dot`, which XLA:GPU expands to a dense product, reads every expert."""
    k = experts.shape[1]
    local, is_local = _local_pairs(experts, gate.shape[1], rules)
    pick = jnp.where(is_local, local, 0)
    rows = x[jnp.arange(experts.size) // k].astype(jnp.float32)
    w_gate, w_up, w_down = (jax.tree.map(lambda a: a[layer, pick], w) for w in (gate, up, down))
    h = swiglu(_pair_matmul(rows, w_gate), _pair_matmul(rows, w_up), limit)
    y = _pair_matmul(h, w_down) * jnp.where(is_local, weights.reshape(-1), 0.0)[:, None]
    return y.reshape(x.shape[0], k, -1).sum(1)


def _pair_matmul(rows: jax.Array, w: Any) -> jax.Array:
    """`rows [P, i] @ w [P, i, o]` per pair, float32, as a multiply-reduce (which XLA fuses with the
    gather of `w`; a batched dot would first copy the gathered experts)."""
    if isinstance(w, Int8Weight):
        return (rows[:, :, None] * to_float32(w.q)).sum(1) * w.scale
    return (rows[:, :, None] * to_float32(w)).sum(1)


CAPACITY_FACTOR = 1.5  # buffer rows per expert over the mean pairs: balanced routing fits in one round


def capacity_rows(n_pairs: int, n_local: int) -> int:
    """Rows of each expert's buffer in `capacity_experts`: 1.5x the mean pairs per expert, a multiple
    of 8 (at least 8), so that the random spread of a balanced routing fits in one round."""
    return 8 * max(1, -(-int(CAPACITY_FACTOR * -(-n_pairs // n_local)) // 8))


def capacity_experts(x, weights, experts, gate, up, down, layer, rules: ShardingRules, *, limit: float = 0.0):
    """GPU prefill: the pairs sorted by expert into fixed-size buffers `[E, C, D]`, then batched
    matmuls over every local expert (computes ~1.5x the routed rows, in large dense products). Dropless:
    rows past an expert's capacity run in further rounds (a loop that balanced routing skips)."""
    gate, up, down = (jax.tree.map(lambda a: a[layer], w) for w in (gate, up, down))
    n_local, n_pairs, dim = gate.shape[0], experts.size, x.shape[-1]
    token, expert, is_local, order, group_sizes = _sorted_pairs(experts, n_local, rules)
    capacity = capacity_rows(n_pairs, n_local)
    rank = jnp.arange(n_pairs) - (jnp.cumsum(group_sizes) - group_sizes)[jnp.minimum(expert, n_local - 1)]
    rows = x[token]
    f32 = jnp.float32

    def one_round(r, ys):
        slot_rank = rank - r * capacity
        fits = is_local & (slot_rank >= 0) & (slot_rank < capacity)
        slot = jnp.where(fits, expert * capacity + slot_rank, n_local * capacity)  # the rest: a dropped row
        buf = jnp.zeros((n_local * capacity + 1, dim), x.dtype).at[slot].set(rows)[:-1]
        buf = buf.reshape(n_local, capacity, dim)
        h = swiglu(einsum("ecd,edf->ecf", buf, gate, preferred_element_type=f32),
                   einsum("ecd,edf->ecf", buf, up, preferred_element_type=f32), limit)
        out = einsum("ecf,efd->ecd", h.astype(x.dtype), down, preferred_element_type=f32).reshape(-1, dim)
        return jnp.where(fits[:, None], out[jnp.minimum(slot, n_local * capacity - 1)], ys)

    rounds = -(-jnp.max(group_sizes) // capacity)
    ys = jax.lax.pcast(jnp.zeros((n_pairs, dim), f32), rules.moe_reduce_axes(), to="varying")
    ys = jax.lax.fori_loop(0, rounds, one_round, ys)
    return _combine(x.shape[0], token, ys, jnp.where(is_local, weights.reshape(-1)[order], 0.0))


def default_kernel(n_pairs: int, n_local: int, backend: str | None = None) -> ExpertKernel:
    """The routed-expert kernel for `n_pairs` token-expert pairs on `n_local` experts, by platform
    (`python -m dsr1.bench moe` compares them). CPU: the expert loop at every size (XLA:CPU lowers
    `ragged_dot` to a dense masked product over *every* local expert). GPU: XLA:GPU expands
    `ragged_dot` the same way, and a one-row matmul per expert uses a few of its cores, so decode
    gathers the pairs' experts while they are fewer than half of the experts (`gather_experts`), and
    more pairs run through per-expert buffers (`capacity_experts`). TPU: the grouped-matmul kernel
    (`grouped_experts`), which reads only the experts that got pairs, in place.
    `backend`: the platform of the mesh's devices (`routed_experts` passes it); JAX's default backend
    unless given."""
    backend = backend or jax.default_backend()
    if backend == "cpu":
        return loop_experts
    if backend == "tpu":
        return grouped_experts
    if backend != "gpu":
        return ragged_experts
    return gather_experts if 2 * n_pairs <= n_local else capacity_experts


def differentiable_kernel(platform: str) -> ExpertKernel:
    """The routed-expert kernel with reverse mode on `platform`: `ragged_dot`, but on CPU (where it is a
    dense product over every expert for every pair) every expert on every token (`dense_experts`)."""
    return dense_experts if platform == "cpu" else ragged_experts


def _local_experts(x, weights, experts, gate, up, down, layer, *, rules: ShardingRules, platform: str,
                   differentiable: bool = False, kernel: ExpertKernel | None = None, limit: float = 0.0):
    """Per-device body: this device's experts (and ffw slice) applied to every token routed to them,
    by `kernel`, or by default the `platform`'s: `differentiable`, no expert loop (its dynamic trip
    count has no reverse mode): `ragged_dot`, or on CPU every expert on every token (`dense_experts`).
    `limit`: the SwiGLU clamp (`layers.swiglu`)."""
    if kernel is None and differentiable:
        kernel = differentiable_kernel(platform)
    elif kernel is None:
        kernel = default_kernel(experts.size, gate.shape[1], platform)
    kernel = functools.partial(kernel, limit=limit) if limit else kernel
    return jax.lax.psum(kernel(x, weights, experts, gate, up, down, layer, rules), rules.moe_reduce_axes())


def _partition_spec(w: Any, axes: tuple[str, ...], rules: ShardingRules) -> Any:
    """The shard_map spec of a stacked `[L, E, ...]` expert weight (and of its int8 scales, which drop
    the input axis; `input_axes` count within one layer)."""
    axes = ("layers", *axes)
    spec = rules.spec(axes)
    scale = None
    if isinstance(w, Int8Weight):
        scale = rules.spec(tuple(a for i, a in enumerate(axes) if i - 1 not in w.input_axes))
    if is_held(w):  # a copy with the last two axes swapped is split like the weight
        return w.backend.partition_spec(w, spec, rules.spec((*axes[:-2], axes[-1], axes[-2])), scale)
    return spec if scale is None else Int8Weight(spec, scale, w.input_axes)


def routed_experts(p: dict, x: jax.Array, weights: jax.Array, experts: jax.Array, mesh: Mesh,
                   rules: ShardingRules, layer: jax.Array | None = None, *, differentiable: bool = False,
                   kernel: ExpertKernel | None = None, limit: float = 0.0) -> jax.Array:
    """Dropless routed-expert output `[N, D]` (float32), experts split over the expert mesh axis.

    How tokens meet their experts follows `rules.moe_dispatch`: "psum" runs each device's experts on
    every token routed to them and sums the partial outputs over the mesh (`_local_experts`);
    "all_to_all" splits the rows over the expert axis and sends each pair to its expert's device and
    back (`_dispatched_experts`; the output comes out split over that axis, and a caller keeping
    activations replicated gathers it). `layer`: None when `p` holds one layer's experts `[E, ...]`;
    else `p`'s experts are the stacks `[L, E, ...]` of every layer and `layer` picks one, so that
    kernels slice an expert in place. `differentiable`: a path with reverse mode (training, which
    sums partial outputs whatever the dispatch; see `_local_experts`). `kernel`: one of
    `ragged_experts`, `grouped_experts`, `loop_experts`, `dense_experts` instead of the platform's
    (benchmarks, tests). `limit`: the experts' SwiGLU clamp (V4's `swiglu_limit`; 0: none)."""
    gate, up, down = p["gate"], p["up"], p["down"]
    if layer is None:
        gate, up, down = (jax.tree.map(lambda a: a[None], w) for w in (gate, up, down))
        layer = jnp.zeros((), jnp.int32)
    with jax.named_scope("routed_experts"):
        w_in = _partition_spec(gate, ("experts", "embed", "expert_ffw"), rules)
        w_out = _partition_spec(down, ("experts", "expert_ffw", "embed"), rules)
        platform = mesh.devices.flat[0].platform
        token_axis = None if differentiable else rules.moe_token_axis()
        n_rows = x.shape[0]
        if token_axis is None:
            body = functools.partial(_local_experts, rules=rules, platform=platform, differentiable=differentiable,
                                     kernel=kernel, limit=limit)
        else:
            body = functools.partial(_dispatched_experts, rules=rules, platform=platform, ragged=ragged_dispatch(mesh),
                                     kernel=kernel, limit=limit)
            x, weights, experts = _pad_rows(x, weights, experts, mesh.shape[token_axis])
        rows = P(token_axis)
        run = jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, w_in, w_in, w_out, P()), out_specs=rows)
        out = run(x, weights, experts, gate, up, down, jnp.asarray(layer, jnp.int32))
        return out[:n_rows]


def _pad_rows(x: jax.Array, weights: jax.Array, experts: jax.Array, parts: int):
    """The rows padded to a multiple of `parts`; padding rows route nowhere (expert -1, weight 0)."""
    pad = -x.shape[0] % parts
    if not pad:
        return x, weights, experts
    return (jnp.pad(x, ((0, pad), (0, 0))), jnp.pad(weights, ((0, pad), (0, 0))),
            jnp.pad(experts, ((0, pad), (0, 0)), constant_values=-1))


class _Exchange(NamedTuple):
    """One device's side of an exchange of token-expert pairs with its peers (the devices of the
    token axis), per peer `j`. Every receiver's buffer holds its senders' pairs in sender order, each
    sender's sorted by expert."""

    send_offsets: jax.Array  # [n] the first of this device's sorted pairs that go to j
    send_sizes: jax.Array  # [n] how many go to j
    remote_offsets: jax.Array  # [n] where they land in j's buffer
    recv_offsets: jax.Array  # [n] where j's pairs lie in this device's buffer (the packed, ragged exchange's)
    recv_sizes: jax.Array  # [n] how many came from j
    home_offsets: jax.Array  # [n] where j's pairs lie among j's sorted pairs (their results go back there)
    recv_per_expert: jax.Array  # [n, n_local] how many of j's pairs are for each of this device's experts


def _exchange(experts: jax.Array, n_peers: int, n_local: int, axis: str) -> _Exchange:
    """The exchange over mesh axis `axis` of this device's pairs, routed to global `experts [P]` (-1:
    nowhere; `n_local` experts per device), from every device's pairs per expert: an all-gather of
    one int per expert, which also tells each receiver whose experts its rows are for, so that
    only the activations travel."""
    n_experts = n_peers * n_local
    per_expert = jnp.bincount(jnp.where(experts >= 0, experts, n_experts), length=n_experts + 1)[:-1]
    per_expert = jax.lax.all_gather(per_expert.astype(jnp.int32), axis)  # [source, expert]
    counts = per_expert.reshape(n_peers, n_peers, n_local).sum(-1)  # [source, destination]
    me = jax.lax.axis_index(axis)
    from_lower_sources = jnp.cumsum(counts, axis=0) - counts
    to_lower_destinations = jnp.cumsum(counts, axis=1) - counts
    return _Exchange(to_lower_destinations[me], counts[me], from_lower_sources[me], from_lower_sources[:, me],
                     counts[:, me], to_lower_destinations[:, me],
                     jax.lax.dynamic_slice_in_dim(per_expert, me * n_local, n_local, axis=1))


def _received_experts(plan: _Exchange, p: int, first: jax.Array, ragged: bool) -> jax.Array:
    """The global expert of each row of this device's receive buffer `[n * p]` (`_send`'s; `first`:
    this device's first expert), -1 for rows that received nothing."""
    n, n_local = plan.recv_per_expert.shape
    starts = plan.recv_offsets if ragged else jnp.arange(n) * p  # where each sender's rows begin
    ends = (jnp.cumsum(plan.recv_per_expert, axis=1) + starts[:, None]).reshape(-1)  # per (sender, expert)
    rows = jnp.arange(n * p)
    group = jnp.searchsorted(ends, rows, side="right")
    sender = jnp.minimum(group // n_local, n - 1)
    received = (rows >= starts[sender]) & (rows < starts[sender] + plan.recv_sizes[sender])
    return jnp.where(received, first + group % n_local, -1)


def _send(rows: jax.Array, plan: _Exchange, slots: jax.Array, axis: str, ragged: bool) -> jax.Array:
    """This device's sorted pairs' `rows [P, D]` sent to their experts' devices: the `[n * P, D]`
    buffer of the pairs received (every device may receive all of its peers' pairs: dropless), zero
    elsewhere. `ragged`: `ragged_all_to_all`, which moves only the pairs, packed by sender; else an
    `all_to_all` of a `P`-row slot per peer (`slots`: each pair's), which moves every slot."""
    n, p = plan.send_sizes.shape[0], rows.shape[0]
    if ragged:
        out = jnp.zeros((n * p, rows.shape[1]), rows.dtype)
        out = jax.lax.pcast(out, axis, to="varying")  # as `rows`: they differ per device of `axis`
        return jax.lax.ragged_all_to_all(rows, out, plan.send_offsets, plan.send_sizes,
                                         plan.remote_offsets, plan.recv_sizes, axis_name=axis)
    buf = jnp.zeros((n * p + 1, rows.shape[1]), rows.dtype).at[slots].set(rows)[:-1]
    return jax.lax.all_to_all(buf, axis, 0, 0, tiled=True)


def _send_back(y: jax.Array, plan: _Exchange, slots: jax.Array, axes: tuple[str, ...], ragged: bool) -> jax.Array:
    """The received pairs' results `y [n * P, D]` returned to their senders: `[P, D]` in each sender's
    sorted order (zero for pairs bound nowhere). The inverse of `_send`; `axes`: the exchange's mesh
    axis, then those `y` differs over besides (the experts' ffw slices)."""
    p, axis = slots.shape[0], axes[0]
    if ragged:
        out = jax.lax.pcast(jnp.zeros((p, y.shape[-1]), y.dtype), axes, to="varying")  # as `y`
        return jax.lax.ragged_all_to_all(y, out, plan.recv_offsets, plan.recv_sizes, plan.home_offsets,
                                         plan.send_sizes, axis_name=axis)
    back = jax.lax.all_to_all(y, axis, 0, 0, tiled=True)
    return jnp.concatenate([back, jnp.zeros((1, y.shape[-1]), y.dtype)])[slots]


def ragged_dispatch(mesh: Mesh) -> bool:
    """Whether the all-to-all dispatch sends the pairs with `ragged_all_to_all` on `mesh`'s devices;
    where it cannot, a dense `all_to_all` of one full-size slot per peer runs. XLA:CPU has no
    `ragged-all-to-all`, and XLA:TPU refuses it where ICI routing is limited: TPU v5e beyond 16 chips."""
    device = mesh.devices.flat[0]
    if device.platform == "cpu":
        return False
    return not (device.platform == "tpu" and "lite" in device.device_kind and "v5" in device.device_kind
                and mesh.devices.size > 16)


def _dispatched_experts(x, weights, experts, gate, up, down, layer, *, rules: ShardingRules, platform: str,
                        ragged: bool, kernel: ExpertKernel | None = None, limit: float = 0.0):
    """Per-device body of the all-to-all dispatch, on this device's rows `x [n, D]` (a share of the
    batch): their token-expert pairs, sorted by expert, go to the devices holding the experts; each
    device runs its experts (its ffw slice) on the pairs it received only, by `kernel` (default:
    the platform's, `default_kernel`); the results, in `x`'s dtype, come back the same way and are
    combined with the routing weights here, then summed over the ffw's mesh axis. Dropless: a
    device's receive buffer holds every pair of its peers. Returns `[n, D]` float32."""
    axis = rules.moe_token_axis()
    n_peers, n_local = jax.lax.axis_size(axis), gate.shape[1]
    n_rows, k = experts.shape
    flat = experts.reshape(-1)
    routed = flat >= 0  # padding rows' pairs go nowhere
    order = jnp.argsort(jnp.where(routed, flat, n_peers * n_local))  # by expert, so by device
    token, dest = order // k, jnp.where(routed, flat // n_local, n_peers)[order]
    plan = _exchange(flat, n_peers, n_local, axis)
    p = flat.shape[0]
    slots = jnp.where(dest < n_peers, dest * p + jnp.arange(p) - plan.send_offsets[jnp.minimum(dest, n_peers - 1)],
                      n_peers * p)  # each pair's slot in the dense exchange's send buffer
    with jax.named_scope("dispatch"):
        xs = _send(x[token], plan, slots, axis, ragged)
    received = _received_experts(plan, p, jax.lax.axis_index(axis) * n_local, ragged)  # empty rows: -1
    kernel = kernel or default_kernel(received.shape[0], n_local, platform)
    kernel = functools.partial(kernel, limit=limit) if limit else kernel
    y = kernel(xs, jnp.ones((received.shape[0], 1), jnp.float32), received[:, None], gate, up, down, layer, rules)
    with jax.named_scope("return"):
        back = _send_back(y.astype(x.dtype), plan, slots, rules.moe_reduce_axes(), ragged)
    out = _combine(n_rows, token, back, jnp.where(dest < n_peers, weights.reshape(-1)[order], 0.0))
    return jax.lax.psum(out, rules.expert_ffw) if rules.expert_ffw else out


def moe(p: dict, x: jax.Array, cfg: Config, mesh: Mesh, rules: ShardingRules,
        layer: jax.Array | None = None, *, differentiable: bool = False,
        tokens: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The DeepSeekMoE block on `x [..., D]`: routed plus shared experts, and the routed expert ids
    `[N, K]`, logical (for accounting what a step reads; unused outputs cost nothing under jit). `layer`: see
    `routed_experts` (the routed experts of every layer, read in place); `differentiable`: see there.
    A hash layer (V4: `p["tid2eid"] [vocab, K]`) routes each of `tokens [...]` (the ids of x's rows)
    to its table row's experts; `cfg.swiglu_limit` clamps routed and shared experts alike."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if "tid2eid" in p:
        if tokens is None:
            raise ValueError("a hash-routed MoE layer (tid2eid) needs the token ids of its rows")
        weights, experts = route(x, p["router"], None, cfg, hashed=p["tid2eid"][tokens.reshape(-1)])
    else:
        weights, experts = route(x, p["router"], jax.lax.stop_gradient(p["router_bias"]), cfg)
    # Redundant experts (`dsr1.core.eplb`): the stacks hold physical slots, each pair goes to a copy.
    slots = physical_experts(experts, p["replicas"], p["replica_counts"]) if "replicas" in p else experts
    out = routed_experts(p, x, weights, slots, mesh, rules, layer, differentiable=differentiable,
                         limit=cfg.swiglu_limit)
    if "shared" in p:
        with jax.named_scope("shared_experts"):
            out = out + mlp(p["shared"], x, cfg.swiglu_limit).astype(jnp.float32)
    return out.reshape(shape), experts


class RouterStats(NamedTuple):
    """What training needs from one MoE layer's routing of a batch `[B, T]`."""

    load: jax.Array  # [E] float32: token-expert pairs routed to each expert (the bias update's input)
    balance: jax.Array  # [] float32: the sequence-wise balance loss `sum_e f_e P_e`, averaged over rows


def router_stats(p: dict, x: jax.Array, experts: jax.Array, cfg: Config) -> RouterStats:
    """Router statistics of `x [B, T, D]` routed to `experts [B*T, K]` (DeepSeek-V3, eq. 17-20):
    `f_e = E / (K T) * #{t: e chosen}` and `P_e = mean_t s'_{t,e}` (scores normalized per token), per row."""
    b, t, _ = x.shape
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    scores = jax.nn.sigmoid(jnp.matmul(x.astype(jnp.float32), p["router"], precision=jax.lax.Precision.HIGHEST))
    probs = (scores / scores.sum(-1, keepdims=True)).mean(axis=1)  # [B, E]
    chosen = jax.nn.one_hot(experts.reshape(b, t * k), e, dtype=jnp.float32).sum(axis=1)  # [B, E]
    f = jax.lax.stop_gradient(chosen) * (e / (k * t))
    return RouterStats(load=chosen.sum(0), balance=(f * probs).sum(-1).mean())
