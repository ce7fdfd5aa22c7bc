"""MXFP4 quantise/pack/dequantise against an independent OCP MX reference built on ml_dtypes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from k3text.ops.mxfp4 import (
    FP4_VALUES,
    MXFP4_BLOCK,
    dequantize_mxfp4,
    mxfp4_bytes,
    pack_fp4,
    quantize_mxfp4,
    unpack_fp4,
)

F32_MAX = np.finfo(np.float32).max

dequantize = jax.jit(dequantize_mxfp4, static_argnames="dtype")


def reference_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OCP MX v1.0 with ml_dtypes rounding: (codes [..., in], scale bytes [..., in/32]).

    float32 input only: ml_dtypes casts float64 to float4_e2m1fn through float32, rounding twice
    (2.5 + 2**-40 becomes 2.0, not 3.0). A float32 divided by a power of two is exact in
    float32 unless it underflows far below FP4's smallest step, so here it rounds once.
    """
    blocks = w.astype(np.float64).reshape(*w.shape[:-1], -1, MXFP4_BLOCK)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):  # log2(0) = -inf, clamped to the smallest scale
        x = np.clip(np.floor(np.log2(amax)) - 2, -127, 127)
    scale_bytes = (x + 127).astype(np.uint8)
    scale = scale_bytes.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    # float4_e2m1fn casts round to nearest even and saturate at ±6.
    codes = (blocks / scale).astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    return codes.reshape(w.shape), scale_bytes[..., 0]


def reference_dequantize(codes: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """float32 product of ml_dtypes' FP4 and E8M0 decodings; numpy keeps subnormals."""
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scale = scale_bytes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    blocks = values.reshape(*scale.shape, MXFP4_BLOCK)
    with np.errstate(over="ignore"):
        return (blocks * scale[..., None]).reshape(codes.shape)


def assert_bits_equal(actual, expected) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    uint = np.dtype(f"uint{8 * actual.dtype.itemsize}")
    np.testing.assert_array_equal(actual.view(uint), expected.view(uint))


def assert_matches_reference(w: np.ndarray) -> None:
    """quantise -> unpack -> dequantise (jit) equals the reference bit for bit."""
    packed, scale = quantize_mxfp4(w)
    codes, scale_ref = reference_quantize(np.asarray(w, np.float32))
    np.testing.assert_array_equal(unpack_fp4(packed), codes)
    np.testing.assert_array_equal(scale, scale_ref)
    assert_bits_equal(dequantize(packed, scale), reference_dequantize(codes, scale_ref))


def one_block(*values: float, dtype=np.float32) -> np.ndarray:
    """A single [1, 32] block: the given values, then zeros."""
    block = np.zeros((1, MXFP4_BLOCK), dtype)
    block[0, : len(values)] = values
    return block


def test_fp4_values_match_ml_dtypes():
    decoded = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert_bits_equal(FP4_VALUES, decoded)


def test_low_nibble_is_even_element():
    np.testing.assert_array_equal(pack_fp4(np.array([1, 2])), np.array([0x21], np.uint8))
    np.testing.assert_array_equal(pack_fp4(np.array([15, 0, 0, 15])), [0x0F, 0xF0])
    np.testing.assert_array_equal(unpack_fp4(np.array([0x21], np.uint8)), [1, 2])


def test_unpack_inverts_pack_in_numpy_and_jax():
    codes = np.random.default_rng(0).integers(0, 16, size=(3, 4, 64), dtype=np.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 4, 32) and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack_fp4(packed), codes)
    unpacked = jax.jit(unpack_fp4)(jnp.asarray(packed))
    assert isinstance(unpacked, jax.Array)
    np.testing.assert_array_equal(unpacked, codes)


def test_pack_and_unpack_reject_bad_input():
    with pytest.raises(ValueError):
        pack_fp4(np.array([16, 0]))
    with pytest.raises(ValueError):
        pack_fp4(np.array([1, 2, 3]))
    with pytest.raises(TypeError):
        unpack_fp4(np.array([0x21], np.int8))


