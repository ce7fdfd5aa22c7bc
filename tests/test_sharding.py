"""Sharding on 8 CPU devices: tensor parallelism over heads, expert parallelism in both modes,
against the unsharded model; the TPU transport of the all-to-all mode lowers for TPU."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3text import sharding
from k3text.config import ConfigError
from k3text.inference.engine import place_model
from k3text.layers import moe as moe_module
from k3text.layers.initializers import Init
from k3text.layers.moe import MoE
from k3text.models.decoder import Decoder

from helpers import assert_same_greedy, engine_for, mesh_context, tiny_config

MESHES = [(2, 4), (4, 2), (8, 1)]  # (tensor, expert)


@pytest.fixture(scope="module", params=["k3-tiny", "kimi-linear-tiny"])
def reference(request):
    cfg = tiny_config(request.param, "max_decode_steps=5", "ignore_eos=true")
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 70)))
    logits = nnx.jit(lambda m, t: m.forward(t))(Decoder(cfg, Init(1)), tokens)
    return cfg, tokens, np.asarray(logits)


def sharded(cfg, tensor, expert, mode):
    return cfg.replace(ici_tensor_parallelism=tensor, ici_expert_parallelism=expert,
                       moe_ep_mode=mode)


@pytest.mark.parametrize("mode", ["local", "all_to_all"])
@pytest.mark.parametrize("tensor,expert", MESHES)
def test_sharded_logits_match_unsharded(reference, tensor, expert, mode):
    cfg, tokens, expected = reference
    cfg = sharded(cfg, tensor, expert, mode)
    ctx = mesh_context(cfg)
    model = place_model(Decoder(cfg, Init(1)), ctx)
    with sharding.use_mesh(ctx.mesh, ctx.rules):
        got = nnx.jit(lambda m, t: m.forward(t))(model, tokens)
    assert model.embed.table[...].sharding.spec == ctx.spec(("vocab", "embed"))
    np.testing.assert_allclose(got, expected, atol=1e-4 * np.abs(expected).max())


PROMPTS = [[5, 6, 7, 8], list(range(3, 40)), [9]]


@pytest.fixture(scope="module")
def unsharded_generation(reference):
    cfg, _, _ = reference
    return engine_for(cfg, seed=1).decode_batch(PROMPTS, top_n=2)


@pytest.mark.parametrize("mode", ["local", "all_to_all"])
def test_sharded_greedy_tokens_match_unsharded(reference, unsharded_generation, mode):
    cfg, _, _ = reference
    expected = unsharded_generation
    got = engine_for(sharded(cfg, 2, 4, mode), seed=1).decode_batch(PROMPTS)
    assert_same_greedy(got.output_ids, expected.output_ids, expected.output_top_logprobs,
                       got.output_logprobs, expected.output_logprobs)


def test_moe_mode_is_logged(caplog, monkeypatch):
    # Each distinct path is logged once per process: forget what earlier tests reported.
    monkeypatch.setattr(moe_module, "_reported_paths", set())
    cfg = sharded(tiny_config("kimi-linear-tiny", "num_experts=24"), 1, 8, "local")
    ctx = mesh_context(cfg)
    moe = place_model(MoE(cfg, Init(0)), ctx)
    with caplog.at_level(logging.INFO, logger="k3text.layers.moe"), \
            sharding.use_mesh(ctx.mesh, ctx.rules):
        nnx.jit(lambda m, x: m(x))(moe, jnp.ones((4, cfg.hidden_size)))
    # 8 slots over 3 experts a device: above auto's threshold (held - 1), the grouped kernel.
    assert "local expert parallelism over ('expert',), implementation grouped" in caplog.text


def test_all_to_all_ragged_transport_lowers_for_tpu():
    cfg = sharded(tiny_config("k3-tiny"), 2, 4, "all_to_all").replace(moe_a2a_transport="ragged")
    ctx = mesh_context(cfg)
    graphdef, state = nnx.split(MoE(cfg, Init(abstract=True)))
    shardings = sharding.state_shardings(state, ctx)
    state = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
        state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    x = jax.ShapeDtypeStruct((16, cfg.hidden_size), jnp.float32,
                             sharding=ctx.sharding(("batch", None)))
    with sharding.use_mesh(ctx.mesh, ctx.rules):
        fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
        exported = jax.export.export(fn, platforms=["tpu"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(state, x)
    assert "ragged_all_to_all" in exported.mlir_module()


@pytest.mark.parametrize("overrides,message", [
    (["ici_tensor_parallelism=8", "linear_attn_config.num_heads=12"],
     "linear_attn_config.num_heads = 12 does not divide over the 'heads' mesh axes"),
    (["ici_expert_parallelism=8", "ici_tensor_parallelism=1", "num_experts=12"],
     "num_experts = 12 does not divide over the 'exp' mesh axes"),
    (["ici_tensor_parallelism=8", "vocab_size=100"], "vocab_size = 100 does not divide"),
])
def test_indivisible_dimensions_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config("kimi-linear-tiny", *overrides)
