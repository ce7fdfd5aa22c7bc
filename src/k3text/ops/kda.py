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
turn padding tokens into no-ops, and :func:`kda_chunked` uses it to pad ``T`` to whole chunks.

The module also holds the short causal depthwise convolution that KDA applies to q, k and v
before the recurrence (:func:`causal_conv1d`, :func:`causal_conv1d_step`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "causal_conv1d",
    "causal_conv1d_step",
    "kda_chunked",
    "kda_recurrent",
    "kda_step",
    "l2_normalize",
]

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


# --------------------------------------------------------------------------------------------
# Chunked form for prefill.
#
# Within a chunk let G_t be the inclusive cumulative sum of g (so Gamma_t = exp(G_t) is the decay
# from the chunk start through token t) and S0 the state entering the chunk. Unrolling the
# recurrence writes every in-chunk state as
#
#     S_t = diag(Gamma_t) S0 + sum_{i<=t} diag(exp(G_t - G_i)) k_i u_i^T,
#
# where the "pseudo-values" u solve the unit-lower-triangular system (the WY/UT transform)
#
#     (I + diag(beta) tril(A_kk, -1)) U = diag(beta) (V - (K * Gamma) S0),
#     A_kk[i, j] = sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d]).
#
# Writing T for the inverse applied to diag(beta), U = T V - T (K * Gamma) S0: the first term and
# W = T (K * Gamma) do not depend on S0. Outputs and the outgoing state are then
#
#     o_t   = (q_t * Gamma_t)^T S0 + sum_{i<=t} A_qk[t, i] u_i,
#     A_qk[t, i] = sum_d q_t[d] k_i[d] exp(G_t[d] - G_i[d]),
#     S_end = diag(Gamma_C) S0 + sum_i diag(exp(G_C - G_i)) k_i u_i^T.
# --------------------------------------------------------------------------------------------


def _causal_pairwise_decay(G: jax.Array) -> jax.Array:
    """``exp(G_i - G_j)`` for ``j <= i`` and exactly 0 above the diagonal: ``[..., C, C, K]``.

    The mask must act before the exponential. Above the diagonal ``G_i - G_j`` is positive and, with
    strong decays, large (64 tokens at ``g = -5`` give 320), so ``exp`` overflows float32 and a
    later multiply-by-zero mask would produce ``inf * 0 = nan``. The factorised form
    ``exp(G_i) * exp(-G_j)`` overflows in the same way, which is why the differences are formed
    per pair.
    """
    c = G.shape[-2]
    causal = jnp.tril(jnp.ones((c, c), dtype=bool))[..., None]
    diff = G[..., :, None, :] - G[..., None, :, :]
    return jnp.exp(jnp.where(causal, diff, -jnp.inf))


def _unit_lower_solve(lower: jax.Array, rhs: jax.Array,
                      precision: jax.lax.PrecisionLike) -> jax.Array:
    """Solve ``(I + lower) x = rhs`` for strictly-lower ``lower [..., C, C]`` by forward
    substitution, one row per step of a ``lax.scan``.

    Plain JAX on purpose: it partitions and lowers the same on every backend, where a LAPACK
    custom call (``jax.scipy.linalg.solve_triangular`` on CPU) inside a multi-device program
    stalled the collectives around it. Rows not yet solved are zero, so each step's matvec only
    sees the solved ones; the cost equals a triangular solve's, ``O(C^2 D)``.
    """

    def solve_row(x, i):
        row = rhs[..., i, :] - jnp.einsum("...j,...jd->...d", lower[..., i, :], x,
                                          precision=precision)
        return x.at[..., i, :].set(row), None

    x, _ = jax.lax.scan(solve_row, jnp.zeros_like(rhs), jnp.arange(lower.shape[-1]))
    return x


