"""Parameter creation: values, storage dtype and logical axes in one place.

`Init` draws synthetic weights on the host with NumPy (deterministic for a seed, and no XLA
compile per parameter shape), or, in abstract mode, only records shapes and dtypes so the full
2.8 T-parameter K3 can be built without allocating a byte. Inside `Init.stacked(n)` every
parameter gets a leading axis of n layers-groups (logical axis "layers"), which is how scanned
layer groups are built directly in their stacked form.

Synthetic weights are scaled by 1/sqrt(fan_in) so random tiny models keep activations O(1)
(unscaled N(0, 1) weights blow activations up and turn float noise into fake bugs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from k3text.config import Config

# Parameters the checkpoints store (and the math needs) in float32 whatever weight_dtype says.
FP32 = jnp.float32


def weight_dtype(cfg: Config) -> jnp.dtype:
    return jnp.dtype(cfg.weight_dtype)


def compute_dtype(cfg: Config) -> jnp.dtype:
    return jnp.dtype(cfg.dtype)


def precision(cfg: Config) -> jax.lax.Precision | None:
    return {"default": None, "high": jax.lax.Precision.HIGH,
            "highest": jax.lax.Precision.HIGHEST}[cfg.matmul_precision]


class Init:
    """Creates parameters: random (seeded NumPy) or abstract (shapes only)."""

    def __init__(self, seed: int = 0, abstract: bool = False):
        self.rng = np.random.default_rng(seed)
        self.abstract = abstract
        self.leading: tuple[int, ...] = ()

    @contextlib.contextmanager
    def stacked(self, n: int) -> Iterator[Init]:
        """Parameters created inside get a leading [n] axis named 'layers'."""
        self.leading = (n, *self.leading)
        try:
            yield self
        finally:
            self.leading = self.leading[1:]

    def _param(self, shape: Sequence[int], axes: Sequence[str | None], dtype: DTypeLike,
               draw) -> nnx.Param:
        shape = (*self.leading, *shape)
        axes = (*(("layers",) * len(self.leading)), *axes)
        if len(axes) != len(shape):
            raise ValueError(f"axes {axes} do not match shape {shape}")
        if self.abstract:
            value = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
        else:
            value = jnp.asarray(np.asarray(draw(shape)).astype(jnp.dtype(dtype)))
        return nnx.Param(value, axes=axes)

    def normal(self, shape: Sequence[int], axes: Sequence[str | None], dtype: DTypeLike,
               std: float = 1.0) -> nnx.Param:
        return self._param(shape, axes, dtype,
                           lambda s: self.rng.standard_normal(s, np.float32) * np.float32(std))

    def fan_in(self, shape: Sequence[int], axes: Sequence[str | None], dtype: DTypeLike,
               fan_in: int | None = None) -> nnx.Param:
        """Normal(0, 1/fan_in); fan_in defaults to the second-to-last dimension."""
        fan_in = fan_in if fan_in is not None else shape[-2]
        return self.normal(shape, axes, dtype, std=fan_in**-0.5)

    def constant(self, shape: Sequence[int], axes: Sequence[str | None], dtype: DTypeLike,
                 value: float = 1.0) -> nnx.Param:
        return self._param(shape, axes, dtype, lambda s: np.full(s, value, np.float32))

    def uniform(self, shape: Sequence[int], axes: Sequence[str | None], dtype: DTypeLike,
                low: float, high: float) -> nnx.Param:
        return self._param(shape, axes, dtype,
                           lambda s: self.rng.uniform(low, high, s).astype(np.float32))

    def integers(self, shape: Sequence[int], axes: Sequence[str | None], dtype: DTypeLike, low: int,
                 high: int) -> nnx.Param:
        """Uniform integers in [low, high)."""
        return self._param(shape, axes, dtype, lambda s: self.rng.integers(low, high, s))

    def values(self, shape: Sequence[int], axes: Sequence[str | None], dtype: DTypeLike,
               fn: Callable[[np.random.Generator, tuple[int, ...]], Any]) -> nnx.Param:
        """A parameter whose value is fn(rng, shape) (e.g. a structured init)."""
        return self._param(shape, axes, dtype, lambda s: fn(self.rng, s))
