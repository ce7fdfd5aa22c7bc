"""MXFP4 weights in the compressed-tensors ``mxfp4-pack-quantized`` layout (OCP MX v1.0).

A weight ``W[..., out, in]`` is stored as two uint8 tensors:

* ``weight_packed`` ``[..., out, in/2]``: FP4 E2M1 codes, two per byte. The low nibble holds
  element ``2j`` and the high nibble element ``2j + 1``.
* ``weight_scale`` ``[..., out, in/32]``: one E8M0 byte ``s`` per 32 consecutive inputs, meaning
  ``2**(s - 127)``; ``s = 255`` is NaN.

That is 4.25 bits per weight. Code ``c`` means ``FP4_VALUES[c]``: bit 3 is the sign and the low
three bits index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.

Quantisation is numpy (checkpoint export and test fixtures); dequantisation is jax and runs inside
the jitted MoE forward on the selected experts.
"""

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

MXFP4_BLOCK = 32

_FP4_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
FP4_VALUES = np.concatenate([_FP4_MAGNITUDES, -_FP4_MAGNITUDES])  # code 8 is -0.0
FP4_VALUES.flags.writeable = False

_E2M1_EMAX = 2  # 6 = 1.5 * 2**2
_E2M1_MAX = 6.0
_E8M0_BIAS = 127
E8M0_NAN = 255
_F32_INF_BITS = 0x7F80_0000
_F32_NAN_BITS = 0x7FC0_0000



