"""Decode state: what each sequence slot carries between steps, with shapes, dtypes and logical
axes derived from the config.

- `kda_recurrent` [n_kda, B, H, K, V] in `kda_state_dtype`: the delta-rule state of every KDA
  layer (K3: 69 x 96 x 128 x 128 x 4 B = 434 MB per sequence in float32); the layers read it
  into float32 and round it back when they store it;
- `kda_conv` [n_kda, B, W-1, 3, H*K]: the last W-1 inputs of the q, k and v short convolutions;
- `mla_cache` [n_mla, B, S, kv_lora + rope] in `mla_cache_dtype`: the absorbed MLA latent cache
  (K3: 24 x 576 values per token);
- `lengths` [B] int32: tokens already in each slot.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3text.config import Config


class DecodeState(NamedTuple):
    kda_recurrent: jax.Array
    kda_conv: jax.Array
    mla_cache: jax.Array
    lengths: jax.Array


def cache_length(cfg: Config) -> int:
    """MLA cache positions per slot: max_target_length rounded up to whole prefill chunks, so
    the last chunk of the longest prompt always fits."""
    chunk = cfg.prefill_chunk_size
    return -(-cfg.max_target_length // chunk) * chunk


def state_shapes(cfg: Config, batch: int, cache_len: int | None = None) -> DecodeState:
    """ShapeDtypeStructs of the decode state for `batch` slots."""
    st = cfg.structure
    lin = cfg.linear_attn_config
    width = lin.num_heads * lin.head_dim
    cache_len = cache_length(cfg) if cache_len is None else cache_len
    return DecodeState(
        kda_recurrent=jax.ShapeDtypeStruct(
            (st.num_kda, batch, lin.num_heads, lin.head_dim, lin.head_dim),
            jnp.dtype(cfg.kda_state_dtype)),
        kda_conv=jax.ShapeDtypeStruct(
            (st.num_kda, batch, lin.short_conv_kernel_size - 1, 3, width), jnp.dtype(cfg.dtype)),
        mla_cache=jax.ShapeDtypeStruct(
            (st.num_mla, batch, cache_len, cfg.mla_latent_dim), jnp.dtype(cfg.mla_cache_dtype)),
        lengths=jax.ShapeDtypeStruct((batch,), jnp.int32),
    )


STATE_AXES = DecodeState(
    kda_recurrent=("layers", "batch", "heads", None, None),
    kda_conv=("layers", "batch", None, None, "heads"),
    mla_cache=("layers", "batch", "cache_seq", "kv_lora"),
    lengths=("batch",),
)


def zeros(cfg: Config, batch: int, cache_len: int | None = None) -> DecodeState:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state_shapes(cfg, batch,
                                                                             cache_len))


def bytes_per_sequence(cfg: Config) -> dict[str, int]:
    """Bytes of each state component for one sequence slot (MLA cache per token)."""
    shapes = state_shapes(cfg, batch=1, cache_len=1)
    size = lambda s: s.size * jnp.dtype(s.dtype).itemsize  # noqa: E731
    return {"kda_recurrent": size(shapes.kda_recurrent), "kda_conv": size(shapes.kda_conv),
            "mla_cache_per_token": size(shapes.mla_cache)}
