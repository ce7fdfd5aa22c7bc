"""Token sampling with per-slot parameters, inside the compiled step.

Every slot of a batch carries its own temperature, top-k, top-p and seed (`SlotSampling`), so
a greedy request and a sampled one share a decode step and each gets its own. Temperature 0
(below 1e-5) is greedy. Otherwise the logits are divided by the temperature, cut to the tokens at
least `min_p` times as likely as the likeliest, then to the top k (0: no cut) and then to the
smallest set of top tokens whose probability reaches p (ties at either edge kept), as vLLM and
the OpenAI API define them. A slot's n-th token is drawn with
`fold_in(key(seed), n)`: with a fixed seed a request's tokens do not depend on the slot it sits
in or on what else is in the batch.

Before any of that, in vLLM's order: a slot's `logit_bias` is added to its logits; while it has
produced fewer than its `min_tokens` tokens its stop ids (eos and the request's stop token ids)
cannot be drawn; then the penalties: a token seen in the prompt or the output so far has its
logit divided by `repetition_penalty` where positive and multiplied by it where negative
(Hugging Face's and vLLM's rule), and a token of the output loses `frequency_penalty` times its
count and `presence_penalty` once (OpenAI's). All of these steer greedy and sampled choices
alike. Log-probabilities (of the chosen token and
of the top-N) are always under the unmodified model distribution (vLLM's raw log-probabilities).

`sample(cfg, logits, key)` maps the offline `decode_sampling_*` keys onto the same function.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3text import sharding
from k3text.config import Config

MAX_LOGIT_BIAS = 300  # logit_bias entries per slot (OpenAI's limit); a fixed width, one program


class SlotSampling(NamedTuple):
    """Sampling parameters of B slots (device or host arrays, leading axis B)."""

    temperature: jax.Array  # [B] float32; 0 = greedy
    top_k: jax.Array  # [B] int32; 0 = the whole vocabulary
    top_p: jax.Array  # [B] float32 in (0, 1]
    seed: jax.Array  # [B, 2] uint32: the request seed's low and high 32 bits
    min_tokens: jax.Array  # [B] int32: the slot's stop ids are banned for its first tokens
    bias_ids: jax.Array  # [B, MAX_LOGIT_BIAS] int32: logit_bias's token ids, -1 = unused
    bias: jax.Array  # [B, MAX_LOGIT_BIAS] float32: added to those tokens' logits
    min_p: jax.Array  # [B] float32 in [0, 1]; 0 = no cut
    presence_penalty: jax.Array  # [B] float32; 0 = off
    frequency_penalty: jax.Array  # [B] float32; 0 = off
    repetition_penalty: jax.Array  # [B] float32 > 0; 1 = off
    prompt_bits: jax.Array  # [B, ceil(vocab / 8)] uint8: the prompt's tokens, a bit each


# The logical axes of `SlotSampling`'s arrays, and their shapes for B rows.
SAMPLING_AXES = SlotSampling(("batch",), ("batch",), ("batch",), ("batch", None), ("batch",),
                             ("batch", None), ("batch", None), ("batch",), ("batch",),
                             ("batch",), ("batch",), ("batch", None))


def sampling_shapes(rows: int, vocab: int) -> SlotSampling:
    """ShapeDtypeStructs of `SlotSampling` for `rows` rows over a `vocab`-token vocabulary."""
    shape = lambda dtype, *tail: jax.ShapeDtypeStruct((rows, *tail), dtype)  # noqa: E731
    return SlotSampling(shape(jnp.float32), shape(jnp.int32), shape(jnp.float32),
                        shape(jnp.uint32, 2), shape(jnp.int32),
                        shape(jnp.int32, MAX_LOGIT_BIAS), shape(jnp.float32, MAX_LOGIT_BIAS),
                        shape(jnp.float32), shape(jnp.float32), shape(jnp.float32),
                        shape(jnp.float32), shape(jnp.uint8, -(-vocab // 8)))


class History(NamedTuple):
    """What the penalties read, for B rows."""

    counts: jax.Array  # [B, vocab] int32: each token's count in the output so far
    in_prompt: jax.Array  # [B, vocab] bool: the prompt's tokens (`prompt_tokens`)


def prompt_tokens(params: SlotSampling, vocab: int) -> jax.Array:
    """[B, vocab] bool: the rows' prompt tokens, unpacked from `prompt_bits`. They do not change
    while a row decodes: a decode loop unpacks them once, before its first step."""
    return jnp.unpackbits(params.prompt_bits, axis=-1, count=vocab, bitorder="little") > 0


class SamplingRow(NamedTuple):
    """One row's sampling parameters, as the host gives them."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), distinct ids
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt: tuple[int, ...] = ()  # the prompt's ids (what the repetition penalty counts as seen)


