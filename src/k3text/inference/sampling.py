"""Token sampling with MaxText's strategies and keys.

`decode_sampling_strategy`: greedy | weighted (temperature) | topk | nucleus | composite
(top-k, then nucleus, then temperature). Log-probabilities of the chosen tokens are always taken
under the unmodified model distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3text.config import Config


def _top_k_mask(logits: jax.Array, k: int) -> jax.Array:
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits >= kth, logits, -jnp.inf)


def _nucleus_mask(logits: jax.Array, p: float) -> jax.Array:
    """Keep the smallest set of top tokens whose probability reaches p (ties at the edge kept)."""
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    cutoff_index = jnp.sum(before < p, axis=-1, keepdims=True) - 1
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def sample(cfg: Config, logits: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(tokens [B] int32, log-probabilities [B] fp32 of those tokens under `logits`)."""
    logits = logits.astype(jnp.float32)
    strategy = cfg.decode_sampling_strategy
    if strategy == "greedy":
        tokens = jnp.argmax(logits, axis=-1)
    else:
        shaped = logits
        if strategy in ("topk", "composite"):
            shaped = _top_k_mask(shaped, cfg.decode_sampling_top_k)
        if strategy in ("nucleus", "composite"):
            shaped = _nucleus_mask(shaped, cfg.decode_sampling_nucleus_p)
        tokens = jax.random.categorical(key, shaped / cfg.decode_sampling_temperature, axis=-1)
    tokens = tokens.astype(jnp.int32)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None],
                                   axis=-1)[:, 0]
    return tokens, logprobs
