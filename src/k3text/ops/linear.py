"""Products with kernels stored [out, in] (the checkpoints' layout: MLP kernels, routed experts).

`project_out_in` is the one function callers use; the backend-specific form it takes is chosen
here, when the program is lowered for a platform, so model code reads the same everywhere.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

# Kernels below this many elements keep the library product on XLA:CPU: at 2K-8K elements it
# matched or beat the fused loop (0.9-1.0x), from 16K elements the fused loop won (1.05-1.8x).
_FUSED_MATVEC_MIN_ELEMENTS = 1 << 14


def project_out_in(x: jax.Array, kernel: jax.Array, precision: jax.lax.PrecisionLike = None,
                   preferred_element_type: DTypeLike | None = None, *,
                   computed_kernel: bool = False) -> jax.Array:
    """x [..., in] @ kernel.T -> [..., out] for a kernel stored [out, in], in the operands' dtype.

    `computed_kernel`: the kernel is produced inside the program (e.g. dequantised MXFP4)
    rather than read from memory; see `_cpu_one_token`.
    """

    def general(x: jax.Array, kernel: jax.Array) -> jax.Array:
        return jnp.einsum("...i,oi->...o", x, kernel, precision=precision,
                          preferred_element_type=preferred_element_type)

    if math.prod(x.shape[:-1]) != 1:
        return general(x, kernel)

    def cpu(x: jax.Array, kernel: jax.Array) -> jax.Array:
        y = _cpu_one_token(x.reshape(-1), kernel, precision, preferred_element_type,
                           computed_kernel)
        return y.reshape(*x.shape[:-1], -1)

    # Resolved at lowering (no conditional reaches the compiler), so a program exported for
    # another platform from a CPU host gets that platform's form.
    return jax.lax.platform_dependent(x, kernel, cpu=cpu, default=general)


def _cpu_one_token(v: jax.Array, kernel: jax.Array, precision: jax.lax.PrecisionLike,
                   preferred_element_type: DTypeLike | None, computed_kernel: bool,
                   ) -> jax.Array:
    """v [in] @ kernel.T -> [out] on XLA:CPU (one token: batch-1 decode, one routed slot).

    Written as a rank-1 vector times the transposed matrix, XLA:CPU fuses the product into one
    loop over contiguous kernel rows, which beats the library product it calls for kernel @ v
    on 1-4 MiB float32 kernels (1.5-1.8x with jaxlib 0.12, which runs the loop on one core;
    jaxlib 0.10 also split it across the cores). Tiny kernels keep the library product, and so
    do computed ones: the fused loop would recompute the kernel's producer (an MXFP4 decode)
    inside it, which loses to computing the kernel once.
    """
    if kernel.size >= _FUSED_MATVEC_MIN_ELEMENTS and not computed_kernel:
        return jnp.dot(v, kernel.T, precision=precision,
                       preferred_element_type=preferred_element_type)
    return jnp.dot(kernel, v, precision=precision, preferred_element_type=preferred_element_type)
