"""Communication of the compiled programs, read from their HLO: no collective moves a parameter,
decode collectives are a few activation rows each, and the count per layer is the layout's
structural minimum (on the 8-device CPU configs here; v7x16 in test_compile_check)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3text import sharding
from k3text.config import load_config
from k3text.tools import collectives, compile_check

from helpers import ROOT, mesh_context

CPU8 = ("cpu8-local.yml", "cpu8-all-to-all.yml")


def compiled_reports(cfg, pinned=True):
    ctx = mesh_context(cfg)
    reports = {}
    with sharding.use_mesh(ctx.mesh, ctx.rules):
        for name, (fn, args) in compile_check.programs(
                compile_check.abstract_inputs(cfg, ctx)).items():
            # `programs` makes new functions on each call: no trace is shared between layouts.
            if pinned:
                lowered = fn.lower(*args)
            else:
                with sharding.unpinned_activations():
                    lowered = fn.lower(*args)
            compiled, partitioned = collectives.partitioned_hlo(lowered)
            reports[name] = collectives.read(compiled.as_text(), partitioned_module=partitioned)
    return ctx, reports


def local_moe_count(cfg, ctx) -> int:
    """Collectives per decode step of the local-expert layout: one all-reduce per sublayer
    output projection (attention, dense MLP, LatentMoE up projection with the shared experts),
    the vocab-split embedding's all-reduce, and per MoE layer the router-score + latent
    gather(s) and the expert combine."""
    st = cfg.structure
    moe = sum(spec.mlp == "moe" for spec in st.layers)
    gathers = 1 if ctx.axes("exp") == ctx.axes("latent") else 2
    return 1 + len(st.layers) + (len(st.layers) - moe) + moe * (gathers + 2)


def mla_merge_count(cfg, ctx) -> int:
    """Collectives per decode step of the sequence-split MLA cache (ops/mla.py): per MLA layer
    the query all-gather over the heads' devices, the score maxima and the merged sums."""
    if ctx.size("cache_seq") == 1:
        return 0
    return cfg.structure.num_mla * (2 + bool(ctx.axes("heads")))


@pytest.mark.parametrize("config", CPU8)
def test_cpu8_programs_move_only_activations(config):
    cfg = load_config(ROOT / "configs/inference" / config)
    ctx, reports = compiled_reports(cfg)
    layers = cfg.num_hidden_layers
    for name, report in reports.items():
        assert report.count > 0, name
        assert not report.moving_parameters(), (name, report.moving_parameters()[:3])
        assert all(c.source for c in report.collectives), name
    decode = reports["decode step"]
    # Batch 20 on 8 devices: every decode collective is at most a few rows of activations, or
    # an MLA layer's query or merged sums (B x H x 577 values), whatever the context.
    row = cfg.hidden_size * 4 * cfg.global_batch_size
    merge = cfg.global_batch_size * cfg.num_attention_heads * (cfg.mla_latent_dim + 1) * 4
    mla = [c for c in decode.collectives if "ops/mla.py" in c.source]
    assert sum(c.per_call for c in mla) == mla_merge_count(cfg, ctx) == 12
    assert max(c.bytes for c in mla) <= merge
    assert max(c.bytes for c in decode.collectives if c not in mla) <= 2 * row
    if cfg.moe_ep_mode == "local":
        assert decode.count == local_moe_count(cfg, ctx) + mla_merge_count(cfg, ctx) == 75
        assert decode.count_by_kind() == {"all-reduce": 39 + 8, "all-gather": 24 + 4}
    else:  # dispatch and combine all-to-alls instead of the combine all-reduce
        assert (decode.count - mla_merge_count(cfg, ctx)) / layers <= 8
        assert decode.count_by_kind().get("all-to-all", 0) > 0


def test_unpinned_layout_gathers_weights_and_pinned_does_not():
    """The same program with the activation pins off is the layout the report caught: the
    partitioner gathers a LatentMoE projection weight in every MoE layer."""
    cfg = load_config(ROOT / "configs/inference/cpu8-local.yml")
    _, pinned = compiled_reports(cfg)
    _, unpinned = compiled_reports(cfg, pinned=False)
    moved = unpinned["decode step"].moving_parameters()
    assert len(moved) == 12 and all("routed_expert_down_proj" in c.op_name for c in moved)
    assert not pinned["decode step"].moving_parameters()
    assert pinned["decode step"].count < unpinned["decode step"].count


