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
