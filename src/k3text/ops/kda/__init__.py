"""Kimi Delta Attention ops: the delta rule with a per-channel decay, and its short causal conv.

One public function per op, each taking an explicit implementation; `reference` holds the forms
every implementation is tested against (tests/test_kda_ops.py runs them all on the same cases).

- `prefill(..., implementation=)`, a whole sequence or prefill chunk:
  - ``recurrent``: the per-token scan of `reference.kda_recurrent`;
  - ``chunked``: k3text's chunked form in matmul form (`chunked.kda_chunked`), differentiable;
  - ``tokamax_mosaic``: tokamax's Pallas TPU kernel (`tokamax.tokamax_kda` with ``mosaic``),
    inside ``shard_map`` over the active mesh (Pallas kernels are not auto-partitioned).
- `decode_step(..., implementation=)`, one token per sequence over the slot pool, from the raw
  projections (conv, activations, gate and delta rule together, as serving stacks fuse them):
  - ``xla``: `conv.causal_conv1d_step`, `activations`, `reference.kda_step`;
  - ``tokamax_mosaic``: tokamax's fused conv + delta-rule Pallas TPU kernel, inside
    ``shard_map``.
- `causal_conv1d`, `causal_conv1d_step`: the conv (`conv`); `decay_gate`, `mix_qkv`: the
  activations (`activations`).
- `prefill_across_rows`, `slice_halos`, `last_filled_row`: the delta rule and the conv over a
  sequence split into rows, for context-parallel prefill (`context_parallel`).

`resolve_prefill` turns ``auto`` into a name per backend, gate and head width, from what
``python benchmarks/baselines.py --only kda`` and the harness measured:
- XLA:CPU: the chunked form for heads of 128 channels or more (K3's and Kimi Linear's):
  with the two cores close, 1.8-1.9x the per-token scan at batch 1 and 256 or 1,024 tokens,
  1.9-2.1x at 4,096 and 16,384, 3.2-3.4x at batch 8 and 4,096. The per-token scan for narrower
  heads (the shipped and test models'), whose small state update costs less than a chunk's
  C x C work;
- TPU: tokamax's kernel for a gate with a lower bound (K3). With unbounded decays (Kimi Linear)
  the kernel's in-chunk factors overflow: at -33 per token its outputs are NaN where the other
  forms stay exact (tests/test_kda_ops.py records this), so those gates take the chunked form;
- elsewhere the chunked form.
`resolve_decode`: tokamax's fused kernel on TPU (a per-token recurrence: any gate), else ``xla``.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from k3text import sharding
from k3text.ops.kda.activations import decay_gate, mix_qkv
from k3text.ops.kda.chunked import kda_chunked
from k3text.ops.kda.context_parallel import last_filled_row, prefill_across_rows, slice_halos
from k3text.ops.kda.conv import causal_conv1d, causal_conv1d_step
from k3text.ops.kda.reference import kda_recurrent, kda_step, l2_normalize

__all__ = [
    "DECODE_IMPLEMENTATIONS",
    "PREFILL_IMPLEMENTATIONS",
    "causal_conv1d",
    "causal_conv1d_step",
    "decay_gate",
    "decode_step",
    "l2_normalize",
    "last_filled_row",
    "mix_qkv",
    "prefill",
    "prefill_across_rows",
    "resolve_decode",
    "resolve_prefill",
    "slice_halos",
]

log = logging.getLogger(__name__)

PREFILL_IMPLEMENTATIONS = ("recurrent", "chunked", "tokamax_mosaic")
DECODE_IMPLEMENTATIONS = ("xla", "tokamax_mosaic")
# tokamax's kernels take whole 64-token chunks (or segment ids); shorter inputs are padded with
# no-op tokens, which leave the state exactly unchanged.
_TOKAMAX_CHUNK = 64

# On XLA:CPU the chunked form overtakes the per-token scan once the heads are this wide (the
# scan's state update is K x V per token, the chunked form's in-chunk work C x C per chunk).
CPU_CHUNKED_MIN_HEAD_DIM = 128

_reported: set[str] = set()


def resolve_prefill(implementation: str, backend: str | None = None,
                    gate_lower_bound: float | None = None, head_dim: int | None = None) -> str:
    """The prefill implementation ``auto`` stands for on ``backend`` (default: the platform being
    compiled for, `sharding.target_platform`) for a gate bounded below by ``gate_lower_bound``
    (None: unbounded) and heads of ``head_dim`` channels (None: unknown)."""
    if implementation != "auto":
        if implementation not in PREFILL_IMPLEMENTATIONS:
            raise ValueError(f"unknown KDA prefill implementation {implementation!r}; expected "
                             f"auto or one of {', '.join(PREFILL_IMPLEMENTATIONS)}")
        return implementation
    backend = backend or sharding.target_platform()
    if backend == "cpu":
        return "chunked" if head_dim is not None and head_dim >= CPU_CHUNKED_MIN_HEAD_DIM \
            else "recurrent"
    if backend == "tpu" and gate_lower_bound is not None:
        return "tokamax_mosaic"
    return "chunked"


def resolve_decode(implementation: str, backend: str | None = None) -> str:
    """The decode-step implementation ``auto`` stands for on ``backend`` (default: the platform
    being compiled for)."""
    if implementation != "auto":
        if implementation not in DECODE_IMPLEMENTATIONS:
            raise ValueError(f"unknown KDA decode implementation {implementation!r}; expected "
                             f"auto or one of {', '.join(DECODE_IMPLEMENTATIONS)}")
        return implementation
    return "tokamax_mosaic" if (backend or sharding.target_platform()) == "tpu" else "xla"


def _report(op: str, implementation: str, requested: str) -> None:
    line = f"kda {op}: {implementation}" + (" (auto)" if requested == "auto" else "")
    if line not in _reported:  # traced once per shape; one line per process is what helps
        _reported.add(line)
        log.info("%s", line)


def _tokamax_mosaic(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                    initial_state: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    from k3text.ops.kda.tokamax import tokamax_kda  # tokamax loads only when selected

    b, t, h, dk = q.shape
    pad = -t % _TOKAMAX_CHUNK
    if pad:
        q, k, v, g, beta = (jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
                            for a in (q, k, v, g, beta))
    state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32) if initial_state is None else \
        initial_state.astype(jnp.float32)

    def kernel(q, k, v, g, beta, state):
        return tokamax_kda(q, k, v, g, beta.astype(jnp.float32), implementation="mosaic",
                           initial_state=state)

    ctx = sharding.active()
    if ctx is not None:
        tokens = ctx.spec(("batch", None, "heads", None))
        state_spec = ctx.spec(("batch", "heads", None, None))
        kernel = jax.shard_map(kernel, mesh=ctx.shard_map_mesh(),
                               in_specs=(tokens,) * 4 + (ctx.spec(("batch", None, "heads")),
                                                         state_spec),
                               out_specs=(tokens, state_spec), check_vma=False)
    o, state = kernel(q, k, v, g, beta, state)
    return o[:, :t], state


def prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    implementation: str,
    initial_state: jax.Array | None = None,
    chunk_size: int = 32,
    gate_lower_bound: float | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> tuple[jax.Array, jax.Array]:
    """KDA over a sequence: ``q, k, g [B, T, H, K]`` (q, k normalised and scaled, ``g`` the
    log-space decay), ``v [B, T, H, V]``, ``beta [B, T, H]``, ``initial_state [B, H, K, V]`` or
    None -> ``(o [B, T, H, V], final_state [B, H, K, V])``, float32.

    ``implementation``: ``auto`` or one of `PREFILL_IMPLEMENTATIONS`. ``chunk_size`` and
    ``gate_lower_bound`` (every ``g >= gate_lower_bound``; None when unbounded) tune the chunked
    form; ``precision`` applies to the XLA forms' products.
    """
    chosen = resolve_prefill(implementation, gate_lower_bound=gate_lower_bound,
                             head_dim=q.shape[-1])
    _report("prefill", chosen, implementation)
    if chosen == "recurrent":
        return kda_recurrent(q, k, v, g, beta, initial_state, precision=precision)
    if chosen == "chunked":
        return kda_chunked(q, k, v, g, beta, initial_state, chunk_size=chunk_size,
                           gate_lower_bound=gate_lower_bound, precision=precision)
    return _tokamax_mosaic(q, k, v, g, beta, initial_state)


def _fused_decode_tokamax(qkv: jax.Array, conv_weight: jax.Array, conv_state: jax.Array,
                          f: jax.Array, a_log: jax.Array, dt_bias: jax.Array,
                          beta_logits: jax.Array, state: jax.Array,
                          gate_lower_bound: float | None,
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    # tokamax 0.0.17's public CausalConv1dGatedDeltaRule op does not pass the KDA mode (the
    # per-channel gate) on to its kernel, so the kernel's own entry point is called.
    from tokamax._src.ops.causal_conv1d_gated_delta_rule import config as kernel_config
    from tokamax._src.ops.causal_conv1d_gated_delta_rule import wrapper

    def kernel(qkv, conv_weight, conv_state, f, a_log, dt_bias, beta_logits, state):
        # Local shapes: [B, 3, H*K] flattens to the kernel's [q | k | v] channels per shard.
        b, heads, dk, dv = state.shape
        width = conv_weight.shape[0]
        dtype = qkv.dtype
        (new_conv, new_state), o = wrapper.fused_conv1d_gdn(
            qkv.reshape(b, -1), beta_logits.astype(dtype), f.reshape(b, -1).astype(dtype),
            conv_state.reshape(b, width - 1, -1), state,
            conv_weight.reshape(width, -1).T[:, None, :], None, a_log,
            dt_bias.reshape(heads, dk),
            query_start_loc=jnp.arange(b + 1, dtype=jnp.int32),
            # Every row is a slot of the pool, and every slot continues its own state (a new
            # request's slot was zero-filled by insert): no padding rows, so no null slot.
            state_indices=jnp.arange(b, dtype=jnp.int32),
            distribution=jnp.full((3,), b, jnp.int32),
            seq_lens=jnp.full((b,), 2, jnp.int32),
            n_kq=heads, n_v=heads, d_k=dk, d_v=dv, kernel_size=width,
            attention_mode=kernel_config.AttentionMode.KDA, gate_lower_bound=gate_lower_bound,
            # Decode only: the kernel's prefill path never runs, and its default token tile
            # needs head dims in whole 128-lane multiples; a tile of one takes any head dim.
            mixed_tile_size=1)
        return (o.reshape(b, heads, dv).astype(jnp.float32),
                new_conv.reshape(conv_state.shape), new_state)

    ctx = sharding.active()
    if ctx is not None:
        per_head = ctx.spec(("batch", "heads", None))
        state_spec = ctx.spec(("batch", "heads", None, None))
        conv_state_spec = ctx.spec(("batch", None, None, "heads"))
        kernel = jax.shard_map(
            kernel, mesh=ctx.shard_map_mesh(),
            in_specs=(ctx.spec(("batch", None, "heads")), ctx.spec((None, None, "heads")),
                      conv_state_spec, ctx.spec(("batch", "heads", None)), ctx.spec(("heads",)),
                      ctx.spec(("heads",)), ctx.spec(("batch", "heads")), state_spec),
            out_specs=(per_head, conv_state_spec, state_spec), check_vma=False)
    return kernel(qkv, conv_weight, conv_state, f, a_log, dt_bias, beta_logits, state)


def decode_step(
    qkv: jax.Array,
    conv_weight: jax.Array,
    conv_state: jax.Array,
    f: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    beta_logits: jax.Array,
    state: jax.Array,
    *,
    implementation: str,
    gate_lower_bound: float | None = None,
    precision: jax.lax.PrecisionLike = None,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One KDA token per slot from the layer's raw projections; slots where `valid` [B] is
    false keep their states exactly (their outputs are garbage).

    Args:
      qkv: ``[B, 3, H*K]`` q, k, v projections before the conv (``V = K``).
      conv_weight: ``[W, 3, H*K]``; conv_state: ``[B, W - 1, 3, H*K]``, oldest first.
      f: ``[B, H, K]`` decay projection; a_log ``[H]``, dt_bias ``[H*K]`` (see `decay_gate`).
      beta_logits: ``[B, H]``, before the sigmoid.
      state: ``[B, H, K, V]`` float32.
      implementation: ``auto`` or one of `DECODE_IMPLEMENTATIONS`.

    Returns:
      ``(o [B, H, V] float32, new_conv_state, new_state)``.
    """
    chosen = resolve_decode(implementation)
    _report("decode step", chosen, implementation)
    def kept(new: jax.Array, old: jax.Array) -> jax.Array:
        return new if valid is None else jnp.where(
            valid.reshape(-1, *[1] * (new.ndim - 1)), new, old)

    if chosen == "tokamax_mosaic":
        o, new_conv, new_state = _fused_decode_tokamax(qkv, conv_weight, conv_state, f, a_log,
                                                       dt_bias, beta_logits, state,
                                                       gate_lower_bound)
        return o, kept(new_conv, conv_state), kept(new_state, state)
    y, new_conv = causal_conv1d_step(qkv, conv_weight, conv_state)
    q, k, v = mix_qkv(y, state.shape[1])
    g = decay_gate(f, a_log, dt_bias, gate_lower_bound)
    beta = jax.nn.sigmoid(beta_logits.astype(jnp.float32))
    if valid is not None:  # no decay and no write: the delta rule leaves the state exactly
        g = jnp.where(valid[:, None, None], g, 0.0)
        beta = jnp.where(valid[:, None], beta, 0.0)
    o, state = kda_step(q, k, v, g, beta, state, precision=precision)
    return o, kept(new_conv, conv_state), state
