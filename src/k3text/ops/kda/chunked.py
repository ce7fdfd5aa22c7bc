"""Chunked KDA in matmul form, for prefill and training; equal to `reference.kda_recurrent` up to
float32 rounding, and differentiable.

The sequence is cut into chunks of ``C`` tokens and each chunk into ``M`` sub-chunks of ``S``.
Within a chunk let ``G_t`` be the inclusive cumulative sum of ``g`` and ``S0`` the state entering
it. Unrolling the recurrence (the WY/UT form) gives

    U = (I + diag(beta) tril(A_kk, -1))^-1 diag(beta) (V - (K * Gamma) S0)      Gamma_t = exp(G_t)
    o_t = (q_t * Gamma_t)^T S0 + sum_{i<=t} A_qk[t, i] u_i
    S_end = diag(Gamma_C) S0 + sum_i diag(exp(G_C - G_i)) k_i u_i^T

with ``A_xk[i, j] = sum_d x_i[d] k_j[d] exp(G_i[d] - G_j[d])`` for ``j <= i``.

Everything that does not depend on ``S0`` is computed for all chunks at once, as matmuls:

- ``A`` below the diagonal sub-chunks: for a query in sub-chunk ``r`` and a key before it, the
  decay factors at the start ``R_r`` of sub-chunk ``r``:
  ``exp(G_i - G_j) = exp(G_i - R_r) * exp(R_r - G_j)``, both exponents ``<= 0`` (no overflow,
  whatever the gate), so each query sub-chunk is one product ``[2S, K] @ [K, r S]`` (q and k rows
  together).
- ``A`` on the diagonal sub-chunks: with a gate bounded below by ``lb`` (K3), the same
  factorisation about the sub-chunk's middle keeps both exponents within ``S |lb| / 2`` (40 at
  ``S = 16``, ``lb = -5``), far from float32's overflow at 88, so these blocks are products too.
  An unbounded gate (Kimi Linear) keeps the pairwise ``[S, S, K]`` decays there, masked before
  the exponential.
- ``(I + L)^-1`` by blocks: forward substitution inside the ``S x S`` diagonal blocks (all of
  them at once), block forward substitution (matmuls) across them.
- ``U`` and the state weights ``W = T (K * Gamma)`` in one product with the inverse.

Only the hand-off of the state from chunk to chunk is sequential (a ``lax.scan``): per chunk one
product ``[W; q * Gamma] @ S0`` and one ``k^T u`` update.

Cumulative decays are formed per sub-chunk (``S`` tokens, not ``C``), so the differences that
become exponents are differences of small numbers, which keeps their rounding error small.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["BOUNDED_DIAGONAL_MAX_EXPONENT", "kda_chunked"]

_f32 = jnp.float32

# Diagonal sub-chunks use the factorised (matmul) form when the gate bound guarantees that no
# factor exceeds exp(this); float32 overflows past exp(88).
BOUNDED_DIAGONAL_MAX_EXPONENT = 60.0


def _unit_lower_inverse(lower: jax.Array, precision: jax.lax.PrecisionLike) -> jax.Array:
    """``(I + lower)^-1`` for strictly-lower ``lower [..., S, S]``, row by row (unrolled
    forward substitution: row ``i`` of the inverse is ``e_i - lower[i, :i] @ rows[:i]``)."""
    s = lower.shape[-1]
    eye = jnp.eye(s, dtype=lower.dtype)
    rows = [jnp.broadcast_to(eye[0], lower.shape[:-1])]
    for i in range(1, s):
        solved = jnp.stack(rows, axis=-2)
        rows.append(eye[i] - jnp.einsum("...j,...js->...s", lower[..., i, :i], solved,
                                        precision=precision))
    return jnp.stack(rows, axis=-2)


def _block_unit_lower_inverse(lower: jax.Array, s: int,
                              precision: jax.lax.PrecisionLike) -> jax.Array:
    """``(I + lower)^-1`` for strictly-lower ``lower [..., C, C]`` with ``C = M S``: diagonal
    blocks by forward substitution, then block row ``r`` of the inverse is
    ``-D_r^-1 (L[r, :r] @ X[:r, :r])`` beside ``D_r^-1``."""
    c = lower.shape[-1]
    m = c // s
    blocks = lower.reshape(*lower.shape[:-2], m, s, m, s)
    diag_inv = _unit_lower_inverse(
        jnp.stack([blocks[..., r, :, r, :] for r in range(m)], axis=-3), precision)
    batch = lower.shape[:-2]
    rows: list[jax.Array] = []
    for r in range(m):
        d_inv = diag_inv[..., r, :, :]
        parts = [d_inv]
        if r:
            solved = jnp.concatenate(rows, axis=-2)[..., : r * s]  # X[:r, :r]
            row = blocks[..., r, :, :r, :].reshape(*batch, s, r * s)  # L[r, :r]
            left = jnp.einsum("...ij,...jk->...ik", row, solved, precision=precision)
            parts.insert(0, -jnp.einsum("...ij,...jk->...ik", d_inv, left, precision=precision))
        if r < m - 1:
            parts.append(jnp.zeros((*batch, s, c - (r + 1) * s), _f32))
        rows.append(jnp.concatenate(parts, axis=-1))
    return jnp.concatenate(rows, axis=-2)


def _interactions(q: jax.Array, k: jax.Array, local: jax.Array, total: jax.Array,
                  before: jax.Array, gate_lower_bound: float | None,
                  precision: jax.lax.PrecisionLike) -> jax.Array:
    """``[A_qk; A_kk]`` as ``[..., 2, C, C]`` (zero above the diagonal) from sub-chunked
    ``q, k, local [..., M, S, K]`` (``local``: in-sub-chunk inclusive cumulative decay),
    ``total`` (each sub-chunk's decay) and ``before`` (the decay of the sub-chunks before it),
    both ``[..., M, K]``."""
    m, s, dk = q.shape[-3:]
    c = m * s
    batch = q.shape[:-3]
    rows = jnp.concatenate([q, k], axis=-2)  # [..., M, 2S, K]: q rows, then k rows
    local2 = jnp.concatenate([local, local], axis=-2)

    # Diagonal sub-chunks [..., M, 2S, S].
    causal = jnp.tril(jnp.ones((s, s), bool))
    if gate_lower_bound is not None and s * -gate_lower_bound / 2 <= \
            BOUNDED_DIAGONAL_MAX_EXPONENT:
        mid = local[..., s // 2 - 1 : s // 2, :]
        diag = jnp.einsum("...mid,...mjd->...mij", rows * jnp.exp(local2 - mid),
                          k * jnp.exp(mid - local), precision=precision)
        diag = jnp.where(jnp.concatenate([causal, causal]), diag, 0.0)
    else:
        pairwise = jnp.exp(jnp.where(causal[..., None], local[..., :, None, :]
                                     - local[..., None, :, :], -jnp.inf))  # [..., M, S, S, K]
        keys = k[..., None, :, :] * pairwise
        diag = jnp.einsum("...mxid,...mijd->...mxij",
                          jnp.stack([q, k], axis=-3), keys, precision=precision)
        diag = diag.reshape(*batch, m, 2 * s, s)
    if m == 1:
        return diag.reshape(*batch, 2, s, s)

    # Below the diagonal: query sub-chunk r (1..M-1) against key sub-chunks c < r, factorised at
    # R_r. exp(R_r - G_j) = exp(R_r - R_{c+1}) exp(R_{c+1} - G_j): a per-(r, c) channel factor
    # times a per-key one, so no exponential is taken per pair.
    key_to_end = k * jnp.exp(total[..., :, None, :] - local)  # exp(R_{c+1} - G_j) <= 1
    after = before + total  # R_{c+1}
    between = before[..., 1:, None, :] - after[..., None, :-1, :]  # [..., r, c, K]
    lower_blocks = jnp.tril(jnp.ones((m - 1, m - 1), bool))[..., None]
    between = jnp.exp(jnp.where(lower_blocks, between, -jnp.inf))  # 0 where c >= r
    keys = between[..., :, :, None, :] * key_to_end[..., None, :-1, :, :]
    keys = keys.reshape(*batch, m - 1, (m - 1) * s, dk)
    below = jnp.einsum("...rid,...rjd->...rij", (rows * jnp.exp(local2))[..., 1:, :, :], keys,
                       precision=precision)  # [..., M-1, 2S, (M-1)S]

    block_rows = []
    for r in range(m):
        parts = [below[..., r - 1, :, : r * s]] if r else []
        parts.append(diag[..., r, :, :])
        if r < m - 1:
            parts.append(jnp.zeros((*batch, 2 * s, (m - 1 - r) * s), _f32))
        block_rows.append(jnp.concatenate(parts, axis=-1).reshape(*batch, 2, s, c))
    return jnp.concatenate(block_rows, axis=-2)


def kda_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                initial_state: jax.Array | None = None, chunk_size: int = 64,
                sub_chunk_size: int = 16, gate_lower_bound: float | None = None,
                precision: jax.lax.PrecisionLike = None) -> tuple[jax.Array, jax.Array]:
    """Chunk-parallel KDA (see the module docstring); arguments and results as
    `reference.kda_recurrent`.

    Any ``T`` is accepted: it is right-padded to whole chunks with no-op tokens
    (``k = v = beta = g = 0``) and the output sliced back. ``gate_lower_bound``: a bound every
    ``g`` is known to respect (K3's ``gate_lower_bound``), which lets the diagonal sub-chunks run
    as products; ``None`` for unbounded gates. ``chunk_size`` must be a multiple of
    ``sub_chunk_size`` (or smaller, then one sub-chunk per chunk).
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    s = min(sub_chunk_size, chunk_size)
    if chunk_size % s:
        raise ValueError(f"chunk_size {chunk_size} is not a multiple of sub_chunk_size {s}")
    c, m = chunk_size, chunk_size // s
    n = -(-t // c)
    pad = n * c - t

    def sub_chunks(a: jax.Array) -> jax.Array:  # [B, T, H, ...] -> [B, H, N, M, S, ...]
        a = jnp.pad(a.astype(_f32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(b, n, m, s, *a.shape[2:]), 4, 1)

    q, k, v, g, beta = (sub_chunks(a) for a in (q, k, v, g, beta))
    local = jnp.cumsum(g, axis=-2)  # [B, H, N, M, S, K]
    total = local[..., -1, :]  # each sub-chunk's decay
    before = jnp.cumsum(total, axis=-2) - total  # decay of the earlier sub-chunks of the chunk
    chunk_total = jnp.sum(total, axis=-2)  # [B, H, N, K]

    a = _interactions(q, k, local, total, before, gate_lower_bound, precision)
    a_qk, a_kk = a[..., 0, :, :], a[..., 1, :, :]

    def whole(x: jax.Array) -> jax.Array:  # [..., M, S, D] -> [..., C, D]
        return x.reshape(*x.shape[:-3], c, x.shape[-1])

    beta = beta.reshape(*beta.shape[:-2], c)
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    inverse = _block_unit_lower_inverse(jnp.where(strict, beta[..., :, None] * a_kk, 0.0), s,
                                        precision)
    gamma = whole(jnp.exp(before[..., None, :] + local))  # from the chunk start, <= 1
    to_end = whole(jnp.exp(chunk_total[..., None, None, :] - before[..., None, :] - local))
    q, k, v = whole(q), whole(k), whole(v)
    solved = jnp.einsum("...ij,...jd->...id", inverse,
                        beta[..., None] * jnp.concatenate([v, k * gamma], axis=-1),
                        precision=precision)
    u_local, w = solved[..., :dv], solved[..., dv:]
    reads = jnp.concatenate([w, q * gamma], axis=-2)  # [..., 2C, K]: both read the entering state
    keys_to_end = k * to_end

    def hand_off(state, xs):
        reads, u_local, keys_to_end, decay = xs
        read = jnp.einsum("...ck,...kv->...cv", reads, state, precision=precision)
        u = u_local - read[..., :c, :]
        state = jnp.exp(decay)[..., None] * state + jnp.einsum(
            "...ck,...cv->...kv", keys_to_end, u, precision=precision)
        return state, (u, read[..., c:, :])

    state = jnp.zeros((b, h, dk, dv), _f32) if initial_state is None else \
        initial_state.astype(_f32)
    chunk_major = tuple(jnp.moveaxis(x, 2, 0) for x in (reads, u_local, keys_to_end, chunk_total))
    state, (u, o_state) = jax.lax.scan(hand_off, state, chunk_major)
    o = jnp.moveaxis(o_state, 0, 2) + jnp.einsum("...ij,...jv->...iv", a_qk,
                                                 jnp.moveaxis(u, 0, 2), precision=precision)
    o = jnp.moveaxis(o, 1, 3).reshape(b, n * c, h, dv)  # [B, H, N, C, V] -> [B, T, H, V]
    return o[:, :t], state