@pytest.mark.parametrize("features", [("exp", "latent"), ("latent", "latent"), ("exp",)])
def test_gather_features_is_exact_and_merges_pieces_on_the_same_axes(features):
    cfg = load_config(ROOT / "configs/inference/cpu8-local.yml")  # exp: 8 ways, latent: 2
    ctx = mesh_context(cfg)
    rng = np.random.default_rng(0)
    shapes = {"exp": ((6, 2, 16), jnp.float32), "latent": ((6, 10), jnp.bfloat16)}
    pieces = [jnp.asarray(rng.normal(size=shapes[f][0]), shapes[f][1]) for f in features]

    def program(*xs):
        xs = [sharding.constrain_features(x, f) for x, f in zip(xs, features, strict=True)]
        return sharding.gather_features(xs, features)

    with sharding.use_mesh(ctx.mesh, ctx.rules):
        got = jax.jit(program)(*pieces)
        report = collectives.read(jax.jit(program).lower(*pieces).compile().as_text())
    for g, x in zip(got, pieces, strict=True):
        assert g.dtype == x.dtype and g.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(x, np.float32))
    groups = len({ctx.axes(f) for f in features})
    assert report.count_by_kind() == {"all-gather": groups}


# (8, 6): N wider than a shard; (512, 0): serve_max_logprobs=0, nothing to gather
@pytest.mark.parametrize("vocab,top", [(512, 3), (8, 6), (512, 0)])
def test_prompt_scores_of_split_logits_are_exact_and_gather_only_each_shards_top(vocab, top):
    """`sampling.score_next` on logits split over the vocabulary (as the LM head leaves them)
    equals a float64 reference, and moves only reductions over the vocabulary and each
    shard's own top N, never the logits."""
    from k3text.inference import sampling

    cfg = load_config(ROOT / "configs/inference/cpu8-local.yml")
    ctx = mesh_context(cfg)
    assert ctx.size("vocab") > 1
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 6, vocab)).astype(np.float32) * 4
    targets = rng.integers(0, vocab, (2, 6)).astype(np.int32)

    def program(logits, targets):
        return sampling.score_next(sharding.constrain_features(logits, "vocab"), targets, top)

    with sharding.use_mesh(ctx.mesh, ctx.rules):
        got = jax.jit(program)(logits, targets)
        report = collectives.read(jax.jit(program).lower(logits, targets).compile().as_text())
    ref = logits.astype(np.float64)
    ref = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    chosen = np.take_along_axis(ref, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(got.logprobs), chosen, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.ranks),
                                  1 + np.sum(ref > chosen[..., None], axis=-1))
    order = np.argsort(-ref, axis=-1)[..., :top]
    np.testing.assert_array_equal(np.asarray(got.top_ids), order)
    np.testing.assert_allclose(np.asarray(got.top_logprobs),
                               np.take_along_axis(ref, order, -1), atol=1e-5)
    shards = ctx.size("vocab")
    gathered = [c for c in report.collectives if c.kind == "all-gather"]
    assert len(gathered) == (2 if top else 0)
    assert all(c.bytes <= 4 * 2 * 6 * min(top, vocab // shards) * shards for c in gathered)
    assert all(c.bytes <= 4 * 2 * 6 for c in report.collectives if c.kind != "all-gather")


@pytest.mark.parametrize("config", CPU8)
def test_serving_programs_move_only_activations(config):
    """The server's programs at the configured slot count move activations only: `insert`
    gathers nothing but the prefix logits it samples from, a `generate` step adds one
    collective to the decode step's: the logits gathered for sampling (never the LM head), the
    call with a prefill chunk riding its first step moves no parameter either, and the scored
    chunk of `prompt_logprobs` never gathers its logits."""
    cfg = load_config(ROOT / "configs/inference" / config)
    ctx = mesh_context(cfg)
    with sharding.use_mesh(ctx.mesh, ctx.rules):
        inputs = compile_check.abstract_inputs(cfg, ctx)
        reports = {}
        for name, (fn, args) in {**compile_check.serving_programs(cfg, inputs, ctx),
                                 "decode step": compile_check.programs(inputs)["decode step"]
                                 }.items():
            compiled, partitioned = collectives.partitioned_hlo(fn.lower(*args))
            reports[name] = collectives.read(compiled.as_text(), partitioned_module=partitioned)
    for name, report in reports.items():
        assert not report.moving_parameters(), (name, report.moving_parameters()[:3])
    assert reports["serve insert"].count <= 1
    assert reports["serve generate"].count == reports["decode step"].count + 1
    assert reports["serve decode + prefill"].count > reports["serve generate"].count
    # Scoring every position adds reductions over the vocabulary and the shards' top N, never
    # the logits themselves: no collective larger than the plain chunk's.
    scored, plain = reports["serve scored prefill"], reports["serve prefill"]
    assert scored.count <= plain.count + 6
    assert max(c.bytes for c in scored.collectives) == max(c.bytes for c in plain.collectives)
