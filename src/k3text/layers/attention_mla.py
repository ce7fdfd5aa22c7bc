"""MLA (multi-head latent attention), NoPE, with K3's optional q-LoRA and sigmoid output gate.

Per token the layer caches only the latent `c_kv || k_r` (kv_lora_rank + qk_rope_head_dim wide;
576 for K3). Three attention forms share the projections:
- `__call__`: a whole sequence, or a prefill chunk written into and read back from the cache;
  keys and values are materialised from the latent with `k_b_proj` / `v_b_proj` (cheap per
  query when many queries share the keys);
- `step`: decode, absorbed: `k_b_proj` is folded into the query (q_nope -> latent space) and
  `v_b_proj` into the output (latent -> v), so attention runs directly over the cached latents
  (`ops/mla.py`, which also splits it by sequence when the cache is split so);
- `step_materialised`: decode by materialising K/V from the cache: the reference `step` is
  tested against;
- `paged_chunk` / `paged_step`: `__call__` / `step` over a paged cache (a page pool shared by
  every sequence, read through page tables), `paged_step` taking a window of tokens per row.
There is no positional encoding anywhere (`mla_use_nope`): the 64-wide `k_r` is a shared key
tail broadcast to every head, never rotated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from k3text import sharding
from k3text.config import Config
from k3text.layers.initializers import FP32, Init, compute_dtype, weight_dtype
from k3text.layers.initializers import precision as precision_of
from k3text.layers.linears import matmul
from k3text.layers.normalizations import rms_norm
from k3text.ops import mla as mla_ops

# The two latent norms use eps 1e-6 whatever rms_norm_eps says (as the reference does).
LATENT_NORM_EPS = 1e-6


class MLAAttention(nnx.Module):
    def __init__(self, cfg: Config, init: Init):
        self.cfg = cfg
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        wdt = weight_dtype(cfg)
        if cfg.q_lora_rank:
            self.q_a_proj = init.fan_in((hidden, cfg.q_lora_rank), ("lora_in", "q_lora"),
                                         wdt)
            self.q_a_layernorm = init.constant((cfg.q_lora_rank,), ("q_lora",), wdt)
            self.q_b_proj = init.fan_in((cfg.q_lora_rank, heads * qk_dim),
                                         ("q_lora", "heads"), wdt)
        else:
            self.q_proj = init.fan_in((hidden, heads * qk_dim), ("embed", "heads"), wdt)
        self.kv_a_proj = init.fan_in((hidden, cfg.mla_latent_dim), ("lora_in", "kv_lora"),
                                      wdt)
        self.kv_a_layernorm = init.constant((cfg.kv_lora_rank,), ("kv_lora",), wdt)
        # The checkpoint's kv_b_proj, per head the latent -> k_nope and latent -> v maps, kept
        # as two head-major kernels [H, kv_lora, nope] and [H, kv_lora, v]: the absorbed decode
        # multiplies each head's query and output by them directly. Stored together, every
        # step would slice (and XLA:CPU copy) both halves and transpose them to heads-first.
        for name, width in (("k_b_proj", cfg.qk_nope_head_dim), ("v_b_proj", cfg.v_head_dim)):
            setattr(self, name, init.fan_in((heads, cfg.kv_lora_rank, width),
                                            ("heads", "kv_lora", None), wdt,
                                            fan_in=cfg.kv_lora_rank))
        if cfg.mla_use_output_gate:
            self.g_proj = init.fan_in((hidden, heads * cfg.v_head_dim), ("embed", "heads"),
                                       wdt)
        self.o_proj = init.fan_in((heads * cfg.v_head_dim, hidden), ("heads", "embed"),
                                   wdt)
        self.scale = qk_dim**-0.5

    # ---- projections ----------------------------------------------------------------------

    def _query(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(q_nope [..., H, nope], q_rope [..., H, rope])."""
        cfg = self.cfg
        if cfg.q_lora_rank:
            c_q = rms_norm(matmul(cfg, x, self.q_a_proj[...]), self.q_a_layernorm[...],
                           LATENT_NORM_EPS)
            q = matmul(cfg, c_q, self.q_b_proj[...])
        else:
            q = matmul(cfg, x, self.q_proj[...])
        q = q.reshape(*q.shape[:-1], cfg.num_attention_heads, -1)
        return q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]

    def latent(self, x: jax.Array) -> jax.Array:
        """The cached per-token latent: norm(c_kv) || k_r, [..., kv_lora + rope]."""
        cfg = self.cfg
        kv = matmul(cfg, x, self.kv_a_proj[...])
        c_kv = rms_norm(kv[..., : cfg.kv_lora_rank], self.kv_a_layernorm[...], LATENT_NORM_EPS)
        return jnp.concatenate([c_kv, kv[..., cfg.kv_lora_rank :]], axis=-1)

    def _keys_values(self, latent: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Materialise per-head keys [..., S, H, nope+rope] and values [..., S, H, v]."""
        cfg = self.cfg
        dtype = compute_dtype(cfg)
        c_kv, k_rope = latent[..., : cfg.kv_lora_rank], latent[..., cfg.kv_lora_rank :]
        k_nope, v = (jnp.einsum("...c,hcd->...hd", c_kv.astype(dtype), w[...].astype(dtype),
                                precision=precision_of(cfg))
                     for w in (self.k_b_proj, self.v_b_proj))
        k_rope = jnp.broadcast_to(k_rope[..., None, :].astype(dtype),
                                  (*k_nope.shape[:-1], cfg.qk_rope_head_dim))
        return jnp.concatenate([k_nope, k_rope], axis=-1), v

    def _output(self, x: jax.Array, o: jax.Array) -> jax.Array:
        """o [..., H, v] -> gate -> o_proj -> [..., hidden]."""
        cfg = self.cfg
        o = o.reshape(*o.shape[:-2], -1).astype(compute_dtype(cfg))
        if cfg.mla_use_output_gate:
            gate = matmul(cfg, x, self.g_proj[...])
            o = (o.astype(FP32) * jax.nn.sigmoid(gate.astype(FP32))).astype(o.dtype)
        return matmul(cfg, o, self.o_proj[...])

    def _attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        """Softmax attention, q [B,T,H,D], k [B,S,H,D], v [B,S,H,V], mask [B,T,S] -> [B,T,H,V]."""
        prec = precision_of(self.cfg)
        scores = jnp.einsum("bthd,bshd->bhts", q, k, precision=prec,
                            preferred_element_type=FP32) * self.scale
        scores = jnp.where(mask[:, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("bhts,bshv->bthv", probs.astype(v.dtype), v, precision=prec,
                          preferred_element_type=FP32)

    # ---- entry points ---------------------------------------------------------------------

    def __call__(self, x: jax.Array, cache: jax.Array | None = None,
                 start: jax.Array | int = 0, valid: jax.Array | None = None,
                 slices: bool = False) -> tuple[jax.Array, jax.Array | None]:
        """x [B, T, hidden] -> (y, updated cache).

        Without a cache: causal attention within x. With a cache [B, S, latent] the chunk's
        latents are written at positions [start, start + T) and the chunk attends to every
        cached position up to itself (earlier chunks included), read back in the cache dtype.
        Keys are visited in blocks with an online softmax, so temporaries scale with
        T x `mla_key_block`, never with T x S.

        `slices` (with a cache, the same in every row): the rows are consecutive slices of one
        sequence, row r at positions [start + r T, start + (r + 1) T) (a context-parallel
        prefill). Every row's latents are gathered to every row (576 values per token for K3),
        written into each row's cache (positions past its end are dropped), and each row's
        queries attend over all of them up to their own positions.
        """
        batch, length = x.shape[:2]
        q_nope, q_rope = self._query(x)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        latent = self.latent(x)
        n_valid = (jnp.full((batch,), length, jnp.int32) if valid is None
                   else jnp.sum(valid, axis=1, dtype=jnp.int32))
        # Keys that hold real tokens end at start + n_valid (padding sits after each row's
        # tokens); causality masks the rest.
        limit = start + n_valid
        span = length  # the positions this call writes, from start
        q_pos = start + jnp.arange(length)[None, :]
        if slices:
            span = batch * length
            q_pos = start + jnp.arange(span).reshape(batch, length)
            limit = jnp.broadcast_to(start + jnp.sum(n_valid), (batch,))
        if cache is None:
            block = min(self.cfg.mla_key_block, length)
            keys_from = jnp.pad(latent, ((0, 0), (0, -length % block), (0, 0)))
            blocks = keys_from.shape[1] // block
        else:
            split = mla_ops.implementation() == "sequence_sharded"
            if split:
                # The chunk attends to every earlier position: the split cache is gathered once
                # per layer and chunk, and each device keeps only its own positions afterwards
                # (the chunk's rows land on their owners).
                cache = sharding.constrain(cache, ("batch", None, "kv_lora"))
            if slices:
                rows = sharding.constrain(latent.reshape(1, span, -1), (None, None, "kv_lora"))
                cache = cache.at[:, start + jnp.arange(span)].set(
                    mla_ops.to_cache_dtype(jnp.broadcast_to(rows, (batch, *rows.shape[1:])),
                                           cache.dtype),
                    mode="drop")
            else:
                cache = jax.lax.dynamic_update_slice(
                    cache, mla_ops.to_cache_dtype(latent, cache.dtype), (0, start, 0))
            keys_from = cache
            if split:  # pinned on both sides, or the partitioner gathers the cache a second time
                keys_from = sharding.constrain(cache, ("batch", None, "kv_lora"))
                cache = sharding.constrain(cache, ("batch", "cache_seq", "kv_lora"))
            block = math.gcd(cache.shape[1], self.cfg.mla_key_block)
            # Only blocks up to the end of this call's positions can hold visible keys.
            blocks = jnp.minimum((start + span + block - 1) // block, cache.shape[1] // block)
        o = self._attend_blocked(q, keys_from, q_pos, limit, block, blocks)
        return self._output(x, o), cache

    def _attend_blocked(self, q: jax.Array, keys_from: jax.Array | Callable[[Any], jax.Array],
                        q_pos: jax.Array, limit: jax.Array, block: int,
                        blocks: jax.Array | int) -> jax.Array:
        """Causal softmax attention of q [B,T,H,D] over the latents keys_from [B,S,latent] (or
        a function giving block j's [B, block, latent]: a paged cache's pages),
        `block` keys at a time with a running max and sum (flash-attention style).

        Keys are materialised from the latent one block at a time; key p is visible to the query
        at position q_pos[b, t] ([B or 1, T]) when p <= q_pos[b, t] and p < limit[b]. Returns
        [B, T, H, v] in fp32.
        """
        batch, length, heads, _ = q.shape
        prec = precision_of(self.cfg)
        if callable(keys_from):
            block_at = keys_from
        else:
            def block_at(j):
                return jax.lax.dynamic_slice_in_dim(keys_from, j * block, block, axis=1)

        def step(j, carry):
            peak, total, acc = carry
            latent = block_at(j)
            k, v = self._keys_values(latent)
            k = sharding.constrain(k, ("batch", None, "heads", None))
            scores = jnp.einsum("bthd,bshd->bhts", q, k, precision=prec,
                                preferred_element_type=FP32) * self.scale
            k_pos = j * block + jnp.arange(block)
            visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
                k_pos[None, None, :] < limit[:, None, None])
            scores = jnp.where(visible[:, None], scores, -jnp.inf)
            new_peak = jnp.maximum(peak, jnp.max(scores, axis=-1))
            safe = jnp.where(jnp.isfinite(new_peak), new_peak, 0.0)
            probs = jnp.exp(scores - safe[..., None])
            rescale = jnp.exp(peak - safe)
            total = total * rescale + jnp.sum(probs, axis=-1)
            acc = acc * jnp.swapaxes(rescale, 1, 2)[..., None] + jnp.einsum(
                "bhts,bshv->bthv", probs.astype(v.dtype), v, precision=prec,
                preferred_element_type=FP32)
            return new_peak, total, acc

        init = (jnp.full((batch, heads, length), -jnp.inf, FP32),
                jnp.zeros((batch, heads, length), FP32),
                jnp.zeros((batch, length, heads, self.cfg.v_head_dim), FP32))
        _, total, acc = jax.lax.fori_loop(0, blocks, step, init)
        total = jnp.swapaxes(total, 1, 2)[..., None]
        return jnp.where(total > 0, acc / jnp.where(total > 0, total, 1.0), 0.0)

    def paged_chunk(self, x: jax.Array, pages: jax.Array, table: jax.Array, start: jax.Array,
                    count: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Rows of a step over the paged cache: x [B, T, hidden], row b one sequence's tokens
        at positions [start[b], start[b] + count[b]) (padding after them), its pages
        `table[b]`. The rows' latents are written into `pages` [P, page_size, latent] and each
        query attends over its sequence's pages up to its own position, one page at a time
        (keys materialised per page, as `__call__` does per block). -> (y, pages)."""
        length = x.shape[1]
        q_nope, q_rope = self._query(x)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        pages = mla_ops.write_paged(pages, self.latent(x), table, start, count)
        page_size = pages.shape[1]
        limit = start + count
        blocks = jnp.max(-(-limit // page_size))
        o = self._attend_blocked(q, lambda j: pages[table[:, j]],
                                 start[:, None] + jnp.arange(length)[None, :], limit, page_size,
                                 jnp.minimum(blocks, table.shape[1]))
        return self._output(x, o), pages

    def paged_step(self, x: jax.Array, pages: jax.Array, table: jax.Array, start: jax.Array,
                   count: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Absorbed decode over the paged cache, a window of W tokens per row: x [B, W, hidden]
        at positions start[b] + w, the first count[b] real (`ops.mla.paged_decode_attention`).
        One decode token per sequence is W = 1; a draft window to verify is W = k + 1.
        -> (y [B, W, hidden], pages)."""
        cfg = self.cfg
        prec = precision_of(cfg)
        dtype = compute_dtype(cfg)
        q_nope, q_rope = self._query(x)
        query = jnp.concatenate([self._absorbed_query(q_nope), q_rope.astype(FP32)], axis=-1)
        o_latent, pages = mla_ops.paged_decode_attention(query, self.latent(x), pages, table,
                                                         start, count, self.scale, prec, dtype)
        o = jnp.einsum("...hc,hcv->...hv", o_latent[..., : cfg.kv_lora_rank].astype(dtype),
                       self.v_b_proj[...].astype(dtype), precision=prec,
                       preferred_element_type=FP32)
        return self._output(x, o), pages

    def _absorbed_query(self, q_nope: jax.Array) -> jax.Array:
        """q_nope [..., H, nope] -> latent-space query [..., H, kv_lora] through k_b_proj."""
        return jnp.einsum("...hn,hcn->...hc", q_nope, self.k_b_proj[...].astype(q_nope.dtype),
                          precision=precision_of(self.cfg), preferred_element_type=FP32)

    def step(self, x: jax.Array, cache: jax.Array, positions: jax.Array,
             ) -> tuple[jax.Array, jax.Array]:
        """Absorbed decode: x [B, hidden] at `positions` [B] -> (y [B, hidden], cache)."""
        cfg = self.cfg
        prec = precision_of(cfg)
        dtype = compute_dtype(cfg)
        q_nope, q_rope = self._query(x)
        # Each head's query against whole cached rows c_kv || k_r: q_latent . c_kv + q_rope . k_r
        # in one matmul, and the value sum over whole rows with the k_r columns dropped after;
        # slicing c_kv out of the cache would copy it every step.
        query = jnp.concatenate([self._absorbed_query(q_nope), q_rope.astype(FP32)], axis=-1)
        o_latent, cache = mla_ops.decode_attention(query, self.latent(x), cache, positions,
                                                   self.scale, prec, dtype)
        o_latent = o_latent[..., : cfg.kv_lora_rank]
        o = jnp.einsum("bhc,hcv->bhv", o_latent.astype(dtype), self.v_b_proj[...].astype(dtype),
                       precision=prec, preferred_element_type=FP32)
        return self._output(x, o), cache

    def step_materialised(self, x: jax.Array, cache: jax.Array, positions: jax.Array,
                          ) -> tuple[jax.Array, jax.Array]:
        """Reference decode: materialise K/V for every cached position, then attend."""
        cache = mla_ops.write_rows(cache, self.latent(x), positions)
        q_nope, q_rope = self._query(x)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)[:, None]
        k, v = self._keys_values(cache)
        mask = (jnp.arange(cache.shape[1])[None, :] <= positions[:, None])[:, None, :]
        o = self._attend(q, k, v, mask)[:, 0]
        return self._output(x, o), cache
