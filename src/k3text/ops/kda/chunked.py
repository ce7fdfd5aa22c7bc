"""Chunked KDA in matmul form, for prefill and training; equal to `reference.kda_recurrent` up to
float32 rounding, and differentiable.

The sequence is cut into chunks of ``C`` tokens. Within a chunk let ``G_t`` be the inclusive
cumulative sum of ``g`` from the chunk start and ``S0`` the state entering it. Unrolling the
recurrence (the WY/UT form) gives

    U = (I + diag(beta) tril(A_kk, -1))^-1 diag(beta) (V - (K * Gamma) S0)      Gamma_t = exp(G_t)
    o_t = (q_t * Gamma_t)^T S0 + sum_{i<=t} A_qk[t, i] u_i
    S_end = diag(Gamma_C) S0 + sum_i diag(exp(G_C - G_i)) k_i u_i^T

with ``A_xk[i, j] = sum_d x_i[d] k_j[d] exp(G_i[d] - G_j[d])`` for ``j <= i``. Everything but the
``S0`` terms is the chunk's own work, done as matmuls without an exponential per pair:

- **Below the diagonal, by halving.** The chunk's ``M`` leaves (runs of ``S`` tokens, ``M`` a
  power of two) are halved recursively. At each split, the queries after the split point ``R``
  against the keys before it factor there: ``exp(G_i - G_j) = exp(G_i - R) exp(R - G_j)``, both
  exponents ``<= 0`` whatever the gate, so a split is one product ``[h, K] @ [K, h]`` (the splits
  of one level batched). Every pair in different leaves meets at exactly one split. A factor that
  underflows to 0 only ever stands for a pair whose true decay is smaller still.
- **The diagonal leaves.** With a gate bounded below by ``lb`` (K3), the same factorisation
  about the leaf's middle keeps every factor within ``exp(+-S |lb| / 2)`` (``exp(40)`` at
  ``S = 16``, ``lb = -5``), so these blocks are products too. An unbounded gate (Kimi Linear)
  keeps the pairwise ``[S, S, K]`` decays inside its (smaller) leaves, masked before the
  exponential.
- **The inverse by the same halving:** ``(I + N)^-1 = (I - N)(I + N^2)(I + N^4)...`` on the
  leaves (``N`` is nilpotent), then ``[[T1, 0], [-T2 L21 T1, T2]]`` at each split.
- ``U`` and the state weights ``W = T diag(beta) (K * Gamma)`` by one product each with ``T``.

The chunks are walked ``chunks_per_step`` at a time (a ``lax.scan``): each step computes those
chunks' own work together, then hands the state from chunk to chunk (``u = U - W S0``,
``o = (q * Gamma) S0 + A_qk u``, ``S = diag(Gamma_C) S0 + (K * exp(G_C - G))^T u``). Doing the
chunk work inside the loop keeps a few chunks' intermediates in cache; computed for the whole
sequence up front, every elementwise step of it is a pass through memory, and those passes
cost more than the products.

Cumulative decays are formed per leaf and offset per leaf, so the differences that become
exponents are differences of small numbers, which keeps their rounding error small.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["PRODUCT_LEAF_MAX_EXPONENT", "kda_chunked"]

_f32 = jnp.float32

# Leaves use the factorised (matmul) form when the gate bound keeps the leaf's decay within
# exp(-this): the factors about its middle stay within exp(+-this / 2), and even the masked-out
# products above the diagonal stay finite (float32 overflows past exp(88.7)).
PRODUCT_LEAF_MAX_EXPONENT = 80.0
PRODUCT_LEAF = 16  # leaf length with a bounded gate (16 x 5 = 80 for K3)
PAIRWISE_LEAF = 8  # leaf length with an unbounded gate: [8, 8, K] pairwise decays per leaf


class _ChunkTerms(NamedTuple):
    """A chunk's own work, leading dims ``[..., B, H]``."""
    a_qk: jax.Array  # [..., C, C] lower triangular (diagonal included)
    u_local: jax.Array  # [..., C, V]: T diag(beta) V
    w: jax.Array  # [..., C, K]: T diag(beta) (K * Gamma)
    q_decayed: jax.Array  # [..., C, K]: q * Gamma
    k_to_end: jax.Array  # [..., C, K]: k * exp(G_C - G)
    decay: jax.Array  # [..., K]: Gamma_C


def _cross(x: jax.Array, y: jax.Array, precision: jax.lax.PrecisionLike) -> jax.Array:
    return jnp.einsum("...id,...jd->...ij", x, y, precision=precision)


def _unit_lower_inverse(lower: jax.Array, precision: jax.lax.PrecisionLike) -> jax.Array:
    """``(I + lower)^-1`` for strictly-lower ``lower [..., S, S]``: ``sum_i (-lower)^i``, as the
    product ``(I - N)(I + N^2)(I + N^4)...`` (``N^S = 0``)."""
    s = lower.shape[-1]
    eye = jnp.eye(s, dtype=lower.dtype)
    inverse, power, width = eye - lower, lower, 2
    while width < s:
        power = jnp.matmul(power, power, precision=precision)
        inverse = jnp.matmul(inverse, eye + power, precision=precision)
        width *= 2
    return inverse


