"""KDA across sequence slices: the rows of a batch taken as consecutive slices of one sequence
(row r holds its tokens [r*T, (r+1)*T)), so a context-parallel prefill splits a prompt over the
devices that split the batch.

The two sequential parts of a KDA layer cross the slice boundaries here; everything else in the
layer is per token.

- The short conv needs the W - 1 inputs before each slice: row r's are the last W - 1 inputs of
  row r - 1 (`slice_halos`: the rows' tails gathered, a few KB, then shifted locally), row 0's
  the incoming conv state.
- The delta rule is linear in its state, so each slice's effect on it is an affine map
  S_out = M S_in + B (M [K, K] per head: the product of the slice's (I - beta k k^T) diag(alpha)
  factors). One pass over the augmented values [v | 0] from the state [0 | I] gives, per slice,
  B and M together, and at every token both the output from a zero state and p_t = M_t^T q_t,
  the token's view of the incoming state. The slices' maps compose by an associative scan
  (exclusive, from the incoming state), and each token's output is finished with one matmul,
  o_t = o_t(0) + S_in^T p_t: no second pass over the slice.

The augmented pass is the ordinary prefill op over V + K value columns, so it runs in any of
its implementations; `prefill_across_rows` is tested against a float64 recurrence over the whole
sequence, in each implementation (tests/test_context_parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from k3text import sharding

__all__ = ["last_filled_row", "prefill_across_rows", "slice_halos"]

_f32 = jnp.float32
_CONV_AXES = (None, None, "heads")  # a conv state's [W - 1, 3, H*K] after its row


def slice_halos(inputs: jax.Array, conv_state: jax.Array) -> jax.Array:
    """The W - 1 conv inputs before each slice: ``inputs [N, T, *C]`` (the conv's raw inputs,
    ``T >= W - 1``), ``conv_state [N, W - 1, *C]`` (the sequence's incoming state, row 0's is
    used) -> ``[N, W - 1, *C]``. A slice after a partly filled one gets that slice's padding: it
    holds only padding itself (padding comes last)."""
    width = conv_state.shape[1]
    # Every row's tail on every device (one small all-gather), then a local shift; left to the
    # partitioner, the shift over the split rows became several all-to-alls per layer.
    tails = _whole_rows(inputs[:, inputs.shape[1] - width:].astype(conv_state.dtype),
                        _CONV_AXES)
    shifted = jnp.concatenate([_whole_rows(conv_state[:1], _CONV_AXES), tails[:-1]], axis=0)
    return _own_rows(_whole_rows(shifted, _CONV_AXES), _CONV_AXES)


def last_filled_row(x: jax.Array, lengths: jax.Array) -> jax.Array:
    """Every row replaced by the last row with ``lengths > 0`` (row 0 when none is): ``x [N,
    ...]`` -> the same shape. What a slice computes for the whole sequence's end (its conv state)
    lives in the slice that holds the last token."""
    rows = jnp.arange(x.shape[0])
    last = jnp.max(jnp.where(lengths > 0, rows, 0))
    return _own_rows(jnp.broadcast_to(_whole_rows(x, _CONV_AXES)[last], x.shape), _CONV_AXES)


def _whole_rows(x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
    """x [N, ...] with every row on every device (an all-gather over the batch axes where the
    rows are split); the other axes keep the layout `logical` names. Pinning the small
    cross-row arrays whole, and their results whole until `_own_rows`, keeps the shifts and
    the scan local: left to the partitioner, they became several all-to-alls and
    collective-permutes per layer."""
    return sharding.constrain(x, (None, *logical))


def _own_rows(x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
    """x [N, ...] back in the rows' layout (each device keeps its own rows: no communication)."""
    return sharding.constrain(x, ("batch", *logical))


def _compose(earlier: tuple[jax.Array, jax.Array], later: tuple[jax.Array, jax.Array],
             precision: jax.lax.PrecisionLike) -> tuple[jax.Array, jax.Array]:
    """The affine map `later` after `earlier`, each (M [..., K, K], B [..., K, V])."""
    m1, b1 = earlier
    m2, b2 = later
    mm = lambda a, b: jnp.einsum("...ij,...jk->...ik", a, b, precision=precision)  # noqa: E731
    return mm(m2, m1), mm(m2, b1) + b2


def prefill_across_rows(
    prefill: Callable[..., tuple[jax.Array, jax.Array]],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array,
    precision: jax.lax.PrecisionLike = None,
) -> tuple[jax.Array, jax.Array]:
    """KDA over one sequence split into rows: ``q, k, g [N, T, H, K]``, ``v [N, T, H, V]``,
    ``beta [N, T, H]`` (row r the sequence's r-th slice), ``initial_state [N, H, K, V]`` (the
    sequence's state before row 0; row 0's is used) -> ``(o [N, T, H, V], final state)``, the
    final state in every row. ``prefill(q, k, v, g, beta, initial_state)`` is the one-sequence
    prefill op the slices run with."""
    n, _, heads, dk = k.shape
    dv = v.shape[-1]
    augmented = jnp.concatenate([v.astype(_f32), jnp.zeros((*v.shape[:-1], dk), _f32)], -1)
    identity = jnp.broadcast_to(jnp.eye(dk, dtype=_f32), (n, heads, dk, dk))
    start = jnp.concatenate([jnp.zeros((n, heads, dk, dv), _f32), identity], axis=-1)
    o_aug, s_aug = prefill(q, k, augmented, g, beta, start)
    zero_state_output, views = o_aug[..., :dv], o_aug[..., dv:]
    # Every slice's map on every device (one all-gather of [N, H, K, V + K] per layer); the
    # scan and each row's incoming state are then local.
    s_aug = _whole_rows(s_aug, ("heads", None, None))
    maps = (s_aug[..., dv:], s_aug[..., :dv])  # per slice: (M [N,H,K,K], B [N,H,K,V])
    # Inclusive scan: after[r] = the map of slices 0..r; the state entering slice r is
    # after[r - 1] applied to the sequence's incoming state.
    after = jax.lax.associative_scan(lambda a, b: _compose(a, b, precision), maps)
    state_axes = ("heads", None, None)
    s0 = _whole_rows(initial_state[:1].astype(_f32), state_axes)
    states = _compose((jnp.zeros_like(after[0][:1]), s0), after, precision)[1]  # [N, H, K, V]
    incoming = _whole_rows(jnp.concatenate([s0, states[:-1]], axis=0), state_axes)
    o = zero_state_output + jnp.einsum("nthk,nhkv->nthv", views,
                                       _own_rows(incoming, state_axes), precision=precision)
    final = _whole_rows(jnp.broadcast_to(states[-1], (n, heads, dk, dv)), state_axes)
    return o, _own_rows(final, state_axes)
