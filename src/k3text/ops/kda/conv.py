"""The short causal depthwise convolution KDA applies to q, k and v before the delta rule:
a whole sequence (`causal_conv1d`) and one decode token (`causal_conv1d_step`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["causal_conv1d", "causal_conv1d_step"]

_f32 = jnp.float32

def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    conv_state: jax.Array | None = None,
    lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv over time, no activation.

    ``y[t] = sum_{j<W} weight[j] * x[t - (W - 1) + j]``, where inputs before the start of ``x`` come
    from ``conv_state`` (zeros if ``None``). Products and sums are float32; ``y`` has ``x.dtype``.

    Args:
      x: ``[B, T, *C]`` (``C`` any channel shape, e.g. ``(3, H*K)`` for fused q, k, v).
      weight: ``[W, *C]``; ``weight[W - 1]`` multiplies the current token.
      conv_state: ``[B, W - 1, *C]``, the ``W - 1`` inputs preceding ``x``, oldest first.
      lengths: optional ``[B]`` int, the number of valid tokens per row of a right-padded ``x``.
        The new state is then taken from the valid inputs only, so padding never reaches it.
        Outputs at padded positions are meaningless.

    Returns:
      ``(y, new_conv_state)``: ``y: [B, T, *C]`` and ``new_conv_state: [B, W - 1, *C]`` holding
      the last ``W - 1`` (valid) inputs of ``concat(conv_state, x)``, in ``x.dtype``.
    """
    b, t = x.shape[:2]
    width = weight.shape[0]
    if conv_state is None:
        conv_state = jnp.zeros((b, width - 1, *x.shape[2:]), x.dtype)
    padded = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)

    padded32, weight32 = padded.astype(_f32), weight.astype(_f32)
    y = sum(weight32[j] * padded32[:, j : j + t] for j in range(width))

    if lengths is None:
        new_state = padded[:, t:]
    else:
        # The last W - 1 valid inputs start at `length` in the state-prefixed sequence.
        new_state = jax.vmap(
            lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, width - 1, axis=0)
        )(padded, jnp.asarray(lengths))
    return y.astype(x.dtype), new_state


def causal_conv1d_step(
    x_t: jax.Array, weight: jax.Array, conv_state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One decode token of :func:`causal_conv1d`.

    Args:
      x_t: ``[B, *C]``.
      weight: ``[W, *C]``.
      conv_state: ``[B, W - 1, *C]``, the previous ``W - 1`` inputs, oldest first.

    Returns:
      ``(y_t, new_conv_state)``: ``y_t: [B, *C]`` in ``x_t.dtype`` and the state shifted left by
      one with ``x_t`` appended.
    """
    window = jnp.concatenate([conv_state.astype(x_t.dtype), x_t[:, None]], axis=1)
    weight32, window32 = weight.astype(_f32), window.astype(_f32)
    # W explicit terms rather than a reduction over the window axis: XLA:CPU hands that
    # reduction to a library kernel ~10x slower than this elementwise sum at decode sizes.
    y = sum(weight32[j] * window32[:, j] for j in range(weight.shape[0]))
    return y.astype(x_t.dtype), window[:, 1:]
