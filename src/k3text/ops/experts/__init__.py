"""Routed experts: Σ_k weight_k · expert_{id_k}(x) over the experts one device holds.

`routed_experts` is the entry point; the kernels behind it compute the same sum and differ in
what their cost follows:
- `grouped`: slots sorted by expert, two grouped matmuls (`ragged_dot`) over every held expert;
- `gathered`: a loop over the routed slots touching only the experts hit (decode);
- `reference`: every held expert on every token, combined densely; the tests' yardstick;
- `tokamax_mosaic`: `grouped`'s sum through tokamax's Pallas TPU grouped matmul, MXFP4 experts
  dequantised per tile inside the kernel (TPU; expert dimensions of 128 and more).
`resolve_implementation` turns the `auto` setting into one of them. The weights come as
`LayerExperts` (stacked or split per expert, BF16 or packed MXFP4) and the numerics as
`ExpertFFN`, so this package needs no config and no layer.
"""

from __future__ import annotations

import jax

from k3text import sharding
from k3text.ops.experts import tokamax
from k3text.ops.experts.base import ExpertFFN, LayerExperts
from k3text.ops.experts.gathered import gathered
from k3text.ops.experts.grouped import grouped
from k3text.ops.experts.reference import reference

__all__ = ["IMPLEMENTATIONS", "XLA_IMPLEMENTATIONS", "ExpertFFN", "LayerExperts",
           "resolve_implementation", "routed_experts"]

XLA_IMPLEMENTATIONS = ("grouped", "gathered", "reference")  # any backend, any expert size
IMPLEMENTATIONS = (*XLA_IMPLEMENTATIONS, "tokamax_mosaic")


def resolve_implementation(setting: str, slots: int, held: int, dense_threshold: int,
                           dims: tuple[int, int] | None = None, backend: str | None = None,
                           ) -> str:
    """The kernel for `slots` routed slots over `held` experts of `dims` (hidden, intermediate;
    None: unknown) on `backend` (default: the platform being compiled for): `setting` itself,
    or for `auto` the hit-experts loop up to `dense_threshold` slots (0: held - 1, where a
    grouped matmul starts to pay) and above it the grouped matmuls, tokamax's kernel on a TPU
    where it takes the experts' dimensions."""
    backend = backend or sharding.target_platform()
    if setting == "tokamax_mosaic" and backend != "tpu" and not tokamax.interpreting():
        raise ValueError(f"moe_expert_implementation=tokamax_mosaic runs on TPU, not {backend} "
                         f"(on a CPU only in Pallas's interpreter: PALLAS_INTERPRET=1)")
    if setting != "auto":
        return setting
    threshold = dense_threshold or held - 1
    if slots <= threshold:
        return "gathered"
    if backend == "tpu" and dims is not None and tokamax.supports(*dims):
        return "tokamax_mosaic"
    return "grouped"


def routed_experts(x: jax.Array, weights: jax.Array, local_ids: jax.Array,
                   experts: LayerExperts, ffn: ExpertFFN, implementation: str, *,
                   all_ids_held: bool = False) -> jax.Array:
    """Weighted sum over each token's routed experts that live in `experts`, float32 [N, D].

    x [N, D]; weights, local_ids [N, k] with ids relative to the first held expert: ids outside
    [0, held) belong to other devices and contribute nothing. `all_ids_held` promises none is
    outside (every expert of the layer is here), which lets `gathered` skip its per-slot test.
    """
    if implementation == "grouped":
        return grouped(x, weights, local_ids, experts, ffn)
    if implementation == "gathered":
        return gathered(x, weights, local_ids, experts, ffn, all_ids_held)
    if implementation == "reference":
        return reference(x, weights, local_ids, experts, ffn)
    if implementation == "tokamax_mosaic":
        return tokamax.tokamax_mosaic(x, weights, local_ids, experts, ffn)
    raise ValueError(f"unknown expert implementation {implementation!r}; "
                     f"expected one of {list(IMPLEMENTATIONS)}")
