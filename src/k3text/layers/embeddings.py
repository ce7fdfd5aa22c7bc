"""Token embedding and the LM head (both vocab-parallel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3text.config import Config
from k3text.layers.initializers import Init, compute_dtype, weight_dtype
from k3text.layers.linears import matmul


class Embed(nnx.Module):
    def __init__(self, cfg: Config, init: Init):
        self.table = init.normal((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                                 weight_dtype(cfg))
        self.dtype = compute_dtype(cfg)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.table[...], tokens, axis=0).astype(self.dtype)

    def attend(self, cfg: Config, x: jax.Array) -> jax.Array:
        """Tied LM head: x @ table.T."""
        return matmul(cfg, x, self.table[...].T)


class LMHead(nnx.Module):
    def __init__(self, cfg: Config, init: Init):
        self.cfg = cfg
        self.kernel = init.fan_in((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                  weight_dtype(cfg))

    def __call__(self, x: jax.Array) -> jax.Array:
        return matmul(self.cfg, x, self.kernel[...])
