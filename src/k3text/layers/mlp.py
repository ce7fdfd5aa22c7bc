"""The gated MLP used for dense layers and shared experts."""

from __future__ import annotations

import jax
from flax import nnx

from k3text.config import Config
from k3text.layers.activations import glu
from k3text.layers.initializers import Init, weight_dtype
from k3text.layers.linears import matmul_out_in


class MLP(nnx.Module):
    """down(act(gate(x), up(x))).

    Kernels are stored [out, in], as in the checkpoint (see `matmul_out_in`). Gate and up share
    one kernel [2, width, hidden]: the pair axis keeps both halves of every tensor-parallel
    shard on the same device, so splitting them needs no communication.
    """

    def __init__(self, cfg: Config, hidden: int, width: int, init: Init):
        self.cfg = cfg
        self.wi = init.fan_in((2, width, hidden), (None, "mlp", "embed"), weight_dtype(cfg),
                              fan_in=hidden)
        self.wo = init.fan_in((hidden, width), ("embed", "mlp"), weight_dtype(cfg),
                              fan_in=width)

    def __call__(self, x: jax.Array) -> jax.Array:
        wi = self.wi[...]
        h = glu(self.cfg, matmul_out_in(self.cfg, x, wi[0]), matmul_out_in(self.cfg, x, wi[1]))
        return matmul_out_in(self.cfg, h, self.wo[...])
