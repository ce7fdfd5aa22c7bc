"""Grouped kernel: routed slots sorted by expert and two grouped matmuls
(`jax.lax.ragged_dot_general`) over every held expert; for prefill and large batches, where
ragged_dot is a real grouped matmul (TPU). Cost follows experts held."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3text.ops.experts.base import FP32, ExpertFFN, LayerExperts

# x [M, in] . w [G, out, in] -> [M, out], rows of x grouped by expert.
_RAGGED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def grouped(x: jax.Array, weights: jax.Array, local_ids: jax.Array, experts: LayerExperts,
            ffn: ExpertFFN) -> jax.Array:
    """Σ over each token's routed slots held here of weight · expert(x); see `routed_experts`."""
    held = experts.held
    k = local_ids.shape[-1]
    flat_ids = local_ids.reshape(-1)
    here = (flat_ids >= 0) & (flat_ids < held)
    # Slots held elsewhere sort last, into a group of their own that no matmul reads.
    order = jnp.argsort(jnp.where(here, flat_ids, held), stable=True)
    token = order // k
    group_sizes = jnp.bincount(jnp.where(here, flat_ids, held), length=held + 1)[:held]
    gate_up, down = experts.matrices(ffn.dtype)
    rows = jnp.take(x, token, axis=0).astype(ffn.dtype)
    h = jax.lax.ragged_dot_general(rows, gate_up, group_sizes.astype(jnp.int32), _RAGGED_DIMS,
                                   precision=ffn.precision, preferred_element_type=FP32)
    y = jax.lax.ragged_dot_general(ffn.glu(h).astype(ffn.dtype), down,
                                   group_sizes.astype(jnp.int32), _RAGGED_DIMS,
                                   precision=ffn.precision, preferred_element_type=FP32)
    w = jnp.where(here, weights.reshape(-1), 0.0)[order]
    return jnp.zeros(x.shape, FP32).at[token].add(y * w[:, None])
