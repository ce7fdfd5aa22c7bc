"""Dense projections. Kernels are stored [in, out] with their logical axes by the layer that owns
them and go through `matmul`. The MLP kernels, like the routed experts, are stored [out, in] (the
checkpoint's layout) and go through `matmul_out_in`: at batch 1 that is the fused
matrix-vector form XLA:CPU runs fastest (`matvec`)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from k3text.config import Config
from k3text.layers.initializers import compute_dtype, precision


def matmul(cfg: Config, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x @ kernel in the activation dtype at the configured precision."""
    dtype = compute_dtype(cfg)
    return jnp.dot(x.astype(dtype), kernel.astype(dtype), precision=precision(cfg))


def matmul_out_in(cfg: Config, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [..., in] @ kernel.T for a kernel stored [out, in]; one token goes through `matvec`."""
    dtype, prec = compute_dtype(cfg), precision(cfg)
    x, kernel = x.astype(dtype), kernel.astype(dtype)
    if math.prod(x.shape[:-1]) == 1:
        return matvec(x.reshape(-1), kernel, prec).reshape(*x.shape[:-1], -1)
    return jnp.einsum("...i,oi->...o", x, kernel, precision=prec)


# Kernels below this many elements keep the library product: at 2K-8K elements it matched or
# beat the fused loop (0.9-1.0x), from 16K elements the fused loop won (1.05-1.8x).
_FUSED_MATVEC_MIN_ELEMENTS = 1 << 14


def matvec(v: jax.Array, kernel: jax.Array, precision: Any,
           preferred_element_type: Any = None) -> jax.Array:
    """v [in] @ kernel.T -> [out] for a kernel stored [out, in] (one token at batch-1 decode).

    Written as a rank-1 vector times the transposed matrix, XLA:CPU fuses the product into one
    loop over contiguous kernel rows, which beats the library product it calls for kernel @ v
    on 1-4 MiB float32 kernels (1.5-1.8x with jaxlib 0.12, which runs the loop on one core;
    jaxlib 0.10 also split it across the cores). Tiny kernels keep the library product.
    """
    if kernel.size >= _FUSED_MATVEC_MIN_ELEMENTS:
        return jnp.dot(v, kernel.T, precision=precision,
                       preferred_element_type=preferred_element_type)
    return jnp.dot(kernel, v, precision=precision, preferred_element_type=preferred_element_type)
