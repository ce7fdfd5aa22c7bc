"""What KDA does to its projections before the delta rule, shared by the prefill path and every
decode-step implementation: SiLU after the conv, per-head L2 norm of q and k with the query
scale, the decay gate, and beta."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3text.ops.kda.reference import l2_normalize

__all__ = ["decay_gate", "mix_qkv"]

_f32 = jnp.float32


def decay_gate(f: jax.Array, a_log: jax.Array, dt_bias: jax.Array,
               lower_bound: float | None) -> jax.Array:
    """Log-space per-channel decay ``g <= 0`` from the decay projection ``f [..., H, K]``.

    Kimi Linear (``lower_bound`` None): ``g = -exp(A_log) * softplus(f + dt_bias)``, unbounded.
    K3 (``lower_bound = lb < 0``): ``g = lb * sigmoid(exp(A_log) * (f + dt_bias))``, in (lb, 0).
    ``a_log [H]``, ``dt_bias [H*K]``; float32 out.
    """
    heads, head_dim = f.shape[-2:]
    x = f.astype(_f32) + dt_bias.astype(_f32).reshape(heads, head_dim)
    rate = jnp.exp(a_log.astype(_f32))[:, None]
    if lower_bound:
        return lower_bound * jax.nn.sigmoid(rate * x)
    return -rate * jax.nn.softplus(x)


def mix_qkv(y: jax.Array, heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Convolved ``[..., 3, H*K]`` q, k, v -> SiLU, then per head ``[..., H, K]``: q and k
    L2-normalised (without it the state grows without bound) and q scaled by ``K**-0.5``.
    float32 out."""
    y = jax.nn.silu(y.astype(_f32))
    q, k, v = (y[..., i, :].reshape(*y.shape[:-2], heads, -1) for i in range(3))
    return l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k), v
