"""What every expert kernel shares: the routed-expert weights of one layer (`LayerExperts`),
their decoding to compute-dtype matrices, and the expert's numerics (`ExpertFFN`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from k3text.ops import mxfp4

FP32 = jnp.float32


class ExpertFFN(NamedTuple):
    """One expert's numerics: down · act(gate_up · row), gate rows first in gate_up.

    Rows and weights are multiplied in `dtype` at `precision` with float32 results; the
    activation's output is cast back to `dtype` before the down projection."""

    activation: Callable[[jax.Array, jax.Array], jax.Array]  # (gate, up) -> gated value
    dtype: DTypeLike
    precision: jax.lax.PrecisionLike

    def glu(self, h: jax.Array) -> jax.Array:
        """The activation of gate_up's output h [..., 2I] -> [..., I]."""
        width = h.shape[-1] // 2
        return self.activation(h[..., :width], h[..., width:])


class LayerExperts(NamedTuple):
    """The routed-expert weights of one MoE layer, addressed inside the stack they live in.

    Names are `gate_up`, `down` ([out, in] per expert, gate and up fused along out) or, packed
    MXFP4, `gate_up_packed`, `gate_up_scale`, `down_packed`, `down_scale`.

    Stacked form: `arrays` keep a leading [layers] axis (the scanned group's stack; [1] for a
    layer outside any scan) and `layer` picks one entry. Kernels index (layer, expert) in one
    gather, so a decode step reads the experts it hits straight out of the stack. Slicing a
    layer's experts out first, which is what a scan over stacked parameters does, copies every
    expert the layer holds on every step: cost would follow experts held, not experts hit.

    Split form (unrolled layers on one expert shard; see `decoder.split_for_unrolled`): each
    name holds a tuple of per-expert arrays and `layer` is unused. The hit-experts kernel then
    switches to the expert's own branch and multiplies its arrays in place: XLA:CPU copies any
    slice that feeds a dot, so even a one-expert slice costs a write and a reread.
    """

    arrays: dict[str, jax.Array | tuple[jax.Array, ...]]  # [layers, experts, out, in] or split
    layer: jax.Array  # int32 scalar

    @property
    def split(self) -> bool:
        return isinstance(next(iter(self.arrays.values())), tuple)

    @property
    def held(self) -> int:
        first = next(iter(self.arrays.values()))
        return len(first) if self.split else first.shape[1]

    @property
    def packed(self) -> bool:
        """Whether the experts are packed MXFP4 (decoded inside the program)."""
        return "gate_up_packed" in self.arrays

    @staticmethod
    def of(arrays: dict[str, Any], stack_index: Any = None) -> LayerExperts:
        """The experts of one layer from its parameter values: a whole stack and this layer's
        `stack_index` in it, a split layer, or one layer's [experts, ...] arrays."""
        if stack_index is not None:
            return LayerExperts(arrays, jnp.asarray(stack_index, jnp.int32))
        if isinstance(next(iter(arrays.values())), tuple):
            return LayerExperts(arrays, jnp.int32(0))
        return LayerExperts({name: a[None] for name, a in arrays.items()}, jnp.int32(0))

    def matrices(self, dtype: DTypeLike, index: jax.Array | None = None,
                 ) -> tuple[jax.Array, jax.Array]:
        """(gate_up [n, 2I, D], down [n, D, I]) in `dtype` for the held experts at `index` (all
        of them when None). Packed experts are narrowed first, then dequantised, so only the
        selected experts are ever expanded."""
        return self._decoded(lambda name: self.held_array(name, index), dtype)

    def held_array(self, name: str, index: jax.Array | None = None) -> jax.Array:
        """Array `name` of this layer's held experts at `index` (all of them when None), in
        storage form, with a leading [experts] axis."""
        a = self.arrays[name]
        if self.split:  # restacking split experts is a copy
            a = jnp.stack(a)
            return a if index is None else a[index]
        if index is None:
            return jax.lax.dynamic_index_in_dim(a, self.layer, 0, keepdims=False)
        return a[self.layer, index]

    def expert(self, e: int, dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
        """(gate_up [2I, D], down [D, I]) in `dtype` of held expert `e` of the split form,
        read in place."""
        return self._decoded(lambda name: self.arrays[name][e], dtype)

    def _decoded(self, pick: Callable[[str], jax.Array], dtype: DTypeLike,
                 ) -> tuple[jax.Array, jax.Array]:
        if self.packed:
            return (mxfp4.dequantize_mxfp4(pick("gate_up_packed"), pick("gate_up_scale"), dtype),
                    mxfp4.dequantize_mxfp4(pick("down_packed"), pick("down_scale"), dtype))
        return pick("gate_up").astype(dtype), pick("down").astype(dtype)
