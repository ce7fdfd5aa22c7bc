"""Decode state: what each sequence slot carries between steps, with shapes, dtypes and logical
axes derived from the config.

- `kda_recurrent` [n_kda, B, H, K, V] in `kda_state_dtype`: the delta-rule state of every KDA
  layer (K3: 69 x 96 x 128 x 128 x 4 B = 434 MB per sequence in float32); the layers read it
  into float32 and round it back when they store it;
- `kda_conv` [n_kda, B, W-1, 3, H*K]: the last W-1 inputs of the q, k and v short convolutions;
- `mla_cache` [n_mla, B, S, kv_lora + rope] in `mla_cache_dtype`: the absorbed MLA latent cache
  (K3: 24 x 576 values per token);
- `lengths` [B] int32: tokens already in each slot.

The paged form (`paged_state_shapes`) is the same tuple with `mla_cache` a page pool
`[n_mla, num_pages, page_size, kv_lora + rope]` shared by every sequence, whose positions are
found through page tables (`inference/pages.py`); the KDA fields are then a pool of state
slots, one per live sequence. A step reads it through `StepRows`.
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


def paged_state_shapes(cfg: Config, slots: int, num_pages: int, page_size: int,
                       ) -> DecodeState:
    """ShapeDtypeStructs of the paged form: `slots` KDA state slots and a pool of `num_pages`
    MLA pages of `page_size` positions."""
    shapes = state_shapes(cfg, slots, cache_len=page_size)
    pages = shapes.mla_cache
    return shapes._replace(mla_cache=jax.ShapeDtypeStruct(
        (pages.shape[0], num_pages, page_size, pages.shape[3]), pages.dtype))


PAGED_STATE_AXES = STATE_AXES._replace(mla_cache=("layers", None, "cache_seq", "kv_lora"))


class StepRows(NamedTuple):
    """One kind of row of a step over the paged state, [R] per field (and [R, W] tokens): row r
    is a window of one sequence's next tokens, at positions [start, start + count) (padding
    after them), reading and writing KDA state slot `slot` and the pages of its table row
    `pages` (unused entries the null page). A row with count 0 is padding: it changes no state.
    """

    tokens: jax.Array  # [R, W] int32
    slot: jax.Array | None  # [R] int32; None: row r is slot r (every slot, in order)
    start: jax.Array  # [R] int32
    count: jax.Array  # [R] int32
    pages: jax.Array  # [R, max pages] int32


def zeros(cfg: Config, batch: int, cache_len: int | None = None) -> DecodeState:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state_shapes(cfg, batch,
                                                                             cache_len))


def bytes_per_sequence(cfg: Config) -> dict[str, int]:
    """Bytes of each state component for one sequence slot (MLA cache per token)."""
    shapes = state_shapes(cfg, batch=1, cache_len=1)
    size = lambda s: s.size * jnp.dtype(s.dtype).itemsize  # noqa: E731
    return {"kda_recurrent": size(shapes.kda_recurrent), "kda_conv": size(shapes.kda_conv),
            "mla_cache_per_token": size(shapes.mla_cache)}
