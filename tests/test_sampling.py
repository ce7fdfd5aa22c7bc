"""Sampling strategies with MaxText's keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3text.inference.sampling import sample

from helpers import tiny_config

LOGITS = jnp.asarray([[0.0, 3.0, 2.5, -1.0, 1.0, 2.9]], jnp.float32)


def draws(cfg, n=400):
    keys = jax.random.split(jax.random.key(0), n)
    tokens, logprobs = jax.vmap(lambda k: sample(cfg, LOGITS, k))(keys)
    return np.asarray(tokens[:, 0]), np.asarray(logprobs[:, 0])


def cfg_with(*overrides):
    return tiny_config("kimi-linear-tiny", *overrides)


def test_greedy_is_argmax_and_logprob_is_unmodified():
    tokens, logprobs = draws(cfg_with("decode_sampling_strategy=greedy"), 4)
    assert set(tokens) == {1}
    np.testing.assert_allclose(logprobs, jax.nn.log_softmax(LOGITS)[0, 1], rtol=1e-6)


def test_topk_only_draws_the_top_k():
    tokens, logprobs = draws(cfg_with("decode_sampling_strategy=topk", "decode_sampling_top_k=2"))
    assert set(tokens) == {1, 5}
    # Log-probabilities are under the unmodified distribution, not the truncated one.
    np.testing.assert_allclose(logprobs, jax.nn.log_softmax(LOGITS)[0, tokens], rtol=1e-6)


def test_nucleus_keeps_the_smallest_set_reaching_p():
    probs = np.asarray(jax.nn.softmax(LOGITS))[0]
    p = probs[1] + probs[5] - 1e-3  # the top two tokens reach p, the top one alone does not
    tokens, _ = draws(cfg_with("decode_sampling_strategy=nucleus",
                               f"decode_sampling_nucleus_p={p}"))
    assert set(tokens) == {1, 5}


def test_composite_scales_by_temperature_then_cuts_top_k_then_top_p():
    """vLLM's order: temperature first, then top-k, then the nucleus of what is left. At
    temperature 0.05 token 1 holds 88% of the top three's mass, so a nucleus of 0.6 keeps it
    alone; cut before the temperature (token 1 40% of the top three, the top two 76%) the
    nucleus would keep token 5 too, drawn about one time in eight of 400."""
    def composite(temperature, top_p):
        return draws(cfg_with("decode_sampling_strategy=composite", "decode_sampling_top_k=3",
                              f"decode_sampling_nucleus_p={top_p}",
                              f"decode_sampling_temperature={temperature}"))[0]

    assert set(composite(0.05, 0.6)) == {1}
    assert set(composite(1.0, 0.6)) == {1, 5}
    assert set(composite(1.0, 1.0)) == {1, 2, 5}  # the top three, nothing cut after them


@pytest.mark.parametrize("temperature,expect_spread", [(1.0, True), (0.01, False)])
def test_weighted_temperature(temperature, expect_spread):
    tokens, _ = draws(cfg_with("decode_sampling_strategy=weighted",
                               f"decode_sampling_temperature={temperature}"))
    assert (len(set(tokens)) > 3) == expect_spread


def test_same_seed_same_tokens():
    cfg = cfg_with("decode_sampling_strategy=weighted")
    a = sample(cfg, jnp.tile(LOGITS, (8, 1)), jax.random.key(3))[0]
    b = sample(cfg, jnp.tile(LOGITS, (8, 1)), jax.random.key(3))[0]
    np.testing.assert_array_equal(a, b)


def test_truncation_cuts_only_the_rows_that_ask_and_top_p_one_cuts_nothing():
    """Rows cut by their own top-k / top-p; a row asking for neither (top_k 0 or the whole
    vocabulary, top_p 1) keeps every logit, even tokens whose mass above them rounds to 1 in
    float32."""
    from k3text.inference.sampling import _truncated

    vocab = 5001
    peaked = jnp.full((vocab,), -20.0).at[0].set(20.0)  # all but one token below float32's eps
    rows = jnp.stack([peaked, peaked, jnp.full((vocab,), -50.0).at[:6].set(LOGITS[0]), peaked])
    top_k = jnp.asarray([0, vocab, 2, 0], jnp.int32)
    top_p = jnp.asarray([1.0, 1.0, 1.0, 0.5], jnp.float32)
    out = np.asarray(_truncated(rows, top_k, top_p))
    np.testing.assert_array_equal(out[:2], np.asarray(rows[:2]))
    assert np.isfinite(out[2]).sum() == 2 and np.isfinite(out[2, [1, 5]]).all()
    assert np.isfinite(out[3]).sum() == 1
    plain = _truncated(rows[:2], top_k[:2], top_p[:2])
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(rows[:2]))


def test_logit_bias_and_min_tokens_steer_the_draw_and_leave_logprobs_raw():
    """Per row, as vLLM applies them: logit_bias added before greedy or sampled choice; a row
    that has produced fewer than its min_tokens never draws its stop ids (-1 unused); rows that
    ask for neither are untouched; log-probabilities stay the model's own."""
    from k3text.inference.sampling import host_sampling, sample_slots

    logits = jnp.tile(LOGITS, (5, 1))  # argmax 1, then 5, then 2
    rows = [(0.0, 0, 1.0, 0),  # plain greedy
            (0.0, 0, 1.0, 0, 0, ((1, -100.0), (3, 0.5))),  # the argmax biased away: 5
            (0.0, 0, 1.0, 0, 0, ((0, 3.5),)),  # 0.0 + 3.5 beats 3.0
            (0.0, 0, 1.0, 0, 2),  # min_tokens 2 at token 1: stop ids 1 and 5 banned -> 2
            (0.0, 0, 1.0, 0, 1)]  # min_tokens 1 at token 1: nothing banned
    stop_ids = jnp.asarray([[1, 5, -1]] * 5, jnp.int32)
    index = jnp.asarray([0, 0, 0, 1, 1], jnp.int32)
    tokens, chosen, _, _ = sample_slots(logits, host_sampling(rows, 6), index, 0, stop_ids)
    assert np.asarray(tokens).tolist() == [1, 5, 0, 2, 1]
    raw = np.asarray(jax.nn.log_softmax(LOGITS[0]))
    np.testing.assert_allclose(np.asarray(chosen), raw[[1, 5, 0, 2, 1]], rtol=1e-6)

    # Sampled: over 300 seeds a banned stop id never comes, and a strong bias always wins.
    n = 300
    sampled = host_sampling([(1.0, 0, 1.0, s, 5) for s in range(n)]
                            + [(1.0, 0, 1.0, s, 0, ((3, 100.0),)) for s in range(n)], 6)
    tokens, _, _, _ = sample_slots(jnp.tile(LOGITS, (2 * n, 1)), sampled,
                                   jnp.zeros(2 * n, jnp.int32), 0,
                                   jnp.asarray([[1, 5, -1]] * (2 * n), jnp.int32))
    tokens = np.asarray(tokens)
    assert not np.isin(tokens[:n], [1, 5]).any() and len(set(tokens[:n].tolist())) > 1
    assert (tokens[n:] == 3).all()


