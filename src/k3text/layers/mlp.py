"""The gated MLP used for dense layers and shared experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3text.config import Config
from k3text.layers.activations import glu
from k3text.layers.initializers import Init, compute_dtype, precision, weight_dtype


class MLP(nnx.Module):
    """down(act(gate(x), up(x))).

    Gate and up are fused into one kernel [hidden, 2, width]: the pair axis keeps both halves of
    every tensor-parallel shard on the same device, so splitting them needs no communication.
    """

    def __init__(self, cfg: Config, hidden: int, width: int, init: Init):
        self.cfg = cfg
        self.wi = init.fan_in((hidden, 2, width), ("embed", None, "mlp"), weight_dtype(cfg),
                              fan_in=hidden)
        self.wo = init.fan_in((width, hidden), ("mlp", "embed"), weight_dtype(cfg))

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype, prec = compute_dtype(self.cfg), precision(self.cfg)
        gate_up = jnp.einsum("...d,dpf->...pf", x.astype(dtype), self.wi[...].astype(dtype),
                             precision=prec)
        h = glu(self.cfg, gate_up[..., 0, :], gate_up[..., 1, :])
        return jnp.dot(h, self.wo[...].astype(dtype), precision=prec)
