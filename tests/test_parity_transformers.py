"""The Kimi Linear forward against transformers' KimiLinearForCausalLM on the same weights."""

import jax
import numpy as np
import pytest
from flax import nnx

from hf_reference import hf_logits, k3text_twin, tiny_hf_model

CASES = {
    "mla-last": dict(num_hidden_layers=4, full_attn_layers=[4]),
    "odd-pattern": dict(num_hidden_layers=6, full_attn_layers=[1, 3, 4], first_k_dense_replace=2),
    "grouped-router": dict(num_hidden_layers=3, full_attn_layers=[2], n_group=4, topk_group=2,
                           num_experts_per_token=3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case):
    model = tiny_hf_model(seed=hash(case) % 1000, **CASES[case])
    cfg, twin = k3text_twin(model)
    forward = nnx.jit(lambda m, t: m.forward(t))
    rng = np.random.default_rng(0)
    for length in (1, 7, 64, 65, 130):
        tokens = rng.integers(0, cfg.vocab_size, (2, length))
        expected = hf_logits(model, tokens)
        got = np.asarray(forward(twin, jax.numpy.asarray(tokens)))
        scale = np.abs(expected).max()
        np.testing.assert_allclose(got, expected, atol=1e-4 * scale, rtol=0,
                                   err_msg=f"{case}, T={length}")
