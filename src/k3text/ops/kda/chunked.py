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
- ``[W | U] = T diag(beta) [K * Gamma | V]`` by one product with ``T`` (``W`` the state
  weights), and ``A_qk [W | U]`` by one more: ``o = (q * Gamma) S0 + A_qk (U - W S0)`` is
  ``(q * Gamma - A_qk W) S0 + A_qk U``, so everything in the output but one product with ``S0``
  is the chunk's own work.

The chunks are walked ``chunks_per_step`` at a time (a loop): each step computes those chunks'
own work together, then hands the state from chunk to chunk with two products each:
``[W; q * Gamma - A_qk W] S0`` (both reads of the state in one product) gives ``u = U - W S0``
and ``o``, and ``S = diag(Gamma_C) S0 + (K * exp(G_C - G))^T u``, the keys kept transposed so
the product is in the library's plain form. A step's own work needs none of the state, so the
loop computes it beside the hand-off of the step before, where XLA:CPU's two threads can run
both at once. Doing the chunk work inside the loop keeps a few chunks' intermediates in cache;
computed for the whole sequence up front, every elementwise step of it is a pass through
memory, and those passes cost more than the products. For the same reason the loop reads each
step's tokens straight out of the ``[B, T, H, K]`` inputs and writes its outputs in place: a
reordered copy of the whole sequence is a buffer XLA:CPU allocates, and the operating system
zero-fills page by page, on every call.

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
# Chunk-heads (batch x heads x chunks) whose own work one step of the loop computes, unless
# told otherwise: enough to batch the products, few enough that a step's intermediates stay in
# cache and its buffers small (B=1, H=4: four chunks a step; B=8, H=4: one).
STEP_CHUNK_HEADS = 16


