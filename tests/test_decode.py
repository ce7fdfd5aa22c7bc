"""Inference engine: prefill + decode against the full-sequence forward, ragged batches, the
absorbed MLA and single-step KDA paths, and the on-device decode loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3text.config import ConfigError
from k3text.inference import weights
from k3text.inference.engine import generate_program
from k3text.layers.attention_kda import KDAAttention, KDAState
from k3text.layers.attention_mla import MLAAttention
from k3text.layers.initializers import Init
from k3text.models.decoder import Decoder
from k3text.models.state import zeros

from helpers import assert_same_greedy, engine_for, tiny_config

LENGTHS = (63, 64, 65, 129)


@pytest.fixture(scope="module", params=["k3-tiny", "kimi-linear-tiny"])
def setup(request):
    cfg = tiny_config(request.param, "max_prefill_predict_length=192", "max_target_length=256",
                      "prefill_chunk_size=64", "max_decode_steps=6", "ignore_eos=true")
    model = Decoder(cfg, Init(7))
    return cfg, model, engine_for(cfg, model)


def test_prefill_then_decode_matches_full_forward(setup):
    cfg, model, engine = setup
    rng = np.random.default_rng(0)
    steps = 3
    tokens = rng.integers(3, cfg.vocab_size, max(LENGTHS) + steps)
    full = np.asarray(nnx.jit(lambda m, t: m.forward(t))(model, jnp.asarray(tokens[None])))[0]
    scale = np.abs(full).max()
    logits, state = engine.prefill([tokens[:n] for n in LENGTHS])
    for row, n in enumerate(LENGTHS):
        np.testing.assert_allclose(logits[row], full[n - 1], atol=2e-4 * scale,
                                   err_msg=f"prefill, prompt length {n}")
    key = jax.random.key(0)
    for j in range(steps):
        feed = jnp.asarray([tokens[n + j] for n in LENGTHS], jnp.int32)
        _, _, logits, state = engine.step(feed, state, key)
        for row, n in enumerate(LENGTHS):
            np.testing.assert_allclose(logits[row], full[n + j], atol=2e-4 * scale,
                                       err_msg=f"decode step {j}, prompt length {n}")


def test_scored_prefill_matches_the_full_forward(setup):
    """`Engine.prefill_scored` (vLLM's `prompt_logprobs`): each position's log-probability of
    the token after it, its rank and the top 3 equal the full forward's, in float64, across
    chunk boundaries in a ragged batch; the prefix it leaves is `prefill_chunk`'s."""
    cfg, model, engine = setup
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, cfg.vocab_size, n) for n in (130, 20)]
    chunk = cfg.prefill_chunk_size
    width = 3 * chunk
    tokens = np.full((2, width), cfg.pad_token_id, np.int32)
    valid, targets = np.zeros(tokens.shape, bool), np.zeros(tokens.shape, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)], valid[i, : len(p)], targets[i, : len(p) - 1] = p, True, p[1:]
    scored, plain, scores = engine.new_prefix(2), engine.new_prefix(2), []
    for start in range(0, width, chunk):
        part = slice(start, start + chunk)
        scored, got = engine.prefill_scored(scored, tokens[:, part], valid[:, part], start,
                                            targets[:, part], 3)
        plain = engine.prefill_chunk(plain, tokens[:, part], valid[:, part], start)
        scores.append(got)
    logprobs, ranks, top_ids, top_lps = (np.concatenate(a, axis=1)
                                         for a in zip(*scores, strict=True))
    for i, p in enumerate(prompts):
        n = len(p) - 1
        full = np.asarray(nnx.jit(lambda m, t: m.forward(t))(model, jnp.asarray(p[None])))[0]
        full = full.astype(np.float64)[:n]
        ref = full - np.logaddexp.reduce(full, axis=-1, keepdims=True)
        chosen = ref[np.arange(n), p[1:]]
        np.testing.assert_allclose(logprobs[i, :n], chosen, atol=1e-4, err_msg=f"prompt {i}")
        # Ranks and top ids wherever no other logit lies within rounding of the one compared.
        gap = np.min(np.abs(ref - chosen[:, None]) + (np.arange(ref.shape[1]) == p[1:, None]),
                     axis=1)
        clear = gap > 1e-3
        assert clear.mean() > 0.5  # the check has teeth
        np.testing.assert_array_equal(ranks[i, :n][clear],
                                      1 + np.sum(ref > chosen[:, None], axis=1)[clear])
        order = np.argsort(-ref, axis=1)[:, :4]
        np.testing.assert_allclose(top_lps[i, :n], np.take_along_axis(ref, order[:, :3], 1),
                                   atol=1e-4)
        ordered = np.take_along_axis(ref, order, 1)
        distinct = np.all(-np.diff(ordered, axis=1) > 1e-3, axis=1)
        np.testing.assert_array_equal(top_ids[i, :n][distinct], order[distinct, :3])
    np.testing.assert_allclose(np.asarray(scored.logits), np.asarray(plain.logits), atol=1e-4)
    for a, b in zip(jax.tree.leaves(scored.state), jax.tree.leaves(plain.state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("length", [5, 16, 20, 70, 100])
def test_prefill_buckets_match_the_full_forward(setup, length):
    """A prompt's last chunk at a narrower width (16 or 32 tokens) gives the full forward's
    logits and decode steps, like a whole chunk."""
    cfg, model, _ = setup
    bucketed = cfg.replace(prefill_buckets=[16, 32])
    engine = engine_for(bucketed, model)
    rng = np.random.default_rng(length)
    tokens = rng.integers(3, cfg.vocab_size, length + 2)
    full = np.asarray(nnx.jit(lambda m, t: m.forward(t))(model, jnp.asarray(tokens[None])))[0]
    scale = np.abs(full).max()
    logits, state = engine.prefill([tokens[:length]])
    np.testing.assert_allclose(logits[0], full[length - 1], atol=2e-4 * scale)
    for j in range(2):
        _, _, logits, state = engine.step(jnp.asarray([tokens[length + j]], jnp.int32), state,
                                          jax.random.key(0))
        np.testing.assert_allclose(logits[0], full[length + j], atol=2e-4 * scale)
    last = length - (length - 1) // 64 * 64  # tokens the last call holds
    width = 16 if last <= 16 else 32 if last <= 32 else 64
    assert ("prefill chunk", f"1 x {width} tokens") in engine._shapes_seen
    assert engine.chunk_width(last) == width
    ran = {int(shape.split()[2]) for program, shape in engine._shapes_seen
           if program == "prefill chunk"}
    assert engine.prefill_widths([tokens[:length]]) == ran  # what the driver warms up


def test_weights_travel_as_few_buffers_and_come_back_exact(setup):
    cfg, _, engine = setup
    leaves = jax.tree.leaves(engine.params)
    assert len(engine._weights) < len(leaves) // 3
    back = jax.tree.leaves(jax.jit(lambda w: weights.unflatten(engine.layout, w))(
        engine._weights))
    for a, b in zip(leaves, back, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    big = [a for a in leaves if a.nbytes > weights.CONSTANT_BYTES]
    assert big and all(any(a is w for w in engine._weights) for a in big)  # never copied


def test_sharded_weights_are_never_constants():
    cfg = tiny_config("k3-tiny", "ici_tensor_parallelism=2", "ici_expert_parallelism=2")
    engine = engine_for(cfg)
    for a, place in zip(jax.tree.leaves(engine.params), engine.layout.leaves, strict=True):
        if not a.sharding.is_fully_replicated:
            assert isinstance(place, int), a.shape
            assert engine._weights[place] is a
    assert any(isinstance(p, np.ndarray) for p in engine.layout.leaves)


def test_ragged_batch_equals_one_by_one(setup):
    cfg, model, engine = setup
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 70, 1, 64)]
    together = engine.decode_batch(prompts, top_n=2)
    # Each token's two highest log-probabilities, highest first; greedy chose the first.
    for lps, tops in zip(together.output_logprobs, together.output_top_logprobs, strict=True):
        assert np.shape(tops) == (len(lps), 2) and all(a >= b for a, b in tops)
        np.testing.assert_allclose([a for a, _ in tops], lps, rtol=0, atol=1e-6)
    # Against the full forward's log-softmax (float64): the values, and the tokens they belong
    # to (read at the ids given, so a near tie between the two cannot fail it).
    seq = prompts[1] + together.output_ids[1][:-1]
    full = np.asarray(nnx.jit(lambda m, t: m.forward(t))(model, jnp.asarray([seq])),
                      np.float64)[0, len(prompts[1]) - 1:]
    shifted = full - full.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    atol = 2e-4 * np.abs(full).max()
    np.testing.assert_allclose(together.output_top_logprobs[1], -np.sort(-logp)[:, :2],
                               atol=atol, rtol=0)
    np.testing.assert_allclose(
        np.take_along_axis(logp, np.asarray(together.output_top_ids[1]), axis=-1),
        together.output_top_logprobs[1], atol=atol, rtol=0)
    for i, prompt in enumerate(prompts):
        alone = engine.decode_batch([prompt])
        assert alone.output_top_logprobs is None  # not asked for
        assert_same_greedy(alone.output_ids, together.output_ids[i:i + 1],
                           together.output_top_logprobs[i:i + 1], alone.output_logprobs,
                           together.output_logprobs[i:i + 1], where=f"prompt {i}: ")
    for limits in ([2], [0, 1, 1, 1], [1, 1, 1, -3]):  # one per prompt, each at least 1
        with pytest.raises(ConfigError, match="limits must give each"):
            engine.decode_batch(prompts, limits=limits)


def test_greedy_outputs_may_part_only_at_a_near_tie():
    """The comparison every sharded/unsharded, batched/alone test uses: tokens may part (or one
    stop where the other goes on) only where the two highest log-probabilities are within
    NEAR_TIE, log-probabilities compared up to there; a parting anywhere else fails."""
    want, tops = [[4, 5, 6, 7]], [[[-0.1, -3.0], [-0.7, -0.7004], [-0.2, -2.0], [-0.3, -1.5]]]
    lps = [[-0.1, -0.7, -0.2, -0.3]]
    assert assert_same_greedy(want, want, tops, lps, lps) == [4]
    assert assert_same_greedy([[4, 9, 1, 1]], want, tops, [[-0.1, -0.7004, -5, -5]], lps) == [1]
    with pytest.raises(AssertionError, match="from token 2, where the two highest .* 1.8 apart"):
        assert_same_greedy([[4, 5, 9, 7]], want, tops)
    with pytest.raises(AssertionError, match="from token 1"):  # no top log-probabilities
        assert_same_greedy([[4, 9, 6, 7]], want, None)
    # One stops where the other goes on: a parting too (a stop token left out).
    with pytest.raises(AssertionError, match="from token 3, where the two highest .* 1.2 apart"):
        assert_same_greedy([[4, 5, 6]], want, tops)
    assert assert_same_greedy([[4]], want, tops) == [1] and \
        assert_same_greedy(want, [[4]], tops) == [1]  # token 1 was a near tie
    with pytest.raises(AssertionError, match="from token 4, where .* inf apart"):
        assert_same_greedy([[4, 5, 6, 7, 8]], want, tops)  # no top log-probabilities there
    with pytest.raises(AssertionError, match="prompt 0"):  # before the parting
        assert_same_greedy([[4, 9, 1, 1]], want, tops, [[-0.2, -0.7004, -5, -5]], lps)


def test_unrolled_engine_reads_split_stacks_and_decodes_the_same(setup):
    cfg, model, engine = setup
    unrolled_cfg = cfg.replace(scan_layers=False)
    unrolled = engine_for(unrolled_cfg, Decoder(unrolled_cfg, Init(7)))  # same weights
    grouped = {path: v.get_value() for path, v in nnx.to_flat_state(unrolled.params)
               if path[0] == "groups"}
    assert grouped and all(isinstance(v, tuple) for v in grouped.values())
    # One device holds every expert: they are split per expert too (the hit-experts kernel
    # switches to each expert's own arrays; prefill's grouped kernel restacks them).
    experts = [v for path, v in grouped.items() if "experts" in path]
    assert experts and all(len(v[0]) == cfg.num_experts for v in experts)
    prompts = [[5, 6, 7], list(range(3, 70))]
    a, b = engine.decode_batch(prompts, top_n=2), unrolled.decode_batch(prompts)
    assert_same_greedy(b.output_ids, a.output_ids, a.output_top_logprobs, b.output_logprobs,
                       a.output_logprobs)


def test_decode_loop_is_one_compiled_program(setup, monkeypatch):
    cfg, _, engine = setup
    traces = []
    original = Decoder.decode

    def counting(self, *args, **kwargs):
        traces.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Decoder, "decode", counting)
    engine._generate = jax.jit(
        functools.partial(generate_program, engine.cfg, engine.layout),
        static_argnames=("max_steps", "top_n"), donate_argnames=("pool",))
    first = engine.decode_batch([[5, 6, 7]], max_steps=cfg.max_decode_steps)
    second = engine.decode_batch([[9, 8]], max_steps=cfg.max_decode_steps)
    # The step body was traced once; both calls ran all their steps inside one program.
    assert len(traces) == 1
    assert engine._generate._cache_size() == 1
    assert first.decode_steps == second.decode_steps == cfg.max_decode_steps


