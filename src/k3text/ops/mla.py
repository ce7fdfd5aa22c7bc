"""MLA decode attention over the latent cache, absorbed: each head's query lives in latent space
(`c_kv || k_r`, 576 wide for K3), so a step attends directly over the cached rows.

`decode_attention(query, new_latent, cache, positions, ...)` writes each row's new latent at its
position and attends over every cached position up to it. Two implementations, chosen by where
the cache lives (the `cache_seq` logical axis):

- `replicated` (the reference): the cache whole on every device; one softmax over all positions.
- `sequence_sharded`: the cache split by position over the `cache_seq` mesh axes, so a device
  holds 1/N of every sequence. Inside `shard_map` each device writes the new row only if it owns
  the position, scores the (all-gathered) query against its own positions, and the devices
  merge with a log-sum-exp combine: one `pmax` of the per-head score maxima, then one sum of
  each head's exp-weighted latent sum and its normaliser together (a reduce-scatter over the
  heads when heads split over the same devices, so each keeps its own heads). The cache never
  moves; what crosses devices per layer and step is the query (B x H x 576 in the compute
  dtype) and the sums (B x H x 577 fp32), whatever the context length.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from k3text import sharding

log = logging.getLogger(__name__)

FP32 = jnp.float32
_LOGGED: set[str] = set()


def implementation() -> str:
    """`sequence_sharded` when the active mesh splits `cache_seq`, else `replicated`."""
    ctx = sharding.active()
    return "sequence_sharded" if ctx is not None and ctx.size("cache_seq") > 1 else "replicated"


def to_cache_dtype(latent: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`latent` as the cache stores it. A float8 cache saturates at its largest finite value:
    float8_e4m3fn has no infinity, and a plain cast turns anything past it into NaN, which
    would poison every later step that attends to the row."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        top = float(jnp.finfo(dtype).max)
        latent = jnp.clip(latent, -top, top)
    return latent.astype(dtype)


def write_rows(cache: jax.Array, latent: jax.Array, positions: jax.Array) -> jax.Array:
    """cache [B, S, C] with row b's `latent[b]` at `positions[b]` (dropped past the end)."""
    rows = jnp.arange(cache.shape[0])
    return cache.at[rows, positions].set(to_cache_dtype(latent, cache.dtype), mode="drop")


