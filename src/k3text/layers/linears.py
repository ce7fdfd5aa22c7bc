"""Dense projections. Kernels are stored [in, out] with their logical axes by the layer that owns
them; this is the one matmul they all go through."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3text.config import Config
from k3text.layers.initializers import compute_dtype, precision


def matmul(cfg: Config, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x @ kernel in the activation dtype at the configured precision."""
    dtype = compute_dtype(cfg)
    return jnp.dot(x.astype(dtype), kernel.astype(dtype), precision=precision(cfg))
