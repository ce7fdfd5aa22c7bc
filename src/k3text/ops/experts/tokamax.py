"""tokamax's grouped matmul (`tokamax.ragged_dot_general`, `mosaic`: the Pallas TPU megablox
kernel) over every held expert, MXFP4 experts dequantised per tile inside the kernel.

The same sum as `grouped` (slots sorted by expert, gate_up then down), with the weights handed
to the kernel without expanding them in HBM:
- packed MXFP4 experts become a `qwix.QArray`: float4 E2M1 values ``[G, in, out]`` and bfloat16
  scales ``[G, in/32, out]`` (an E8M0 byte is bfloat16's exponent field, so the scales are
  exact). The kernel tiles the contraction axis and scales each tile as it loads it. Scales along
  the lane axis would need 128 inputs per scale (tokamax's `quant_block_spec`), so the values
  go contraction-first: the checkpoints' ``[G, out, in]`` codes are transposed once per call,
  as 4-bit values (a quarter of the bytes `grouped`'s bfloat16 expansion writes);
- BF16 experts go as they are stored (``[G, out, in]``, contracted on their last axis: the
  kernel's transposed-rhs form).
The kernel needs every matrix dimension of at least 128 (`MIN_DIM`); rows are padded to whole
128-row tiles. Rows past the last group are never written by the kernel, so they are masked,
not multiplied by a zero weight.

On a CPU the kernel runs in Pallas's TPU interpreter when ``PALLAS_INTERPRET=1`` is set while it
is traced (the convention tokamax's KDA kernels read), with `tokamax.config.cross_compile` and an
abstract TPU mesh as for those (`k3text.ops.kda.tokamax`); otherwise only TPUs run it.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import qwix
import tokamax

from k3text.ops import mxfp4
from k3text.ops.experts.base import FP32, ExpertFFN, LayerExperts
from k3text.ops.experts.grouped import RAGGED_DIMS, sort_by_expert

MIN_DIM = 128  # the kernel's smallest tile along every matrix dimension

# x [M, in] . w [G, in, out] -> [M, out]: the MXFP4 experts' kernel layout (BF16 experts go as
# stored, `RAGGED_DIMS`).
_IN_OUT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)

_BF16_NAN_BITS = 0x7FC0
_BF16_2_POW_MINUS_127_BITS = 0x0040  # E8M0 byte 0 is 2^-127: a bfloat16 subnormal


def supports(hidden: int, intermediate: int) -> bool:
    """Whether the kernel takes experts of these dimensions (gate_up [2I, D], down [D, I])."""
    return min(hidden, intermediate) >= MIN_DIM


def e8m0_as_bfloat16(scale: jax.Array) -> jax.Array:
    """E8M0 scale bytes as the bfloat16 powers of two they mean, exactly (255 is NaN)."""
    s = scale.astype(jnp.uint16)
    bits = jnp.where(s == 0, jnp.uint16(_BF16_2_POW_MINUS_127_BITS), s << 7)
    bits = jnp.where(s == mxfp4.E8M0_NAN, jnp.uint16(_BF16_NAN_BITS), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def mxfp4_operand(packed: jax.Array, scale: jax.Array) -> qwix.QArray:
    """Packed MXFP4 experts ([G, out, in/2] bytes, [G, out, in/32] E8M0) as the kernel's
    contraction-first quantised operand: float4 values [G, in, out], bfloat16 scales
    [G, in/32, out]."""
    codes = mxfp4.unpack_fp4(packed)  # [G, out, in] uint8 in [0, 16)
    values = jax.lax.bitcast_convert_type(jnp.swapaxes(codes, 1, 2).astype(jnp.uint4),
                                          jnp.float4_e2m1fn)
    return qwix.QArray(values, jnp.swapaxes(e8m0_as_bfloat16(scale), 1, 2),
                       qtype=jnp.float4_e2m1fn)


def interpreting() -> bool:
    """Whether Pallas kernels traced now run in its TPU interpreter (``PALLAS_INTERPRET``)."""
    return os.environ.get("PALLAS_INTERPRET", "") not in ("", "0")


def _kernel():
    if not interpreting():
        return "mosaic"
    # tokamax's public entry points take only the kernel's name; the interpreter is a field of
    # its implementation object.
    from tokamax._src.ops.ragged_dot.pallas_mosaic_tpu import PallasMosaicTpuRaggedDot

    return (PallasMosaicTpuRaggedDot(interpret=True),)


def _grouped_matmul(rows: jax.Array, w: jax.Array | qwix.QArray, sizes: jax.Array,
                    ffn: ExpertFFN) -> jax.Array:
    dims = _IN_OUT if isinstance(w, qwix.QArray) else RAGGED_DIMS
    return tokamax.ragged_dot_general(rows, w, sizes, dims, precision=ffn.precision,
                                      preferred_element_type=FP32, implementation=_kernel())


def _layer_operands(experts: LayerExperts, dtype: jax.typing.DTypeLike,
                    ) -> tuple[jax.Array | qwix.QArray, jax.Array | qwix.QArray]:
    """(gate_up, down) of the held experts as the kernel takes them."""
    pick = experts.held_array
    if experts.packed:
        return tuple(mxfp4_operand(pick(f"{n}_packed"), pick(f"{n}_scale"))
                     for n in ("gate_up", "down"))
    return pick("gate_up").astype(dtype), pick("down").astype(dtype)


def tokamax_mosaic(x: jax.Array, weights: jax.Array, local_ids: jax.Array,
                   experts: LayerExperts, ffn: ExpertFFN) -> jax.Array:
    """Σ over each token's routed slots held here of weight · expert(x); see `routed_experts`."""
    gate_up, down = _layer_operands(experts, ffn.dtype)
    hidden = x.shape[-1]
    intermediate = (gate_up.shape[2] if isinstance(gate_up, qwix.QArray) else gate_up.shape[1]) // 2
    if not supports(hidden, intermediate):
        raise ValueError(f"moe_expert_implementation=tokamax_mosaic needs expert dimensions of at "
                         f"least {MIN_DIM} (the kernel's tiles), got hidden {hidden} and "
                         f"intermediate {intermediate}; use grouped")
    slots = sort_by_expert(weights, local_ids, experts.held)
    n = slots.token.shape[0]
    rows = jnp.take(x, slots.token, axis=0).astype(ffn.dtype)
    rows = jnp.pad(rows, ((0, -(-n // MIN_DIM) * MIN_DIM - n), (0, 0)))
    h = _grouped_matmul(rows, gate_up, slots.sizes, ffn)
    y = _grouped_matmul(ffn.glu(h).astype(ffn.dtype), down, slots.sizes, ffn)[:n]
    computed = jnp.arange(n) < jnp.sum(slots.sizes)  # the held slots sort first
    contribution = jnp.where(computed[:, None], y * slots.weight[:, None], 0.0)
    return jnp.zeros(x.shape, FP32).at[slots.token].add(contribution)