def test_dequantize_every_code_and_scale_byte():
    # Row s holds all 16 codes twice under scale byte s: subnormal products (s = 0, 1),
    # overflow to ±inf (s >= 253) and NaN (s = 255) included.
    codes = np.tile(np.arange(16, dtype=np.uint8), (256, 2))
    scale = np.arange(256, dtype=np.uint8)[:, None]
    expected = reference_dequantize(codes, scale)
    assert_bits_equal(dequantize(pack_fp4(codes), scale), expected)
    assert_bits_equal(
        dequantize(pack_fp4(codes), scale, dtype=jnp.bfloat16), expected.astype(ml_dtypes.bfloat16)
    )


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("log2_scale", [-140, -60, -8, 0, 8, 60, 116])
def test_round_trip_matches_reference(dtype, log2_scale):
    rng = np.random.default_rng(log2_scale + 1000)
    # Per-block magnitudes spread over 2**±4 around 2**log2_scale, with a heavy tail inside each
    # block so that small elements round to zero and large ones saturate.
    block_scale = np.exp2(log2_scale + rng.uniform(-4, 4, size=(2, 8, 4, 1)))
    shape = (2, 8, 4, MXFP4_BLOCK)
    elements = rng.standard_normal(shape) * np.exp2(rng.uniform(-6, 2, shape))
    w = (elements * block_scale).reshape(2, 8, 4 * MXFP4_BLOCK).astype(dtype)
    assert_matches_reference(w)


@settings(max_examples=200, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        (2, 2 * MXFP4_BLOCK),
        elements=st.floats(width=32, allow_infinity=False, allow_nan=False),
    )
)
def test_round_trip_matches_reference_on_any_finite_float32(w):
    assert_matches_reference(w)


def test_ties_round_to_even_and_large_values_saturate():
    # 4.0 pins the block exponent to 0, so the values are rounded as written.
    w = one_block(4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -2.5, -5.0)
    packed, scale = quantize_mxfp4(w)
    np.testing.assert_array_equal(scale, [[127]])
    np.testing.assert_array_equal(
        unpack_fp4(packed)[0, :12], [6, 0, 2, 2, 4, 4, 6, 6, 7, 8, 12, 14]
    )
    assert_matches_reference(w)


def test_float64_input_is_rounded_once():
    w = one_block(4.0, 2.5 + 2**-40, 2.5 - 2**-40, 0.25 + 2**-50, 5.0 + 2**-40, dtype=np.float64)
    packed, _ = quantize_mxfp4(w)
    np.testing.assert_array_equal(unpack_fp4(packed)[0, :5], [6, 5, 4, 1, 7])


def test_zero_blocks_get_the_smallest_scale_and_keep_their_sign():
    w = np.concatenate([one_block(), -one_block()], axis=-1)  # a block of 0.0, one of -0.0
    packed, scale = quantize_mxfp4(w)
    np.testing.assert_array_equal(scale, [[0, 0]])
    np.testing.assert_array_equal(unpack_fp4(packed), np.repeat([[0, 8]], MXFP4_BLOCK, axis=1))
    assert_bits_equal(dequantize(packed, scale), w)


def test_tiny_blocks_clamp_to_scale_byte_zero_and_decode_exactly():
    # floor(log2(2**-125)) - 2 = -127: the E8M0 floor, a subnormal scale. 1.5 * 2**-128 is the
    # tie 0.75 after scaling and rounds to even (1.0).
    w = one_block(2.0**-125, 1e-40, -1e-40, 2.0**-128, 1.5 * 2.0**-128, 2.0**-149)
    packed, scale = quantize_mxfp4(w)
    np.testing.assert_array_equal(scale, [[0]])
    np.testing.assert_array_equal(unpack_fp4(packed)[0, :6], [6, 0, 8, 1, 2, 0])
    expected = one_block(2.0**-125, 0.0, -0.0, 2.0**-128, 2.0**-127, 0.0)
    assert_bits_equal(dequantize(packed, scale), expected)
    assert_matches_reference(w)