def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise ``w[..., out, in]`` to ``(packed [..., out, in/2], scale [..., out, in/32])``.

    Follows OCP MX v1.0: each block of 32 inputs gets the shared exponent
    ``X = floor(log2(max|v|)) - 2`` (2 being the largest E2M1 exponent), clamped to E8M0's
    ``[-127, 127]``, and each ``v / 2**X`` is rounded to the nearest E2M1 value, ties to even,
    saturating at ±6. Rounding happens once, in the input's precision (float64 stays float64).

    Edge cases:

    * An all-zero block has ``log2(0) = -inf``, which the clamp turns into scale byte 0.
    * A block whose max is below ``2**-124`` also gets scale byte 0 (``X = -127``, the E8M0
      floor, a float32 subnormal); its elements of magnitude up to ``2**-129`` round to zero.
    * The sign bit is copied from the input, so ``-0.0`` and negatives that round to zero are
      code 8 (-0.0).
    * The floor puts a block's max at ``[4, 8) * 2**X``, so elements from ``7 * 2**X`` up,
      which would round to 8, saturate to ±6 rather than raise the scale (the OCP rule).

    Raises:
        ValueError: if ``in`` is not a multiple of 32, or ``w`` holds NaN, ±inf or a magnitude
            above float32's max. E2M1 has no inf or NaN and a NaN scale would erase the whole
            block, so a non-finite weight is reported at export rather than served.
    """
    w = np.asarray(w)
    if w.ndim == 0 or w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"last axis must be a multiple of {MXFP4_BLOCK}, got shape {w.shape}")
    # float16 and bfloat16 are exact in float32; float64 keeps its precision so the only
    # rounding is onto the FP4 grid.
    w = w.astype(np.promote_types(w.dtype, np.float32))
    if not np.all(np.abs(w) <= np.finfo(np.float32).max):  # also False for NaN
        raise ValueError("MXFP4 quantisation needs finite values within float32 range")

    blocks = w.reshape(*w.shape[:-1], -1, MXFP4_BLOCK)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    # frexp is exact where log2 may round up near powers of two: amax = m * 2**e with m in
    # [0.5, 1), so floor(log2(amax)) = e - 1. The range check above keeps X <= 125.
    _, e = np.frexp(amax)
    x = np.where(amax > 0, np.maximum(e - 1 - _E2M1_EMAX, -_E8M0_BIAS), -_E8M0_BIAS)

    # Scaling by a power of two is exact unless it underflows, which only happens far below
    # the smallest FP4 step.
    magnitude = _round_to_e2m1(np.ldexp(np.abs(blocks), -x))
    codes = np.searchsorted(_FP4_MAGNITUDES, magnitude).astype(np.uint8)
    codes |= np.signbit(blocks).astype(np.uint8) << 3
    scale = (x + _E8M0_BIAS).astype(np.uint8)
    return pack_fp4(codes.reshape(w.shape)), scale[..., 0]


def _round_to_e2m1(a: np.ndarray) -> np.ndarray:
    """Round non-negative values to E2M1 magnitudes, ties to even, saturating at 6."""
    # The grid step is 0.5 below 2, 1 below 4 and 2 above. Within each range an even multiple
    # of the step is an even code, so rint (ties to even) on a / step picks the even code.
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0)).astype(a.dtype)
    return np.minimum(np.rint(a / step) * step, _E2M1_MAX)


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """Pack FP4 codes ``[..., n]`` (integers in ``[0, 16)``, ``n`` even) into uint8 ``[..., n/2]``.

    Element ``2j`` goes to the low nibble and element ``2j + 1`` to the high nibble.
    """
    codes = np.asarray(codes)
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"last axis must have even length, got shape {codes.shape}")
    if not np.issubdtype(codes.dtype, np.integer) or np.any((codes < 0) | (codes > 15)):
        raise ValueError("FP4 codes must be integers in [0, 16)")
    codes = codes.astype(np.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4[ArrayT: (np.ndarray, jax.Array)](packed: ArrayT) -> ArrayT:
    """Split uint8 ``[..., n]`` into FP4 codes ``[..., 2n]``, low nibble first.

    Works on numpy arrays and on jax arrays, traced ones included; the result is of the same kind.
    """
    if packed.dtype != np.uint8:
        raise TypeError(f"packed FP4 must be uint8, got {packed.dtype}")
    xp = jnp if isinstance(packed, jax.Array) else np
    nibbles = xp.stack([packed & 0x0F, packed >> 4], axis=-1)
    return nibbles.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_mxfp4(
    packed: jax.Array | np.ndarray,
    scale: jax.Array | np.ndarray,
    dtype: DTypeLike = jnp.float32,
) -> jax.Array:
    """Decode ``packed [..., out, in/2]`` and ``scale [..., out, in/32]`` to ``[..., out, in]``.

    Elementwise and shape-static, so it jits (``dtype`` static) and fuses into its consumer.
    Every product of an E2M1 value and an E8M0 scale is exactly representable in float32,
    subnormals included, or overflows: this returns those exact values (±inf on overflow, which
    only hand-made scale bytes >= 253 reach; NaN for scale byte 255) on every backend, and a
    narrower ``dtype`` is one rounding of them.
    """
    packed, scale = jnp.asarray(packed), jnp.asarray(scale)
    n_in = 2 * packed.shape[-1]
    if packed.shape[:-1] != scale.shape[:-1] or n_in != MXFP4_BLOCK * scale.shape[-1]:
        raise ValueError(f"packed {packed.shape} and scale {scale.shape} do not match")
    if scale.dtype != jnp.uint8:
        raise TypeError(f"E8M0 scales must be uint8, got {scale.dtype}")
    codes = unpack_fp4(packed).reshape(*scale.shape, MXFP4_BLOCK)
    bits = _scaled_fp4_bits(codes, scale[..., None])
    values = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return values.reshape(*packed.shape[:-1], n_in).astype(dtype)


def _scaled_fp4_bits(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """Float32 bit patterns of ``FP4_VALUES[codes] * 2**(scale - 127)``, built exactly.

    Integer ops rather than a float multiply: XLA:CPU and TPU flush subnormal operands and
    results to zero, and scale byte 0 (``2**-127``) is itself a float32 subnormal.
    """
    codes, scale = codes.astype(jnp.int32), scale.astype(jnp.int32)
    exponent, mantissa = (codes >> 1) & 3, codes & 1
    # A normal E2M1 magnitude is 1.m * 2**(exponent - 1); the subnormal 0.5 (exponent 0,
    # mantissa 1) is 1.0 * 2**-1, which the same exponent formula covers once its fraction is 0.
    frac = jnp.where(exponent > 0, mantissa, 0)
    biased = scale + exponent - 1  # float32 biased exponent of the product, >= -1
    normal = (biased << 23) | (frac << 22)
    # Only selected when biased <= 0: a right shift by at most 2 keeps the 2-bit significand.
    subnormal = ((2 | frac) << 22) >> (1 - biased)
    bits = jnp.where(biased > 0, normal, subnormal)
    bits = jnp.where(biased >= 255, _F32_INF_BITS, bits)
    bits = jnp.where((codes & 7) == 0, 0, bits).astype(jnp.uint32)
    bits |= (codes.astype(jnp.uint32) >> 3) << 31
    return jnp.where(scale == E8M0_NAN, jnp.uint32(_F32_NAN_BITS), bits)


def mxfp4_bytes(shape: Sequence[int]) -> int:
    """Bytes of ``weight_packed`` plus ``weight_scale`` for a logical ``[..., out, in]`` weight."""
    *rows, n_in = shape
    if n_in % MXFP4_BLOCK:
        raise ValueError(f"last axis must be a multiple of {MXFP4_BLOCK}, got shape {shape}")
    return math.prod(rows) * (n_in // 2 + n_in // MXFP4_BLOCK)
