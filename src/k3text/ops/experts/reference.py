"""Reference kernel: every held expert applied to every token, the outputs combined by a dense
[tokens, held] weight matrix. Simple rather than fast (cost follows tokens x experts held); the
kernel the others are tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3text.ops.experts.base import FP32, ExpertFFN, LayerExperts


def reference(x: jax.Array, weights: jax.Array, local_ids: jax.Array, experts: LayerExperts,
              ffn: ExpertFFN) -> jax.Array:
    """Σ over each token's routed slots held here of weight · expert(x); see `routed_experts`."""
    gate_up, down = experts.matrices(ffn.dtype)
    h = jnp.einsum("nd,efd->nef", x.astype(ffn.dtype), gate_up, precision=ffn.precision,
                   preferred_element_type=FP32)
    y = jnp.einsum("nef,edf->ned", ffn.glu(h).astype(ffn.dtype), down, precision=ffn.precision,
                   preferred_element_type=FP32)
    # An id outside [0, held) has an all-zero one-hot row: experts held elsewhere add nothing.
    hits = jax.nn.one_hot(local_ids, experts.held, dtype=FP32)  # [N, k, held]
    combine = jnp.sum(weights.astype(FP32)[..., None] * hits, axis=1)  # [N, held]
    # Selected, not multiplied by a zero weight: an expert no token routes to must add nothing
    # even when its output is not finite, as in the kernels that never run it.
    routed = jnp.any(hits > 0, axis=1)[..., None]  # [N, held, 1]
    return jnp.sum(jnp.where(routed, combine[..., None] * y, 0.0), axis=1)
