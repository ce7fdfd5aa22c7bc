"""Long context: the MLA latent cache split by sequence position over the model-parallel
devices. On 8 CPU devices decode with the split cache equals one-device decode for prompts whose
cached positions reach every device's shard, in both MoE modes; the compiled decode step never
moves the cache (its merge is a few values per head); the memory tool's capacity at 1M tokens on
v7x-16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3text import sharding
from k3text.config import CONFIG_DIR, load_config
from k3text.ops import mla as mla_ops
from k3text.tools import collectives, compile_check, memory

from helpers import assert_same_greedy, engine_for, mesh_context, tiny_config

SHARDS = 8


def _config(*overrides: str):
    return tiny_config("k3-tiny", "max_prefill_predict_length=112", "max_target_length=128",
                       "prefill_chunk_size=16", "kda_chunk_size=16", "max_decode_steps=14",
                       "ignore_eos=true", *overrides)


@pytest.fixture(scope="module")
def one_device():
    cfg = _config()
    rng = np.random.default_rng(0)
    # 113 + 14 positions of 128: every one of the 8 shards of 16 positions holds cached rows,
    # and the shortest prompt's decode runs inside the first shards only.
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (112, 70, 5)]
    return cfg, prompts, engine_for(cfg, seed=4).decode_batch(prompts, batch=4, top_n=2)


@pytest.mark.parametrize("mode", ["local", "all_to_all"])
def test_sequence_split_decode_equals_one_device(one_device, mode):
    cfg, prompts, expected = one_device
    split = cfg.replace(ici_tensor_parallelism=2, ici_expert_parallelism=4, moe_ep_mode=mode)
    engine = engine_for(split, seed=4)
    assert engine.ctx.size("cache_seq") == SHARDS
    got = engine.decode_batch(prompts, batch=4)
    assert_same_greedy(got.output_ids, expected.output_ids, expected.output_top_logprobs,
                       got.output_logprobs, expected.output_logprobs)
    pool = engine.new_pool(4)
    cache = pool.state.mla_cache
    assert cache.sharding.spec == engine.ctx.spec(("layers", "batch", "cache_seq", "kv_lora"))
    assert {s.data.shape[2] for s in cache.addressable_shards} == {cache.shape[2] // SHARDS}


@pytest.mark.parametrize("cache_seq", [("tensor", "expert"), ("tensor",)])
def test_the_split_merge_equals_the_reference_on_random_rows(cache_seq):
    """The log-sum-exp combine against one softmax, with rows whose visible positions end in
    every shard, at the first position, and past the end (written nowhere). Positions split
    over more devices than the heads (the sums all-reduced), or over the heads' own devices
    (reduce-scattered, each device keeping its heads)."""
    cfg = _config("ici_tensor_parallelism=4", "ici_expert_parallelism=2")
    rules = {name: list(axes) for name, axes in cfg.logical_axis_rules.items()}
    cfg = cfg.replace(logical_axis_rules={**rules, "cache_seq": list(cache_seq)})
    ctx = mesh_context(cfg)
    rng = np.random.default_rng(3)
    batch, heads, width, positions = 4, 4, 24, 128
    query = jnp.asarray(rng.normal(size=(batch, heads, width)), jnp.float32)
    latent = jnp.asarray(rng.normal(size=(batch, width)), jnp.float32)
    cache = jnp.asarray(rng.normal(size=(batch, positions, width)), jnp.float32)
    at = jnp.asarray([0, 37, 127, 128], jnp.int32)
    want_cache = mla_ops.write_rows(cache, latent, at)
    want = mla_ops.attention_reference(query, want_cache, at, 0.3, jax.lax.Precision.HIGHEST,
                                       jnp.float32)
    with sharding.use_mesh(ctx.mesh, ctx.rules):
        split = jax.device_put(cache, ctx.sharding(("batch", "cache_seq", "kv_lora")))
        assert mla_ops.implementation() == "sequence_sharded"
        got, got_cache = jax.jit(mla_ops.decode_attention, static_argnums=(4, 5, 6))(
            query, latent, split, at, 0.3, jax.lax.Precision.HIGHEST, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))


def test_a_float8_cache_saturates_instead_of_writing_nan():
    """float8_e4m3fn has no infinity: a plain cast of 465 or more is NaN, which every later
    step attending to the row would read. Rows written to a float8 cache saturate at 448."""
    import ml_dtypes

    latent = jnp.asarray([[1e4, -600.0, 3.0, 448.0]], jnp.float32)
    cache = jnp.zeros((1, 2, 4), jnp.float8_e4m3fn)
    written = np.asarray(mla_ops.write_rows(cache, latent, jnp.asarray([1])), np.float32)
    expected = np.asarray([448.0, -448.0, 3.0, 448.0], ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(written[0, 1], expected.astype(np.float32))
    assert np.isnan(np.asarray(latent.astype(jnp.float8_e4m3fn), np.float32)).any()  # the cast
    wide = mla_ops.to_cache_dtype(latent, jnp.float32)  # other dtypes as they are
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(latent))


def test_the_compiled_decode_step_never_moves_the_cache():
    """8 devices, a 4,096-position cache: the decode step's collectives are the activations'
    and, per MLA layer, the query gather, the max and the merged sums — none of them anywhere
    near one layer's cached rows."""
    cfg = load_config(CONFIG_DIR / "inference" / "cpu8-local.yml",
                      ["max_target_length=4096", "max_prefill_predict_length=64"])
    ctx = mesh_context(cfg)
    with sharding.use_mesh(ctx.mesh, ctx.rules):
        fn, args = compile_check.programs(compile_check.abstract_inputs(cfg, ctx))["decode step"]
        report = collectives.read(fn.lower(*args).compile().as_text())
    layer_cache = cfg.global_batch_size * 4096 * cfg.mla_latent_dim * 4
    merge = cfg.global_batch_size * cfg.num_attention_heads * (cfg.mla_latent_dim + 1) * 4
    row = cfg.hidden_size * 4 * cfg.global_batch_size  # the residual stream's rows
    assert max(c.bytes for c in report.collectives) <= max(merge, 2 * row) < layer_cache / 100
    assert not report.moving_parameters()
    attention = [c for c in report.collectives if "ops/mla.py" in c.source]
    assert max(c.bytes for c in attention) <= merge
    assert sum(c.per_call for c in attention) == 3 * cfg.structure.num_mla, \
        [c.source for c in attention]


def test_a_million_tokens_fit_dozens_of_sequences_on_v7x16(capsys):
    path = str(CONFIG_DIR / "inference" / "v7x16.yml")
    cfg = load_config(path)
    ctx = memory.mesh_context(cfg)
    cost = memory.sequence_cost(cfg, ctx)
    per_token = cfg.structure.num_mla * cfg.mla_latent_dim * 2  # bf16, 27,648 B
    assert cost.per_position == pytest.approx(per_token / 32)  # 1/32 of each sequence
    assert memory.main([path, "context=1048576"]) == 0
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("1,048,576 *"))
    largest = int(row.split()[-1].replace(",", ""))
    assert largest >= 32, row
    assert "with the MLA cache replicated (cache_seq: []) instead of split 32 ways: largest " \
           "batch at context=1,048,576 1," in printed
