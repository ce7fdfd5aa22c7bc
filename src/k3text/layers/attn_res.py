"""Block Attention Residuals (K3): each sublayer reads a softmax mix over depth instead of the
plain residual stream.

The stream passed between layers is `prefix_sum`, the running sum of the current block; the
sums of completed blocks (the embedding first) sit in a fixed-size buffer with a count, so a scan
over layers can carry them. Block size counts layers; 0-indexed layer i opens a new block when
i % attn_res_block_size == 0. It follows the pseudocode of the K3 design notes
(`../shared/design/K3_MODEL.md`, §2.5).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3text.layers.normalizations import rms_normalize


class BlockStream(NamedTuple):
    """The AttnRes residual state carried between layers."""

    prefix_sum: jax.Array  # [..., D] running sum of the current block
    blocks: jax.Array  # [max_blocks, ..., D] completed block sums (the embedding first)
    count: jax.Array  # int32 scalar: how many entries of `blocks` are filled


def mix(prefix_sum: jax.Array, blocks: jax.Array, count: jax.Array, proj: jax.Array,
        norm: jax.Array, eps: float) -> jax.Array:
    """Σ_j softmax_j(score) V_j over V = [blocks[:count], prefix_sum], per token, in fp32.

    score_j = Σ_d rms_normalise(V_j)[d] · norm[d] · proj[d] (the norm gain folded into the
    query). With no completed block the result is prefix_sum itself (a one-way softmax).
    """
    sources = jnp.concatenate([blocks, prefix_sum[None]], axis=0).astype(jnp.float32)
    query = norm.astype(jnp.float32) * proj.astype(jnp.float32)
    scores = jnp.sum(rms_normalize(sources, eps) * query, axis=-1)
    n = blocks.shape[0]
    filled = (jnp.arange(n + 1) < count) | (jnp.arange(n + 1) == n)
    scores = jnp.where(filled.reshape(-1, *([1] * (scores.ndim - 1))), scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=0)
    return jnp.sum(weights[..., None] * sources, axis=0).astype(prefix_sum.dtype)


def start(embedding: jax.Array, max_blocks: int) -> BlockStream:
    """The stream before layer 0: the embedding as the running sum, no completed blocks."""
    blocks = jnp.zeros((max_blocks, *embedding.shape), embedding.dtype)
    return BlockStream(embedding, blocks, jnp.zeros((), jnp.int32))


def maybe_open_block(stream: BlockStream, layer_index: jax.Array | int, block_size: int,
                     ) -> BlockStream:
    """At a block boundary, store the running sum as a completed block and restart it at 0."""
    is_open = jnp.asarray(layer_index % block_size == 0)
    slot = jnp.minimum(stream.count, stream.blocks.shape[0] - 1)
    kept = jax.lax.dynamic_index_in_dim(stream.blocks, slot, keepdims=False)
    blocks = jax.lax.dynamic_update_index_in_dim(
        stream.blocks, jnp.where(is_open, stream.prefix_sum, kept), slot, axis=0)
    prefix = jnp.where(is_open, jnp.zeros_like(stream.prefix_sum), stream.prefix_sum)
    return BlockStream(prefix, blocks, stream.count + is_open.astype(jnp.int32))
