"""Dense projections: `Linear` with a named-axis kernel stored [in, out]."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from k3text.config import Config
from k3text.layers.initializers import Init, compute_dtype, precision, weight_dtype


def matmul(cfg: Config, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x @ kernel in the activation dtype at the configured precision."""
    dtype = compute_dtype(cfg)
    return jnp.dot(x.astype(dtype), kernel.astype(dtype), precision=precision(cfg))


class Linear(nnx.Module):
    """y = x @ kernel, kernel [in, out] with logical axes `axes`."""

    def __init__(self, cfg: Config, in_dim: int, out_dim: int, axes: Sequence[str | None],
                 init: Init, dtype=None):
        self.cfg = cfg
        self.kernel = init.fan_in((in_dim, out_dim), axes,
                                  dtype if dtype is not None else weight_dtype(cfg))

    def __call__(self, x: jax.Array) -> jax.Array:
        return matmul(self.cfg, x, self.kernel[...])
