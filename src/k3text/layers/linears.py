"""Dense projections. Kernels are stored [in, out] with their logical axes by the layer that owns
them and go through `matmul`. The MLP kernels, like the routed experts, are stored [out, in] (the
checkpoint's layout) and go through `matmul_out_in`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3text.config import Config
from k3text.layers.initializers import compute_dtype, precision


def matmul(cfg: Config, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x @ kernel in the activation dtype at the configured precision."""
    dtype = compute_dtype(cfg)
    return jnp.dot(x.astype(dtype), kernel.astype(dtype), precision=precision(cfg))


def matmul_out_in(cfg: Config, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [..., in] @ kernel.T for a kernel stored [out, in], in the activation dtype at the
    configured precision."""
    dtype = compute_dtype(cfg)
    return jnp.einsum("...i,oi->...o", x.astype(dtype), kernel.astype(dtype),
                      precision=precision(cfg))
