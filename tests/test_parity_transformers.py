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
    model = tiny_hf_model(seed=sorted(CASES).index(case), **CASES[case])
    cfg, twin = k3text_twin(model)
    forward = nnx.jit(lambda m, t: m.forward(t))
    rng = np.random.default_rng(0)
    for length in (1, 64, 65, 130):
        tokens = rng.integers(0, cfg.vocab_size, (2, length))
        expected = hf_logits(model, tokens)
        got = np.asarray(forward(twin, jax.numpy.asarray(tokens)))
        scale = np.abs(expected).max()
        np.testing.assert_allclose(got, expected, atol=1e-4 * scale, rtol=0,
                                   err_msg=f"{case}, T={length}")


def test_greedy_decode_matches_transformers_generate():
    import torch

    from helpers import engine_for

    model = tiny_hf_model(seed=11, num_hidden_layers=4, full_attn_layers=[2, 4])
    model.generation_config.eos_token_id = None
    steps = 10
    cfg, twin = k3text_twin(model, max_decode_steps=steps, ignore_eos=True,
                            max_prefill_predict_length=128, max_target_length=160)
    engine = engine_for(cfg, twin)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (3, 20, 66)]
    ours = engine.decode_batch(prompts)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), do_sample=False,
                                    max_new_tokens=steps, pad_token_id=0)[0, len(prompt):]
        theirs = theirs.tolist()
        # Token equality is only meaningful where the reference's choice is not a near-tie.
        logits = hf_logits(model, np.asarray([prompt + theirs]))[0, len(prompt) - 1 : -1]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        margins = top2[:, 1] - top2[:, 0]
        clear = int(np.argmax(margins < 1e-3)) if (margins < 1e-3).any() else steps
        assert clear >= 3, f"prompt {i}: reference has a near-tie at step {clear}"
        assert ours.output_ids[i][:clear] == theirs[:clear], f"prompt {i}"
        expected_lp = jax.nn.log_softmax(logits, axis=-1)[np.arange(steps), theirs]
        np.testing.assert_allclose(ours.output_logprobs[i][:clear], expected_lp[:clear],
                                   atol=1e-4)