def _halves(a: jax.Array, level: int, lead: int) -> jax.Array:
    """Split the leaf axis (``lead``) of ``a`` into ``[blocks, 2, 2^(level-1)]``."""
    half = 1 << (level - 1)
    return a.reshape(*a.shape[:lead], a.shape[lead] // (2 * half), 2, half, *a.shape[lead + 1:])


def _pairs(a: jax.Array, lead: int) -> jax.Array:
    """Split axis ``lead`` of ``a`` into ``[size / 2, 2]``."""
    return a.reshape(*a.shape[:lead], a.shape[lead] // 2, 2, *a.shape[lead + 1:])


def _join(first: jax.Array, across: jax.Array, second: jax.Array) -> jax.Array:
    """The lower-block-triangular ``[[first, 0], [across, second]]``."""
    top = jnp.concatenate([first, jnp.zeros_like(first)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([across, second], axis=-1)], axis=-2)


def _chunk_terms(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                 product_leaves: bool, precision: jax.lax.PrecisionLike) -> _ChunkTerms:
    """The chunks' own work from ``q, k, g [..., M, S, K]``, ``v [..., M, S, V]`` and
    ``beta [..., M, S]`` (``M`` leaves of ``S`` tokens per chunk; any leading dims)."""
    m, s, _ = q.shape[-3:]
    lead = q.ndim - 3
    levels = m.bit_length() - 1
    local = jnp.cumsum(g, axis=-2)  # within the leaf
    total = local[..., -1, :]  # [..., M, K]: each leaf's decay
    before = jnp.cumsum(total, axis=-2) - total  # the decay of the chunk's earlier leaves
    chunk_total = before[..., -1, :] + total[..., -1, :]
    from_start = jnp.exp(local)  # exp(G_i - R_leaf) <= 1
    q_from_start, k_from_start = q * from_start, k * from_start
    k_to_leaf_end = k * jnp.exp(total[..., None, :] - local)  # exp(E_leaf - G_j) <= 1

    causal = jnp.tril(jnp.ones((s, s), bool))
    if product_leaves:
        # Factors straight from the differences: exp(G_i - R_leaf) may be tiny, and times a
        # factor up to exp(S |lb| / 2) it would lose its digits.
        middle = local[..., s // 2 - 1 : s // 2, :]
        from_middle = jnp.exp(local - middle)
        keys = k * jnp.exp(middle - local)
        diag_qk = _cross(q * from_middle, keys, precision)
        diag_kk = _cross(k * from_middle, keys, precision)
    else:
        pairwise = jnp.exp(jnp.where(causal[..., None], local[..., :, None, :]
                                     - local[..., None, :, :], -jnp.inf))  # [..., M, S, S, K]
        keys = k[..., None, :, :] * pairwise
        diag_qk = jnp.einsum("...id,...ijd->...ij", q, keys, precision=precision)
        diag_kk = jnp.einsum("...id,...ijd->...ij", k, keys, precision=precision)
    diag_qk = jnp.where(causal, diag_qk, 0.0)
    diag_kk = jnp.where(jnp.tril(causal, -1), diag_kk, 0.0)

    # Below the diagonal leaves, one level of splits at a time: second halves' queries against
    # first halves' keys, factorised at the split.
    def flat(a: jax.Array) -> jax.Array:  # [..., blocks, h, S, D] -> [..., blocks, h S, D]
        return a.reshape(*a.shape[:-3], a.shape[-3] * s, a.shape[-1])

    across_qk, across_kk = [], []
    for level in range(1, levels + 1):
        queries_q = _halves(q_from_start, level, lead)[..., 1, :, :, :]
        queries_k = _halves(k_from_start, level, lead)[..., 1, :, :, :]
        keys = _halves(k_to_leaf_end, level, lead)[..., 0, :, :, :]
        if level > 1:  # at level 1 the split is the leaf boundary: both factors are 1
            before_h, total_h = _halves(before, level, lead), _halves(total, level, lead)
            split = before_h[..., 1, :1, :]  # R, [..., blocks, 1, K]
            after_split = jnp.exp(before_h[..., 1, :, :] - split)[..., None, :]  # R_leaf - R
            to_split = jnp.exp(split - before_h[..., 0, :, :]
                               - total_h[..., 0, :, :])[..., None, :]  # R - E_leaf
            queries_q, queries_k = queries_q * after_split, queries_k * after_split
            keys = keys * to_split
        keys = flat(keys)
        across_qk.append(_cross(flat(queries_q), keys, precision))
        across_kk.append(_cross(flat(queries_k), keys, precision))

    # Join the blocks pairwise, level by level, into [C, C]: A_qk, and T by its block inverse.
    a_qk, inverse = diag_qk, _unit_lower_inverse(beta[..., None] * diag_kk, precision)
    for level in range(1, levels + 1):
        a_qk, inverse = _pairs(a_qk, lead), _pairs(inverse, lead)
        a_qk = _join(a_qk[..., 0, :, :], across_qk[level - 1], a_qk[..., 1, :, :])
        first, second = inverse[..., 0, :, :], inverse[..., 1, :, :]
        beta_second = _halves(beta, level, lead)[..., 1, :, :]
        lower = beta_second.reshape(*first.shape[:-1], 1) * across_kk[level - 1]
        across = -jnp.matmul(second, jnp.matmul(lower, first, precision=precision),
                             precision=precision)
        inverse = _join(first, across, second)
    a_qk, inverse = a_qk[..., 0, :, :], inverse[..., 0, :, :]  # one block of M leaves left

    def whole(x: jax.Array) -> jax.Array:  # [..., M, S, D] -> [..., C, D]
        return x.reshape(*x.shape[:-3], m * s, x.shape[-1])

    to_leaf = jnp.exp(before)[..., None, :]  # exp(R_leaf), the decay before each leaf
    beta_col = whole(beta[..., None])
    u_local = jnp.matmul(inverse, beta_col * whole(v), precision=precision)
    w = jnp.matmul(inverse, beta_col * whole(k_from_start * to_leaf), precision=precision)
    leaf_to_end = jnp.exp(chunk_total[..., None, :] - before - total)[..., None, :]
    return _ChunkTerms(a_qk, u_local, w, whole(q_from_start * to_leaf),
                       whole(k_to_leaf_end * leaf_to_end), jnp.exp(chunk_total))


def _hand_off(state: jax.Array, chunk: _ChunkTerms,
              precision: jax.lax.PrecisionLike) -> tuple[jax.Array, jax.Array]:
    u = chunk.u_local - jnp.matmul(chunk.w, state, precision=precision)
    o = jnp.matmul(chunk.q_decayed, state, precision=precision) + jnp.matmul(
        chunk.a_qk, u, precision=precision)
    state = chunk.decay[..., None] * state + jnp.einsum("...ck,...cv->...kv", chunk.k_to_end, u,
                                                        precision=precision)
    return state, o


def kda_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                initial_state: jax.Array | None = None, chunk_size: int = 64,
                sub_chunk_size: int | None = None, gate_lower_bound: float | None = None,
                precision: jax.lax.PrecisionLike = None,
                chunks_per_step: int = 4) -> tuple[jax.Array, jax.Array]:
    """Chunk-parallel KDA (see the module docstring); arguments and results as
    `reference.kda_recurrent`.

    Any ``T`` is accepted: it is right-padded to whole steps of chunks with no-op tokens
    (``k = v = beta = g = 0``) and the output sliced back; an input shorter than a chunk runs as
    one chunk of the fewest leaves that hold it. ``gate_lower_bound``: a bound every
    ``g`` is known to respect (K3's ``gate_lower_bound``), which lets the diagonal leaves run as
    products; ``None`` for unbounded gates. ``sub_chunk_size``: the leaf length (default
    `PRODUCT_LEAF` when the bound allows products, else `PAIRWISE_LEAF`); ``chunk_size`` must be
    a power-of-two multiple of it (or smaller, then one leaf per chunk). ``chunks_per_step``:
    chunks whose own work is computed together in one step of the loop.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    bound_leaf = None if gate_lower_bound is None else \
        PRODUCT_LEAF_MAX_EXPONENT // max(-gate_lower_bound, 1e-30)
    if sub_chunk_size is None:
        sub_chunk_size = PRODUCT_LEAF if bound_leaf is not None and bound_leaf >= PRODUCT_LEAF \
            else PAIRWISE_LEAF
    s = min(sub_chunk_size, chunk_size)
    m = chunk_size // s
    if chunk_size % s or m & (m - 1):
        raise ValueError(f"chunk_size {chunk_size} is not a power-of-two multiple of "
                         f"sub_chunk_size {s}")
    product_leaves = bound_leaf is not None and s <= bound_leaf
    while m > 1 and (m // 2) * s >= t:  # a short input: one chunk just long enough, not padding
        m //= 2
    c = m * s
    n = -(-t // c)
    per_step = max(1, min(chunks_per_step, n))
    steps = -(-n // per_step)
    pad = steps * per_step * c - t

    def to_steps(a: jax.Array) -> jax.Array:  # [B, T, H, ...] -> [steps, per_step, B, H, M, S, ...]
        a = jnp.pad(a.astype(_f32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(b, steps, per_step, m, s, *a.shape[2:])
        return jnp.moveaxis(a, (1, 2, 5), (0, 1, 3))

    def step(state, xs):
        chunks = _chunk_terms(*xs, product_leaves=product_leaves, precision=precision)
        outputs = []
        for i in range(per_step):
            state, o = _hand_off(state, _ChunkTerms(*(x[i] for x in chunks)), precision)
            outputs.append(o)
        return state, jnp.stack(outputs)

    state = jnp.zeros((b, h, dk, dv), _f32) if initial_state is None else \
        initial_state.astype(_f32)
    state, o = jax.lax.scan(step, state, tuple(to_steps(x) for x in (q, k, v, g, beta)))
    # [steps, per_step, B, H, C, V] -> [B, T, H, V]
    o = jnp.moveaxis(o, (0, 1, 3), (1, 2, 4)).reshape(b, steps * per_step * c, h, dv)
    return o[:, :t], state
