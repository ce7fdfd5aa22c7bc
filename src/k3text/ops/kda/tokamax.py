"""tokamax's Kimi Delta Attention (`tokamax.ops.kimi_delta_attention`, tokamax 0.0.17) called in
k3text's layouts, so it can be held against `k3text.ops.kda.reference.kda_recurrent` on the same
arrays.

Where tokamax's contract differs from `k3text.ops.kda`:

=================  =====================================  =========================================
                   k3text.ops.kda                         tokamax.ops.kimi_delta_attention
=================  =====================================  =========================================
q, k, g            ``[B, T, H, K]``                       head-first ``[H, B, T, K]``
v                  ``[B, T, H, V]``                       ``[H, B, T, V]``
beta               ``[B, T, H]``                          ``[H, B, T]``, must lie in [0, 1]
state              ``[B, H, K, V]`` float32               ``[B, N, H, K, V]``: N states per row, one
                                                          per segment (N = 1 without segment_ids)
gate               log-space decay ``g <= 0``; the layer  either log-space ``g``
                   activates it (`layers.attention_kda.   (``use_gate_in_kernel=False``) or the raw
                   decay_gate`)                           projection with ``a_log``,
                                                          ``delta_time_bias`` and optionally
                                                          ``lower_bound`` fused into the kernel
q/k norm, scale    the layer L2-normalises q and k and    ``use_qk_l2norm`` normalises inside (same
                   scales q by ``K**-0.5``                eps, inside the square root); ``scale``
                                                          defaults to ``K**-0.5``
ragged rows        tokens with ``beta = 0, g = 0`` are    ``segment_ids [B, T]``, 1-indexed, 0 marks
                   exact no-ops (padding)                 padding; several sequences may share a row
outputs            float32                                the dtype of q
sequence length    any T                                  ``xla``: any; ``xla_chunked`` and
                                                          ``mosaic``: T % 64 == 0 unless
                                                          segment_ids are given
=================  =====================================  =========================================

Which gates each implementation accepts (tests/test_kda_tokamax.py holds this table true;
an unsupported combination raises ``NotImplementedError``):

- ``xla`` — a token-by-token ``fori_loop`` over heads, rows and time: pre-activated log gates,
  Kimi Linear's fused softplus gate (``lower_bound=None``) and K3's fused lower-bounded sigmoid.
- ``xla_chunked`` — chunk 64, pure JAX: only the fused lower-bounded gate (K3). Pre-activated log
  gates and Kimi Linear's fused softplus gate are refused.
- ``mosaic`` — Pallas TPU forward and VJP, for TPU v6 and newer: pre-activated log gates, or the
  fused lower-bounded gate; the fused softplus gate is refused. ``K <= 256``, bf16 or fp32
  inputs. Pallas kernels are not auto-partitioned: call it inside ``shard_map``.

Without a TPU, ``mosaic`` still lowers and runs: ``tokamax.config.cross_compile(True)`` skips the
device check, and an abstract mesh whose device names the TPU generation
(``jax.sharding.use_abstract_mesh``) answers the kernel's VMEM query. Exported with
``platforms=["tpu"]`` it becomes a ``tpu_custom_call``; with ``PALLAS_INTERPRET=1`` set while it
is traced, and lowered for the CPU, Pallas's TPU interpreter runs the kernels on the CPU
(an ``Auto`` mesh axis there: with ``Explicit`` the interpreter's buffer updates fail their
sharding check).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from tokamax import ops as tokamax_ops

__all__ = ["Implementation", "tokamax_kda"]

Implementation = Literal["xla", "xla_chunked", "mosaic"]


def _head_first(x: jax.Array) -> jax.Array:
    return jnp.moveaxis(x, 2, 0)  # [B, T, H, ...] -> [H, B, T, ...]


def tokamax_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    gate: jax.Array,
    beta: jax.Array,
    *,
    implementation: Implementation,
    initial_state: jax.Array | None = None,
    a_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    lower_bound: float | None = None,
    l2_normalize_qk: bool = False,
    scale: float = 1.0,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """KDA through tokamax, arguments and results in `k3text.ops.kda` layouts.

    Args:
      q, k, gate: ``[B, T, H, K]``. ``gate`` is the log-space decay when ``a_log`` is None;
        otherwise the raw decay projection, activated inside the kernel as
        `layers.attention_kda.decay_gate` does (``dt_bias [H*K]``; ``lower_bound`` selects
        K3's bounded sigmoid, None Kimi Linear's softplus).
      v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
      initial_state: ``[B, H, K, V]`` or None for zeros.
      l2_normalize_qk, scale: what tokamax applies to q and k first (k3text's ops take them
        normalised and scaled already, hence the defaults).
      valid: ``[B, T]`` bool, False on padding tokens (tokamax's segment 0), or None.
      implementation: ``xla``, ``xla_chunked`` or ``mosaic``, passed on as is.

    Returns:
      ``(o [B, T, H, V], final_state [B, H, K, V])``, both float32.
    """
    segment_ids = None if valid is None else valid.astype(jnp.int32)
    o, state = tokamax_ops.kimi_delta_attention(
        *(_head_first(a) for a in (q, k, v, gate, beta)),
        a_log=a_log,
        delta_time_bias=dt_bias,
        scale=scale,
        initial_state=None if initial_state is None else initial_state[:, None],
        output_final_state=True,
        use_qk_l2norm=l2_normalize_qk,
        use_gate_in_kernel=a_log is not None,
        segment_ids=segment_ids,
        lower_bound=lower_bound,
        max_num_segments=None if segment_ids is None or initial_state is not None else 1,
        implementation=implementation,
    )
    return jnp.moveaxis(o, 0, 2).astype(jnp.float32), state[:, 0].astype(jnp.float32)