def seed_words(seed: int) -> tuple[int, int]:
    """A 64-bit seed (negative ones wrap) as the (low, high) uint32 pair `SlotSampling` holds."""
    seed %= 2**64
    return seed & 0xFFFFFFFF, seed >> 32


def host_sampling(rows: list[tuple], vocab: int) -> SlotSampling:
    """`SlotSampling` host arrays from a `SamplingRow` (or a tuple of its fields) per row."""
    rows = [SamplingRow(*r) for r in rows]
    seen = np.zeros((len(rows), vocab), bool)
    bias_ids = np.full((len(rows), MAX_LOGIT_BIAS), -1, np.int32)
    bias = np.zeros((len(rows), MAX_LOGIT_BIAS), np.float32)
    for i, r in enumerate(rows):
        seen[i, list(r.prompt)] = True
        if len(r.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds {len(r.logit_bias)} entries, more than "
                             f"{MAX_LOGIT_BIAS}")
        for j, (token, value) in enumerate(r.logit_bias):
            bias_ids[i, j], bias[i, j] = token, value
    return SlotSampling(
        temperature=np.asarray([r.temperature for r in rows], np.float32),
        top_k=np.asarray([r.top_k for r in rows], np.int32),
        top_p=np.asarray([r.top_p for r in rows], np.float32),
        seed=np.asarray([seed_words(r.seed) for r in rows], np.uint32).reshape(len(rows), 2),
        min_tokens=np.asarray([r.min_tokens for r in rows], np.int32),
        bias_ids=bias_ids, bias=bias, min_p=np.asarray([r.min_p for r in rows], np.float32),
        presence_penalty=np.asarray([r.presence_penalty for r in rows], np.float32),
        frequency_penalty=np.asarray([r.frequency_penalty for r in rows], np.float32),
        repetition_penalty=np.asarray([r.repetition_penalty for r in rows], np.float32),
        prompt_bits=np.packbits(seen, axis=-1, bitorder="little"))


def config_sampling(cfg: Config, batch: int, seeds: list[int] | None = None) -> SlotSampling:
    """The offline keys (`decode_sampling_strategy` and its parameters) for `batch` rows; row i
    is seeded with `seeds[i]` (default `cfg.seed + i`)."""
    strategy = cfg.decode_sampling_strategy
    temperature = 0.0 if strategy == "greedy" else cfg.decode_sampling_temperature
    top_k = cfg.decode_sampling_top_k if strategy in ("topk", "composite") else 0
    top_p = cfg.decode_sampling_nucleus_p if strategy in ("nucleus", "composite") else 1.0
    seeds = [cfg.seed + i for i in range(batch)] if seeds is None else seeds
    return host_sampling([(temperature, top_k, top_p, s) for s in seeds], cfg.vocab_size)