@pytest.mark.parametrize("k", [-127, -50, 0, 50, 124])
def test_six_times_the_scale_is_exact_and_beyond_saturates(k):
    exact, _ = quantize_mxfp4(one_block(6 * 2.0**k, -6 * 2.0**k))
    np.testing.assert_array_equal(unpack_fp4(exact)[0, :2], [7, 15])
    # 7.5 * 2**k keeps the exponent k and saturates to 6 * 2**k; 8 * 2**k moves up one.
    w = np.concatenate([one_block(7.5 * 2.0**k), one_block(8 * 2.0**k, 6 * 2.0**k)], axis=-1)
    packed, scale = quantize_mxfp4(w)
    np.testing.assert_array_equal(scale, [[k + 127, k + 128]])
    assert_bits_equal(dequantize(packed, scale)[0, [0, 32, 33]], np.float32([6, 8, 6]) * 2.0**k)
    assert_matches_reference(w)


def test_float32_max_saturates_to_a_finite_value():
    w = one_block(F32_MAX, -F32_MAX, 1.0)
    packed, scale = quantize_mxfp4(w)
    np.testing.assert_array_equal(scale, [[252]])  # floor(log2(max)) - 2 = 125
    expected = np.float32([6, -6, 0]) * np.float32(2.0**125)
    assert_bits_equal(dequantize(packed, scale)[0, :3], expected)
    assert_matches_reference(w)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e300])
def test_non_finite_or_out_of_range_input_raises(bad):
    with pytest.raises(ValueError, match="finite"):
        quantize_mxfp4(one_block(1.0, bad, dtype=np.float64))


def test_shape_errors():
    with pytest.raises(ValueError):
        quantize_mxfp4(np.zeros((2, 48), np.float32))
    packed, scale = quantize_mxfp4(np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError):
        dequantize_mxfp4(packed, scale[:, :1])


def test_bf16_output_is_the_float32_result_rounded():
    w = np.random.default_rng(1).standard_normal((4, 8, 128)).astype(np.float32)
    packed, scale = quantize_mxfp4(w)
    out = dequantize(packed, scale, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16 and out.shape == w.shape
    assert_bits_equal(out, np.asarray(dequantize(packed, scale)).astype(ml_dtypes.bfloat16))


def test_fused_gate_up_dequantises_to_the_concatenation():
    rng = np.random.default_rng(2)
    gate = quantize_mxfp4(rng.standard_normal((3, 8, 64)).astype(np.float32))
    up = quantize_mxfp4(rng.standard_normal((3, 8, 64)).astype(np.float32))
    fused = [np.concatenate(pair, axis=-2) for pair in zip(gate, up, strict=True)]
    expected = jnp.concatenate([dequantize(*gate), dequantize(*up)], axis=-2)
    assert_bits_equal(dequantize(*fused), expected)


def test_storage_is_4_25_bits_per_weight():
    packed, scale = quantize_mxfp4(np.zeros((3, 8, 64), np.float32))
    assert mxfp4_bytes((3, 8, 64)) == packed.nbytes + scale.nbytes
    assert mxfp4_bytes((7168, 2048)) * 8 == 4.25 * 7168 * 2048
    with pytest.raises(ValueError):
        mxfp4_bytes((8, 48))


def test_leading_batch_dims():
    packed, scale = quantize_mxfp4(np.ones((2, 3, 4, 64), np.float32))
    assert packed.shape == (2, 3, 4, 32) and scale.shape == (2, 3, 4, 2)
    out = dequantize(packed, scale)
    np.testing.assert_array_equal(out, np.ones((2, 3, 4, 64), np.float32))
