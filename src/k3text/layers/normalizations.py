"""RMSNorm and the gated RMSNorm of the KDA output, computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from k3text.layers.initializers import Init


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in float32 (no gain)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as the Kimi checkpoints define it: normalise in fp32, cast back, then scale."""
    return weight * rms_normalize(x, eps).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """KDA output norm: fp32 RMSNorm * weight * sigmoid(gate), cast back to x.dtype."""
    y = rms_normalize(x, eps) * weight.astype(jnp.float32)
    return (y * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Thin holder of an RMSNorm gain over a named axis."""

    def __init__(self, init: Init, dim: int, eps: float, dtype: DTypeLike,
                 axis: str | None = "embed"):
        self.weight = init.constant((dim,), (axis,), dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)
