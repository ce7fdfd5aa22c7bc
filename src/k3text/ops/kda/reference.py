"""Kimi Delta Attention (KDA): a delta rule with a per-channel (diagonal) decay gate.

For every batch row and head the state ``S`` is a ``[K, V]`` float32 matrix and each token does

    S <- diag(exp(g_t)) S                      # per-key-channel decay, g_t <= 0
    S <- S + beta_t k_t (v_t - S^T k_t)^T      # delta-rule write
    o_t = S^T q_t

Layouts follow the model: ``q, k, g: [B, T, H, K]``, ``v: [B, T, H, V]``, ``beta: [B, T, H]`` and
states ``[B, H, K, V]``. The ops neither L2-normalise nor scale ``q``/``k``; the calling layer
does (see :func:`l2_normalize`). All arithmetic is float32 whatever the input dtype, and outputs
are float32.

A token with ``beta = 0`` and ``g = 0`` leaves the state exactly unchanged. Callers rely on this to
turn padding tokens into no-ops, and the chunked forms use it to pad ``T`` to whole chunks.

This module is the reference every other KDA implementation is tested against: the token update
exactly as stated above (`kda_recurrent`), and the decode step's fast form (`kda_step`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["kda_recurrent", "kda_step", "l2_normalize"]

_f32 = jnp.float32


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x**2, -1) + eps)`` over the last axis, in float32, cast back to ``x.dtype``.

    This is the FLA convention (``eps`` inside the square root), not ``x / max(|x|, eps)``.
    """
    x32 = x.astype(_f32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


# --------------------------------------------------------------------------------------------
# Recurrent form: decode step and the reference scan.
# --------------------------------------------------------------------------------------------


def kda_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    precision: jax.lax.PrecisionLike = None,
) -> tuple[jax.Array, jax.Array]:
    """One KDA token for decode: the fast form of `_delta_rule_token`, which it is tested against.

    Args:
      q, k, g: ``[B, H, K]``; ``g`` is the log-space decay (``<= 0``).
      v: ``[B, H, V]``.
      beta: ``[B, H]``.
      state: ``[B, H, K, V]`` float32.

    Returns:
      ``(o, new_state)`` with ``o: [B, H, V]`` and ``new_state: [B, H, K, V]``, both float32.
    """
    q, k, v, g, beta, state = (a.astype(_f32) for a in (q, k, v, g, beta, state))
    state = state * jnp.exp(g)[..., None]
    # k and q read the decayed state in one matmul: since the update adds k (x) delta,
    # q S_new = q S + (q . k) delta, so the output needs no second pass over the new state.
    kq_state = jnp.einsum("bhik,bhkv->bhiv", jnp.stack([k, q], axis=2), state,
                          precision=precision)
    delta = beta[..., None] * (v - kq_state[:, :, 0])
    state = state + k[..., :, None] * delta[..., None, :]
    o = kq_state[:, :, 1] + jnp.sum(q * k, axis=-1, keepdims=True) * delta
    return o, state


def _delta_rule_token(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                      state: jax.Array, precision: jax.lax.PrecisionLike = None,
                      ) -> tuple[jax.Array, jax.Array]:
    """One token of the delta rule written as the module docstring states it (shapes as
    `kda_step`): decay, predict, correct, read out the new state."""
    q, k, v, g, beta, state = (a.astype(_f32) for a in (q, k, v, g, beta, state))
    state = state * jnp.exp(g)[..., None]
    predicted = jnp.einsum("bhk,bhkv->bhv", k, state, precision=precision)
    delta = beta[..., None] * (v - predicted)
    state = state + jnp.einsum("bhk,bhv->bhkv", k, delta, precision=precision)
    return jnp.einsum("bhk,bhkv->bhv", q, state, precision=precision), state


def _zero_state(k: jax.Array, v: jax.Array) -> jax.Array:
    (b, _, h, dk), dv = k.shape, v.shape[-1]
    return jnp.zeros((b, h, dk, dv), _f32)


def kda_recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token KDA (a ``lax.scan`` of the plain delta-rule token update over time); the
    reference form the decode step and the chunked form are tested against.

    Args:
      q, k, g: ``[B, T, H, K]``.
      v: ``[B, T, H, V]``.
      beta: ``[B, T, H]``.
      initial_state: ``[B, H, K, V]``, or ``None`` for zeros.

    Returns:
      ``(o, final_state)``: ``o: [B, T, H, V]`` and ``final_state: [B, H, K, V]``, float32.
    """
    state = _zero_state(k, v) if initial_state is None else initial_state.astype(_f32)

    def step(state, xs):
        o, state = _delta_rule_token(*xs, state, precision=precision)
        return state, o

    time_major = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    state, o = jax.lax.scan(step, state, time_major)
    return jnp.moveaxis(o, 0, 1), state
