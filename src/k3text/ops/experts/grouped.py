"""Grouped kernel: routed slots sorted by expert and two grouped matmuls
(`jax.lax.ragged_dot_general`) over every held expert; for prefill and large batches, where
ragged_dot is a real grouped matmul (TPU). Cost follows experts held."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3text.ops.experts.base import FP32, ExpertFFN, LayerExperts

# x [M, in] . w [G, out, in] -> [M, out], rows of x grouped by expert.
RAGGED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


class SortedSlots(NamedTuple):
    """Routed slots sorted by held expert; slots held elsewhere sort last, into a group of their
    own that no matmul reads."""

    token: jax.Array  # [N * k] the token of each sorted slot
    sizes: jax.Array  # [held] int32 slots per held expert
    weight: jax.Array  # [N * k] each sorted slot's routing weight, 0 where held elsewhere


def sort_by_expert(weights: jax.Array, local_ids: jax.Array, held: int) -> SortedSlots:
    k = local_ids.shape[-1]
    flat_ids = local_ids.reshape(-1)
    here = (flat_ids >= 0) & (flat_ids < held)
    group = jnp.where(here, flat_ids, held)
    order = jnp.argsort(group, stable=True)
    sizes = jnp.bincount(group, length=held + 1)[:held].astype(jnp.int32)
    return SortedSlots(order // k, sizes, jnp.where(here, weights.reshape(-1), 0.0)[order])


def grouped(x: jax.Array, weights: jax.Array, local_ids: jax.Array, experts: LayerExperts,
            ffn: ExpertFFN) -> jax.Array:
    """Σ over each token's routed slots held here of weight · expert(x); see `routed_experts`."""
    slots = sort_by_expert(weights, local_ids, experts.held)
    gate_up, down = experts.matrices(ffn.dtype)
    rows = jnp.take(x, slots.token, axis=0).astype(ffn.dtype)
    h = jax.lax.ragged_dot_general(rows, gate_up, slots.sizes, RAGGED_DIMS,
                                   precision=ffn.precision, preferred_element_type=FP32)
    y = jax.lax.ragged_dot_general(ffn.glu(h).astype(ffn.dtype), down, slots.sizes,
                                   RAGGED_DIMS, precision=ffn.precision,
                                   preferred_element_type=FP32)
    return jnp.zeros(x.shape, FP32).at[slots.token].add(y * slots.weight[:, None])