def _kda_chunk(
    state: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    precision: jax.lax.PrecisionLike,
) -> tuple[jax.Array, jax.Array]:
    """One chunk: ``q, k, g: [B, H, C, K]``, ``v: [B, H, C, V]``, ``beta: [B, H, C]``."""
    c = q.shape[-2]
    G = jnp.cumsum(g, axis=-2)
    gamma = jnp.exp(G)  # decay from the chunk start, <= 1
    gamma_end = gamma[..., -1, :]
    to_end = jnp.exp(G[..., -1:, :] - G)  # decay from each token to the chunk end, <= 1

    decay = _causal_pairwise_decay(G)
    a_kk = jnp.einsum("...id,...jd,...ijd->...ij", k, k, decay, precision=precision)
    a_qk = jnp.einsum("...id,...jd,...ijd->...ij", q, k, decay, precision=precision)

    # Solve once for both the state-independent values (T V) and the state weights W.
    strict = jnp.tril(jnp.ones((c, c), dtype=bool), k=-1)
    lower = jnp.where(strict, beta[..., :, None] * a_kk, 0.0)
    rhs = beta[..., None] * jnp.concatenate([v, k * gamma], axis=-1)
    solved = _unit_lower_solve(lower, rhs, precision)
    u_local, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]

    u = u_local - jnp.einsum("...ck,...kv->...cv", w, state, precision=precision)
    o = jnp.einsum("...ck,...kv->...cv", q * gamma, state, precision=precision)
    o = o + jnp.einsum("...ij,...jv->...iv", a_qk, u, precision=precision)
    state = gamma_end[..., None] * state
    state = state + jnp.einsum("...ck,...cv->...kv", k * to_end, u, precision=precision)
    return o, state


def kda_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    chunk_size: int = 64,
    precision: jax.lax.PrecisionLike = None,
) -> tuple[jax.Array, jax.Array]:
    """Chunk-parallel KDA for prefill; equal to :func:`kda_recurrent` up to float32 rounding.

    Any ``T`` is accepted: the sequence is right-padded to a multiple of ``chunk_size`` with no-op
    tokens (``k = v = beta = g = 0``) and the output sliced back, so the final state is that after
    the last real token. Work inside a chunk is parallel; a ``lax.scan`` carries the state across
    chunks. Peak intermediate size is ``[B, H, C, C, K]`` per chunk.

    Pairwise decays are differences of float32 cumulative sums, so their rounding error grows with
    the total decay over a chunk: at ``g = -5`` per channel and ``C = 64`` outputs differ from
    the recurrence by a few 1e-6 (about 1e-7 with mild decays). Smaller chunks tighten this.
    ``precision`` applies to every einsum, the triangular solve included.

    Args:
      q, k, g: ``[B, T, H, K]``.
      v: ``[B, T, H, V]``.
      beta: ``[B, T, H]``.
      initial_state: ``[B, H, K, V]``, or ``None`` for zeros.
      chunk_size: tokens per chunk (static).

    Returns:
      ``(o, final_state)``: ``o: [B, T, H, V]`` and ``final_state: [B, H, K, V]``, float32.
    """
    b, t, h, _ = q.shape
    state = _zero_state(k, v) if initial_state is None else initial_state.astype(_f32)
    n_chunks = -(-t // chunk_size)
    pad = n_chunks * chunk_size - t

    def to_chunks(a: jax.Array) -> jax.Array:
        # [B, T, H, ...] -> [N, B, H, C, ...]: chunks lead so that scan iterates over them.
        a = a.astype(_f32)
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(b, n_chunks, chunk_size, *a.shape[2:])
        return jnp.moveaxis(a, (1, 2), (0, 3))

    def step(state, xs):
        o, state = _kda_chunk(state, *xs, precision=precision)
        return state, o

    state, o = jax.lax.scan(step, state, tuple(to_chunks(a) for a in (q, k, v, g, beta)))
    o = jnp.moveaxis(o, (0, 3), (1, 2)).reshape(b, n_chunks * chunk_size, h, -1)
    return o[:, :t], state


# --------------------------------------------------------------------------------------------
# Short causal depthwise convolution.
# --------------------------------------------------------------------------------------------


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