def test_absorbed_mla_equals_materialised():
    cfg = tiny_config("k3-tiny")
    mla = MLAAttention(cfg, Init(3))
    rng = np.random.default_rng(2)
    cache = jnp.asarray(rng.normal(size=(3, 40, cfg.mla_latent_dim)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(3, cfg.hidden_size)), jnp.float32)
    positions = jnp.asarray([0, 17, 39])
    absorbed, cache_a = mla.step(x, cache, positions)
    materialised, cache_m = mla.step_materialised(x, cache, positions)
    np.testing.assert_allclose(absorbed, materialised, atol=1e-5)
    np.testing.assert_array_equal(cache_a, cache_m)


def test_kda_step_matches_sequence_path():
    cfg = tiny_config("k3-tiny")
    kda = KDAAttention(cfg, Init(4))
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 9, cfg.hidden_size)), jnp.float32)
    full, final = kda(x)
    state = zeros(cfg, 2)
    state = KDAState(state.kda_recurrent[0], state.kda_conv[0])
    outs = []
    for t in range(x.shape[1]):
        y, state = kda.step(x[:, t], state)
        outs.append(y)
    np.testing.assert_allclose(jnp.stack(outs, 1), full, atol=1e-5)
    np.testing.assert_allclose(state.recurrent, final.recurrent, atol=1e-5)
    np.testing.assert_allclose(state.conv, final.conv, atol=1e-6)


def test_a_bfloat16_kda_state_is_stored_as_such(setup):
    """`kda_state_dtype: bfloat16` halves the recurrent state's bytes in the pool and the
    prefix-cache store, and it is rounded there, not float32 under another name: the
    log-probabilities move, and the first tokens of prompts shorter than a chunk (their state
    rounded only after their logits) do not. How far it drifts is measured against float64 by
    benchmarks/state_dtype.py; the shipped model keeps its answers (test_default_model.py)."""
    cfg, model, engine = setup
    narrow = engine_for(cfg.replace(kda_state_dtype="bfloat16"), model)
    assert narrow.new_pool(2).state.kda_recurrent.dtype == jnp.bfloat16
    assert narrow.new_store(2).kda_recurrent.dtype == jnp.bfloat16
    assert engine.new_pool(2).state.kda_recurrent.dtype == jnp.float32
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (129, 40, 3)]
    want, got = engine.decode_batch(prompts), narrow.decode_batch(prompts)
    assert [lps[0] for lps in got.output_logprobs[1:]] == \
        [lps[0] for lps in want.output_logprobs[1:]]
    assert not np.allclose(np.concatenate(got.output_logprobs),
                           np.concatenate(want.output_logprobs), atol=1e-6, rtol=0)