def attention_reference(query: jax.Array, cache: jax.Array, positions: jax.Array, scale: float,
                        precision: jax.lax.Precision | None, dtype: jnp.dtype) -> jax.Array:
    """query [B, H, C] over cache [B, S, C], positions <= positions[b] visible -> [B, H, C]."""
    latents = cache.astype(dtype)
    scores = jnp.einsum("bhc,bsc->bhs", query.astype(dtype), latents, precision=precision,
                        preferred_element_type=FP32) * scale
    valid = jnp.arange(cache.shape[1])[None, :] <= positions[:, None]
    probs = jax.nn.softmax(jnp.where(valid[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhs,bsc->bhc", probs.astype(dtype), latents, precision=precision,
                      preferred_element_type=FP32)


def decode_attention(query: jax.Array, new_latent: jax.Array, cache: jax.Array,
                     positions: jax.Array, scale: float, precision: jax.lax.Precision | None,
                     dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Write `new_latent` [B, C] at `positions` [B] into `cache` [B, S, C], then attend with
    `query` [B, H, C] (fp32 out, [B, H, C]). Returns (output, cache)."""
    choice = implementation()
    if choice not in _LOGGED:
        _LOGGED.add(choice)
        log.info("mla decode attention: %s", choice)
    if choice == "replicated":
        cache = write_rows(cache, new_latent, positions)
        return attention_reference(query, cache, positions, scale, precision, dtype), cache
    return _sequence_sharded(query, new_latent, cache, positions, scale, precision, dtype)


def _sequence_sharded(query: jax.Array, new_latent: jax.Array, cache: jax.Array,
                      positions: jax.Array, scale: float, precision: jax.lax.Precision | None,
                      dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    ctx = sharding.active()
    seq_axes, head_axes = ctx.axes("cache_seq"), ctx.axes("heads")
    cache_spec = ctx.spec(("batch", "cache_seq", "kv_lora"))
    query_spec = ctx.spec(("batch", "heads", None))
    rows_spec = ctx.spec(("batch", None))

    # When heads split over the same devices as positions, each device keeps only its heads'
    # merged sums (a reduce-scatter); otherwise every device gets them all.
    scatter = bool(head_axes) and head_axes == seq_axes

    def body(query, new_latent, cache, positions):
        query = query.astype(dtype)  # as the reference scores it; half the bytes to gather
        if head_axes:  # every device scores every head against its own positions
            query = jax.lax.all_gather(query, head_axes, axis=1, tiled=True)
        local = cache.shape[1]
        offset = ctx.axis_index("cache_seq") * local
        mine = positions - offset
        owned = (mine >= 0) & (mine < local)
        cache = write_rows(cache, new_latent, jnp.where(owned, mine, local))
        latents = cache.astype(dtype)
        scores = jnp.einsum("bhc,bsc->bhs", query, latents, precision=precision,
                            preferred_element_type=FP32) * scale
        visible = (offset + jnp.arange(local))[None, :] <= positions[:, None]
        scores = jnp.where(visible[:, None], scores, -jnp.inf)
        return _merge(scores, latents, seq_axes, scatter, precision, dtype), cache

    return jax.shard_map(
        body, mesh=ctx.shard_map_mesh(),
        in_specs=(query_spec, rows_spec, cache_spec, ctx.spec(("batch",))),
        out_specs=(ctx.spec(("batch", "heads" if scatter else None, None)), cache_spec),
        check_vma=False,
    )(query, new_latent, cache, positions)


def _merge(scores: jax.Array, latents: jax.Array, seq_axes: tuple[str, ...], scatter: bool,
           precision: jax.lax.Precision | None, dtype: jnp.dtype) -> jax.Array:
    """Inside `shard_map`: this device's masked scores [B, ..., H, S] over its positions'
    `latents` [B, S, C], merged with every other device's into the softmax-weighted latent sum
    over all positions, [B, ..., H, C] (each device's own heads only when `scatter`). Weights
    are taken relative to the global maximum, so every device's partial sums share one scale
    and one sum of the partials and their normalisers combines them."""
    peak = jax.lax.pmax(jnp.max(scores, axis=-1), seq_axes)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0)[..., None])
    partial = jnp.einsum("b...s,bsc->b...c", weights.astype(dtype), latents,
                         precision=precision, preferred_element_type=FP32)
    sums = jnp.concatenate([partial, jnp.sum(weights, axis=-1, keepdims=True)], axis=-1)
    return _summed(sums, seq_axes, scatter)


def _summed(sums: jax.Array, seq_axes: tuple[str, ...], scatter: bool) -> jax.Array:
    """Every device's latent sums with their normaliser last, [B, ..., H, C + 1], all on one
    scale, summed over `seq_axes` (reduce-scattered over the heads when `scatter`) and
    normalised."""
    if scatter:
        merged = jax.lax.psum_scatter(sums, seq_axes, scatter_dimension=sums.ndim - 2,
                                      tiled=True)
    else:
        merged = jax.lax.psum(sums, seq_axes)
    total = merged[..., -1:]
    return merged[..., :-1] / jnp.where(total > 0, total, 1.0)


def _partial(scores: jax.Array, latents: jax.Array, precision: jax.lax.Precision | None,
             dtype: jnp.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """This device's softmax pieces over its positions: the per-query peak of `scores`
    [B, ..., H, S], and the latent sum [B, ..., H, C] and normaliser [B, ..., H, 1] weighted
    relative to it (`_combine` merges them)."""
    peak = jnp.max(scores, axis=-1)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0)[..., None])
    partial = jnp.einsum("b...s,bsc->b...c", weights.astype(dtype), latents,
                         precision=precision, preferred_element_type=FP32)
    return peak, partial, jnp.sum(weights, axis=-1, keepdims=True)


def _combine(peak: jax.Array, partial: jax.Array, total: jax.Array,
             seq_axes: tuple[str, ...], scatter: bool) -> jax.Array:
    """Inside `shard_map`: every device's `_partial` pieces rescaled to the global peak and
    summed (one `pmax`, one sum as in `_merge`) into the softmax-weighted latent sum."""
    top = jax.lax.pmax(peak, seq_axes)
    rescale = jnp.exp(jnp.where(jnp.isfinite(peak), peak - top, -jnp.inf))[..., None]
    sums = jnp.concatenate([partial, total], axis=-1) * rescale
    return _summed(sums, seq_axes, scatter)


# ---- the paged cache -------------------------------------------------------------------------
# A pool of pages [P, page_size, C] shared by every sequence; a sequence's position p lives at
# offset p % page_size of page `table[p // page_size]` (`inference/pages.py`). A step's rows each
# bring a window of W new tokens at positions [start, start + count): one decode token (W = 1),
# or a draft window to verify. Row padding (count < W, or a free row) writes into the null page 0,
# whose contents nothing reads as a real position.


def paged_positions(page_table: jax.Array, start: jax.Array, count: jax.Array, width: int,
                    page_size: int) -> tuple[jax.Array, jax.Array]:
    """(page, offset) [B, W] of each row's window positions start + w; the null page for the
    row's padding (w >= count)."""
    at = start[:, None] + jnp.arange(width)[None, :]
    index = jnp.minimum(at // page_size, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, index, axis=1)
    return jnp.where(jnp.arange(width)[None, :] < count[:, None], page, 0), at % page_size


def write_paged(pages: jax.Array, latent: jax.Array, page_table: jax.Array, start: jax.Array,
                count: jax.Array) -> jax.Array:
    """pages [P, S, C] with row b's window `latent[b, :count[b]]` ([B, W, C]) written at its
    positions start[b] + w through its table row `page_table[b]` ([B, max pages])."""
    page, offset = paged_positions(page_table, start, count, latent.shape[1], pages.shape[1])
    return pages.at[page, offset].set(to_cache_dtype(latent, pages.dtype))


def paged_attention_reference(query: jax.Array, pages: jax.Array, page_table: jax.Array,
                              start: jax.Array, scale: float,
                              precision: jax.lax.Precision | None, dtype: jnp.dtype,
                              ) -> jax.Array:
    """query [B, W, H, C] (row b's query w at position start[b] + w) over every position up to
    its own, read through the page table: each row's pages gathered into one contiguous cache
    [B, max pages x S, C], then `attention_reference`'s softmax. -> [B, W, H, C] fp32."""
    rows, width = query.shape[:2]
    cache = pages[page_table].reshape(rows, -1, pages.shape[-1])
    at = start[:, None] + jnp.arange(width)[None, :]
    latents = cache.astype(dtype)
    scores = jnp.einsum("bwhc,bsc->bwhs", query.astype(dtype), latents, precision=precision,
                        preferred_element_type=FP32) * scale
    visible = jnp.arange(cache.shape[1])[None, None, :] <= at[:, :, None]
    probs = jax.nn.softmax(jnp.where(visible[:, :, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bwhs,bsc->bwhc", probs.astype(dtype), latents, precision=precision,
                      preferred_element_type=FP32)


def live_table_widths(width: int) -> tuple[int, ...]:
    """The leading table widths a paged attention may read: powers of two below the table's
    `width`, then `width` itself (a few static shapes, so one program serves every length)."""
    return tuple(1 << i for i in range(max(width - 1, 0).bit_length()) if 1 << i < width) \
        + (width,)


def over_live_pages(attend: Callable[[jax.Array], Any], page_table: jax.Array,
                    limit: jax.Array, page_size: int) -> Any:
    """`attend(table)` on the fewest leading columns of `page_table` [B, max pages] (one of
    `live_table_widths`) that hold every row's positions below `limit` [B]. Exact: the columns
    left out hold no position any query may see. Gathering the whole table instead copies
    every row's longest possible context in each MLA layer of each step, where a slot cache is
    read in place; with it, a step reads about what its sequences hold. Every branch gives the
    same shapes (`attend` reduces over positions)."""
    widths = live_table_widths(page_table.shape[1])
    needed = -(-jnp.max(limit) // page_size)
    branch = jnp.searchsorted(jnp.asarray(widths), needed)
    return jax.lax.switch(branch, [lambda t, w=w: attend(t[:, :w]) for w in widths],
                          page_table)


def paged_decode_attention(query: jax.Array, new_latent: jax.Array, pages: jax.Array,
                           page_table: jax.Array, start: jax.Array, count: jax.Array,
                           scale: float, precision: jax.lax.Precision | None,
                           dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Write each row's window `new_latent` [B, W, C] (its first `count` tokens) into `pages`
    [P, S, C] through `page_table` [B, max pages] from `start` [B], then attend with `query`
    [B, W, H, C], each query over the positions up to its own (fp32 out, [B, W, H, C]): the
    reference's softmax over the table's live columns only (`over_live_pages`). Returns
    (output, pages). With the pages' offsets split over `cache_seq` (`implementation`), each
    device attends over its share of every page and the devices merge as `decode_attention`
    does."""
    if implementation() == "replicated":
        pages = write_paged(pages, new_latent, page_table, start, count)
        return over_live_pages(
            lambda table: paged_attention_reference(query, pages, table, start, scale,
                                                    precision, dtype),
            page_table, start + count, page_size=pages.shape[1]), pages
    return _paged_sequence_sharded(query, new_latent, pages, page_table, start, count, scale,
                                   precision, dtype)


def _paged_sequence_sharded(query: jax.Array, new_latent: jax.Array, pages: jax.Array,
                            page_table: jax.Array, start: jax.Array, count: jax.Array,
                            scale: float, precision: jax.lax.Precision | None,
                            dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    ctx = sharding.active()
    seq_axes, head_axes = ctx.axes("cache_seq"), ctx.axes("heads")
    pages_spec = ctx.spec((None, "cache_seq", "kv_lora"))
    rows_spec = ctx.spec(("batch", None))
    scatter = bool(head_axes) and head_axes == seq_axes
    page_size = pages.shape[1]
    width = query.shape[1]

    def body(query, new_latent, pages, page_table, start, count):
        query = query.astype(dtype)
        if head_axes:
            query = jax.lax.all_gather(query, head_axes, axis=2, tiled=True)
        local = pages.shape[1]  # this device's offsets of every page
        first = ctx.axis_index("cache_seq") * local
        page, offset = paged_positions(page_table, start, count, width, page_size)
        mine = offset - first
        owned = (mine >= 0) & (mine < local)
        # A window position another device owns is written nowhere here: past the page's end.
        pages = pages.at[page, jnp.where(owned, mine, local)].set(
            to_cache_dtype(new_latent, pages.dtype), mode="drop")
        at = start[:, None] + jnp.arange(width)[None, :]

        def attend(table):  # this device's partial softmax over the table's pages
            latents = pages[table].reshape(table.shape[0], -1, pages.shape[-1]).astype(dtype)
            key_at = (jnp.arange(table.shape[1])[:, None] * page_size + first
                      + jnp.arange(local)[None, :]).reshape(-1)
            scores = jnp.einsum("bwhc,bsc->bwhs", query, latents, precision=precision,
                                preferred_element_type=FP32) * scale
            visible = key_at[None, None, :] <= at[:, :, None]
            return _partial(jnp.where(visible[:, :, None], scores, -jnp.inf), latents,
                            precision, dtype)

        # The rows' lengths differ between devices of the batch axes, so each takes its own
        # branch: the collectives of the merge stay outside it.
        partial = over_live_pages(attend, page_table, start + count, page_size)
        return _combine(*partial, seq_axes, scatter), pages

    return jax.shard_map(
        body, mesh=ctx.shard_map_mesh(),
        in_specs=(ctx.spec(("batch", None, "heads", None)), ctx.spec(("batch", None, None)),
                  pages_spec, rows_spec, ctx.spec(("batch",)), ctx.spec(("batch",))),
        out_specs=(ctx.spec(("batch", None, "heads" if scatter else None, None)), pages_spec),
        check_vma=False,
    )(query, new_latent, pages, page_table, start, count)
