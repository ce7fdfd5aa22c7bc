"""Dense projections. Kernels are stored [in, out] with their logical axes by the layer that owns
them and go through `matmul`; the MLP kernels are stored [out, in] and go through
`matmul_out_in` (see there why)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3text.config import Config
from k3text.layers.initializers import compute_dtype, precision


def matmul(cfg: Config, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x @ kernel in the activation dtype at the configured precision."""
    dtype = compute_dtype(cfg)
    return jnp.dot(x.astype(dtype), kernel.astype(dtype), precision=precision(cfg))


def matmul_out_in(cfg: Config, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [..., in] @ kernel.T for a kernel stored [out, in].

    One token (batch-1 decode) is a vector @ matrix product. Written as a rank-1 vector times
    the transposed [out, in] matrix, XLA:CPU fuses it into one loop over contiguous kernel rows
    that it splits across the cores; the library product it calls otherwise runs a 0.5-2 MB
    float32 matrix on one core (1.3-1.8x slower here). Several tokens take the plain product.
    """
    dtype, prec = compute_dtype(cfg), precision(cfg)
    x, kernel = x.astype(dtype), kernel.astype(dtype)
    if math.prod(x.shape[:-1]) == 1:
        return jnp.dot(x.reshape(-1), kernel.T, precision=prec).reshape(*x.shape[:-1], -1)
    return jnp.einsum("...i,oi->...o", x, kernel, precision=prec)
