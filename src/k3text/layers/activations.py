"""Gated MLP activations: SiLU-GLU (Kimi Linear) and SiTU-GLU (K3), both in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3text.config import Config


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def situ_glu(gate: jax.Array, up: jax.Array, beta: float, linear_beta: float) -> jax.Array:
    """SiTU: [beta*tanh(gate/beta) * sigmoid(gate)] * [linear_beta*tanh(up/linear_beta)].

    A soft-capped SiLU-GLU; `linear_beta == 0` means the up branch passes through uncapped.
    """
    capped_gate = beta * jnp.tanh(gate / beta) * jax.nn.sigmoid(gate)
    capped_up = linear_beta * jnp.tanh(up / linear_beta) if linear_beta else up
    return capped_gate * capped_up


def glu(cfg: Config, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The config's gated activation, computed in fp32 and cast back to the input dtype."""
    dtype = gate.dtype
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if cfg.hidden_act == "situ":
        out = situ_glu(gate, up, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    else:
        out = silu_glu(gate, up)
    return out.astype(dtype)