def test_min_p_draws_only_tokens_that_share_of_the_likeliest():
    """min_p 0.5 at temperature 1 keeps the tokens whose probability is at least half the
    likeliest's (logits within log 2 of the top: ids 1, 2 and 5); min_p 0 keeps every token;
    greedy rows are untouched."""
    from k3text.inference.sampling import host_sampling, sample_slots

    n = 300
    rows = ([(1.0, 0, 1.0, s, 0, (), 0.5) for s in range(n)]
            + [(1.0, 0, 1.0, s, 0, (), 0.0) for s in range(n)] + [(0.0, 0, 1.0, 0, 0, (), 0.9)])
    tokens, _, _, _ = sample_slots(jnp.tile(LOGITS, (2 * n + 1, 1)), host_sampling(rows, 6),
                                   jnp.zeros(2 * n + 1, jnp.int32))
    tokens = np.asarray(tokens)
    keep = np.flatnonzero(np.asarray(LOGITS[0]) >= float(LOGITS.max()) + np.log(0.5))
    assert keep.tolist() == [1, 2, 5]
    assert set(tokens[:n].tolist()) == set(keep.tolist())
    assert set(tokens[n:2 * n].tolist()) > set(keep.tolist())
    assert tokens[-1] == 1


def test_penalties_match_a_float64_reference():
    """Repetition over prompt and output tokens (divided where positive, multiplied where
    negative), then frequency x count and presence once per output token; a row asking for
    none is untouched."""
    from k3text.inference.sampling import (
        History,
        SamplingRow,
        _adjusted,
        host_sampling,
        prompt_tokens,
    )

    rng = np.random.default_rng(0)
    vocab = 37  # not a multiple of 8: the prompt's bits end mid-byte
    logits = rng.normal(0, 3, (3, vocab))
    counts = rng.integers(0, 3, (3, vocab)) * (rng.random((3, vocab)) < 0.3)
    prompts = [(1, 5, 36), (0, 36), (2, 3)]
    rows = [SamplingRow(1.0, 0, 1.0, 0, presence_penalty=0.7, frequency_penalty=-0.4,
                        repetition_penalty=1.5, prompt=prompts[0]),
            SamplingRow(1.0, 0, 1.0, 0, repetition_penalty=0.6, prompt=prompts[1]),
            SamplingRow(1.0, 0, 1.0, 0, prompt=prompts[2])]
    params = host_sampling(rows, vocab)
    got = _adjusted(jnp.asarray(logits, jnp.float32), params, jnp.zeros(3, jnp.int32), None,
                    History(jnp.asarray(counts, jnp.int32), prompt_tokens(params, vocab)))
    want = logits.copy()
    for i, r in enumerate(rows):
        seen = np.isin(np.arange(vocab), r.prompt) | (counts[i] > 0)
        rep = np.where(seen, r.repetition_penalty, 1.0)
        want[i] = np.where(want[i] > 0, want[i] / rep, want[i] * rep)
        want[i] -= r.frequency_penalty * counts[i] + r.presence_penalty * (counts[i] > 0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(logits[2], np.float32))