class _ChunkTerms(NamedTuple):
    """A chunk's own work, leading dims ``[..., B, H]``."""
    queries: jax.Array  # [..., C, K]: q * Gamma
    w_u: jax.Array  # [..., C, K + V]: [W | U]
    a_w_u: jax.Array  # [..., C, K + V]: A_qk [W | U]
    keys_to_end: jax.Array  # [..., K, C]: (k * exp(G_C - G))^T
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
    causal = jnp.tril(jnp.ones((s, s), bool))
    if product_leaves:
        # One exponential per element, about the leaf's middle: every factor below is built
        # from it and a per-leaf vector, never passing through a value smaller than its own
        # (exp(G_i - R_leaf) formed on its own may be tiny, and times a factor up to
        # exp(S |lb| / 2) it would lose its digits).
        at = max(s // 2 - 1, 0)  # a leaf of one token is its own middle
        middle = local[..., at : at + 1, :]
        from_middle = jnp.exp(local - middle)  # within exp(+-S |lb| / 2)
        keys = k / from_middle
        from_start = from_middle * jnp.exp(middle)  # exp(G_i - R_leaf) <= 1
        k_to_leaf_end = keys * jnp.exp(total[..., None, :] - middle)  # exp(E_leaf - G_j) <= 1
    else:
        from_start = jnp.exp(local)
        k_to_leaf_end = k * jnp.exp(total[..., None, :] - local)
    q_from_start, k_from_start = q * from_start, k * from_start
    if product_leaves:
        # q's and k's rows against the same keys: one product.
        both = _cross(jnp.concatenate([q * from_middle, k * from_middle], axis=-2), keys,
                      precision)
    else:
        pairwise = jnp.exp(jnp.where(causal[..., None], local[..., :, None, :]
                                     - local[..., None, :, :], -jnp.inf))  # [..., M, S, S, K]
        keys = k[..., None, :, :] * pairwise
        both = jnp.einsum("...id,...ijd->...ij", jnp.concatenate([q, k], axis=-2),
                          jnp.concatenate([keys, keys], axis=-3), precision=precision)
    diag_qk, diag_kk = both[..., :s, :], both[..., s:, :]
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
        rows = queries_q.shape[-3] * s
        both = _cross(jnp.concatenate([flat(queries_q), flat(queries_k)], axis=-2), flat(keys),
                      precision)
        across_qk.append(both[..., :rows, :])
        across_kk.append(both[..., rows:, :])

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
    beta_row = whole(beta[..., None])[..., None, :, 0]  # [..., 1, C]: diag(beta) on T's side
    w_u = jnp.matmul(inverse * beta_row, jnp.concatenate(
        [whole(k_from_start * to_leaf), whole(v)], axis=-1), precision=precision)
    a_w_u = jnp.matmul(a_qk, w_u, precision=precision)
    leaf_to_end = jnp.exp(chunk_total[..., None, :] - before - total)[..., None, :]
    keys_to_end = jnp.swapaxes(whole(k_to_leaf_end * leaf_to_end), -1, -2)
    # [W | U] and A_qk [W | U] are kept whole, as their products wrote them: a slice carried
    # through the loop would be a copy.
    return _ChunkTerms(whole(q_from_start * to_leaf), w_u, a_w_u, keys_to_end,
                       jnp.exp(chunk_total))


def _hand_off(state: jax.Array, chunk: _ChunkTerms,
              precision: jax.lax.PrecisionLike) -> tuple[jax.Array, jax.Array]:
    """One chunk's output and the state after it, from the state before it."""
    c, dk = chunk.w_u.shape[-2], state.shape[-2]
    # [W; q * Gamma - A_qk W], what multiplies S0, made per chunk where its product reads it
    # (no state needed, so off the chain); one array for a step's chunks would be sliced here,
    # and each slice copied.
    reads = jnp.concatenate([chunk.w_u[..., :dk], chunk.queries - chunk.a_w_u[..., :dk]],
                            axis=-2)
    read = jnp.matmul(reads, state, precision=precision)  # [W S0; Q S0]
    u = chunk.w_u[..., dk:] - read[..., :c, :]
    state = chunk.decay[..., None] * state + jnp.matmul(chunk.keys_to_end, u,
                                                        precision=precision)
    return state, read[..., c:, :] + chunk.a_w_u[..., dk:]


def kda_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                initial_state: jax.Array | None = None, chunk_size: int = 32,
                sub_chunk_size: int | None = None, gate_lower_bound: float | None = None,
                precision: jax.lax.PrecisionLike = None,
                chunks_per_step: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Chunk-parallel KDA (see the module docstring); arguments and results as
    `reference.kda_recurrent`.

    Any ``T`` is accepted: the loop reads whole steps of chunks in place, and a last partial
    step is right-padded with no-op tokens (``k = v = beta = g = 0``); an input shorter than a
    chunk runs as one chunk of the fewest leaves that hold it. ``gate_lower_bound``: a bound every
    ``g`` is known to respect (K3's ``gate_lower_bound``), which lets the diagonal leaves run as
    products; ``None`` for unbounded gates. ``sub_chunk_size``: the leaf length (default
    `PRODUCT_LEAF` when the bound allows products, else `PAIRWISE_LEAF`); ``chunk_size`` must be
    a power-of-two multiple of it (or smaller, then one leaf per chunk). ``chunks_per_step``:
    chunks whose own work is computed together in one step of the loop (default: about
    `STEP_CHUNK_HEADS` chunk-heads a step).
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
    if chunks_per_step is None:
        chunks_per_step = STEP_CHUNK_HEADS // (b * h)
    per_step = max(1, min(chunks_per_step, -(-t // c)))
    span = per_step * c  # tokens per step of the loop
    inputs = (q, k, v, g, beta)

    def terms(xs: tuple[jax.Array, ...]) -> _ChunkTerms:
        """The own work of one step's chunks from its tokens ``[B, span, H, ...]``."""
        def leaves(a: jax.Array) -> jax.Array:  # -> [per_step, B, H, M, S, ...]
            a = a.astype(_f32).reshape(b, per_step, m, s, *a.shape[2:])
            return jnp.moveaxis(a, (1, 4), (0, 2))

        return _chunk_terms(*(leaves(x) for x in xs), product_leaves=product_leaves,
                            precision=precision)

    def hand_off(state: jax.Array, chunks: _ChunkTerms) -> tuple[jax.Array, list[jax.Array]]:
        """The state through one step's chunks -> (state, each chunk's o ``[B, C, H, V]``)."""
        outputs = []
        for i in range(per_step):
            state, o = _hand_off(state, _ChunkTerms(*(x[i] for x in chunks)), precision)
            outputs.append(jnp.swapaxes(o, 1, 2))
        return state, outputs

    full, rest = divmod(t, span)
    steps = full + (rest > 0)

    def tokens(i: int | jax.Array) -> tuple[jax.Array, ...]:
        if isinstance(i, int) and i == full:  # the last, partial step: right-padded
            return tuple(jnp.pad(x[:, full * span:], [(0, 0), (0, span - rest)]
                                 + [(0, 0)] * (x.ndim - 2)) for x in inputs)
        return tuple(jax.lax.dynamic_slice_in_dim(x, i * span, span, axis=1) for x in inputs)

    def write(out: jax.Array, outputs: list[jax.Array], i: int | jax.Array) -> jax.Array:
        # Chunk by chunk: each chunk's transposition and last sum fuse into its in-place
        # update of ``out`` (a step's outputs stacked first were two more copies).
        if isinstance(i, int) and i == full:
            o = jnp.concatenate(outputs, axis=1)[:, :rest]
            return jax.lax.dynamic_update_slice_in_dim(out, o, i * span, axis=1)
        for n, o in enumerate(outputs):
            out = jax.lax.dynamic_update_slice_in_dim(out, o, i * span + n * c, axis=1)
        return out

    # Each step's chunk work needs only its tokens, so it is computed beside the hand-off of
    # the step before it, where XLA:CPU's threads can run the two side by side. Two steps per
    # iteration: step 2j's terms come in the carry, step 2j + 1's are computed beside 2j's
    # hand-off and step 2j + 2's (the carry out) beside 2j + 1's, held back by a barrier until
    # 2j's hand-off has read its terms and written its output, so the carry's buffers are
    # reused in place rather than copied.
    def body(j: jax.Array, carry: tuple[jax.Array, jax.Array, _ChunkTerms]
             ) -> tuple[jax.Array, jax.Array, _ChunkTerms]:
        state, out, current = carry
        following = terms(tokens(2 * j + 1))
        state, o = hand_off(state, current)
        state, o, after = jax.lax.optimization_barrier((state, o, tokens(2 * j + 2)))
        out = write(out, o, 2 * j)
        current = terms(after)
        state, o = hand_off(state, following)
        return state, write(out, o, 2 * j + 1), current

    state = jnp.zeros((b, h, dk, dv), _f32) if initial_state is None else \
        initial_state.astype(_f32)
    out = jnp.zeros((b, t, h, dv), _f32)
    current = terms(tokens(0))
    pairs = max(full - 1, 0) // 2  # the loop reads whole steps only, up to step 2 pairs
    if pairs:
        state, out, current = jax.lax.fori_loop(0, pairs, body, (state, out, current))
    for i in range(2 * pairs, steps):  # one to three steps left
        following = terms(tokens(i + 1)) if i + 1 < steps else None
        state, o = hand_off(state, current)
        out, current = write(out, o, i), following
    return out, state