def _truncated(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Logits outside each row's top-k and then its nucleus set to -inf. The vocabulary is
    sorted only when some row cuts: a whole-vocabulary sort per slot is a large part of a
    decode step's sampling, and plain temperature sampling needs none."""
    vocab = scaled.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    cuts = (k < vocab) | (top_p < 1.0)

    def cut() -> jax.Array:
        ordered = -jnp.sort(-scaled, axis=-1)  # descending
        in_top_k = jnp.arange(vocab) < k[:, None]
        probs = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
        # top_p = 1 keeps the whole top k, even tokens whose mass above rounds to 1.
        in_nucleus = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        keep = jnp.sum(in_nucleus & in_top_k, axis=-1)
        cutoff = jnp.take_along_axis(ordered, jnp.maximum(keep, 1)[:, None] - 1, axis=-1)
        return jnp.where(cuts[:, None] & (scaled < cutoff), -jnp.inf, scaled)

    return jax.lax.cond(jnp.any(cuts), cut, lambda: scaled)


def _draw(logits: jax.Array, params: SlotSampling, index: jax.Array) -> jax.Array:
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    # min_p first, as vLLM orders them: p >= min_p * p_max, in logits (log 0 = -inf: no cut).
    floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(params.min_p)[:, None]
    shaped = _truncated(jnp.where(scaled < floor, -jnp.inf, scaled), params.top_k, params.top_p)

    def one(seed: jax.Array, n: jax.Array, row: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
        return jax.random.categorical(jax.random.fold_in(key, n), row)

    return jax.vmap(one)(params.seed, index, shaped)


def _adjusted(logits: jax.Array, params: SlotSampling, index: jax.Array,
              stop_ids: jax.Array | None, history: History | None) -> jax.Array:
    """`logits` with each row's `logit_bias` added; while a row's token number `index` is
    below its `min_tokens`, its `stop_ids` (-1: unused) at -inf; then, given the rows'
    `history`, the penalties. Always run: a branch on whether any row asks
    would cost a reduction over the batch (a collective where the batch is split), and the
    work is a few hundred scattered entries and a few elementwise passes per row."""
    vocab = logits.shape[-1]
    # Unused entries point past the vocabulary, where the scatters drop them.
    add = jax.vmap(lambda row, ids, values: row.at[ids].add(values, mode="drop"))
    logits = add(logits, jnp.where(params.bias_ids < 0, vocab, params.bias_ids), params.bias)
    if stop_ids is not None:
        early = index < params.min_tokens
        ban = jax.vmap(lambda row, ids: row.at[ids].set(-jnp.inf, mode="drop"))
        logits = ban(logits, jnp.where((stop_ids < 0) | ~early[:, None], vocab, stop_ids))
    if history is None:
        return logits
    counts = history.counts
    seen = history.in_prompt | (counts > 0)
    repetition = jnp.where(seen, params.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / repetition, logits * repetition)
    return (logits - params.frequency_penalty[:, None] * counts
            - params.presence_penalty[:, None] * (counts > 0))


def sample_slots(logits: jax.Array, params: SlotSampling, index: jax.Array, top_n: int = 0,
                 stop_ids: jax.Array | None = None, history: History | None = None,
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Sample one token per row of logits [B, vocab]; `index` [B] is each row's token number,
    `stop_ids` [B, n] its stop ids (what `min_tokens` bans; None: nothing banned), `history`
    its output and prompt tokens (what the penalties read; None: no penalties).

    Returns (tokens [B] int32, their log-probabilities [B], top-N token ids [B, top_n] int32,
    top-N log-probabilities [B, top_n]). Batches with no sampled row skip the sort."""
    # Whole on every device, gathered as the vocab-split LM head leaves them (one all-gather
    # of logits, never of the head's weight): the sort, argmax, softmax and top-N below then
    # run locally instead of as a collective per reduction.
    logits = sharding.gather_features([logits.astype(jnp.float32)], ["vocab"])[0]
    shaped = _adjusted(logits, params, index, stop_ids, history)
    greedy = jnp.argmax(shaped, axis=-1).astype(jnp.int32)
    # Below this a temperature only overflows the scaled logits: greedy, as vLLM treats it.
    sampled = params.temperature >= 1e-5
    tokens = jax.lax.cond(
        jnp.any(sampled),
        lambda: jnp.where(sampled, _draw(shaped, params, index).astype(jnp.int32), greedy),
        lambda: greedy)
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    if top_n:
        top_lps, top_ids = jax.lax.top_k(logp, top_n)
    else:
        top_lps = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return tokens, chosen, top_ids.astype(jnp.int32), top_lps


class PromptScores(NamedTuple):
    """Each position's distribution over the next token, scored against the token that
    follows it (vLLM's `prompt_logprobs`): leading axes [P, C]."""

    logprobs: jax.Array  # float32: log-probability of the next token
    ranks: jax.Array  # int32: its rank, 1 for the likeliest
    top_ids: jax.Array  # [..., top_n] int32
    top_logprobs: jax.Array  # [..., top_n]


def score_next(logits: jax.Array, targets: jax.Array, top_n: int) -> PromptScores:
    """Logits [P, C, vocab] scored against the tokens that follow each position, `targets`
    [P, C]: the log-probabilities of the raw model, as `sample_slots` reports a drawn token's.

    Unlike a decode step's [slots, vocab], a chunk's logits are too large to gather whole on
    every device (4,096 positions of K3's vocabulary: 2.7 GB), so they stay split as the LM
    head leaves them: the normaliser, the target's value and its rank are reductions over the
    vocabulary ([P, C] per device crosses), and the top N comes from each shard's own."""
    logits = sharding.constrain_features(logits.astype(jnp.float32), "vocab")
    logp = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    vocab = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    chosen = jnp.sum(jnp.where(vocab == targets[..., None], logp, 0.0), axis=-1)
    ranks = 1 + jnp.sum(logp > chosen[..., None], axis=-1, dtype=jnp.int32)
    top_lps, top_ids = sharding.top_k_features(logp, top_n, "vocab")
    return PromptScores(chosen, ranks, top_ids.astype(jnp.int32), top_lps)


def sample(cfg: Config, logits: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(tokens [B] int32, log-probabilities [B]) with the offline `decode_sampling_*` keys; the
    key's bits seed the rows (row i: that seed + i)."""
    batch = logits.shape[0]
    base = config_sampling(cfg, batch, seeds=[0] * batch)
    seed = jax.random.key_data(key).reshape(-1)[-1].astype(jnp.uint32)
    seeds = jnp.stack([seed + jnp.arange(batch, dtype=jnp.uint32),
                       jnp.zeros(batch, jnp.uint32)], axis=1)
    tokens, chosen, _, _ = sample_slots(logits, base._replace(seed=seeds),
                                        jnp.zeros(batch, jnp.int32))
    return tokens, chosen
