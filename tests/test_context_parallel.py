"""Context-parallel prefill (`prefill_context_parallelism`): a prompt's consecutive chunks as the
rows of one call, KDA's conv and state and MLA's keys carried across the rows. It must equal
chunked prefill: the logits at the last token and every part of the final state (KDA recurrent
and conv states, the MLA cache's rows, the length), on one device and on 8 devices with the rows
split over the data axis, in both MoE modes; and decode from it must equal decode from chunked
prefill."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_prefix_cache import greedy_tops, serve  # the in-process scheduler driver

from k3text import sharding
from k3text.config import CONFIG_DIR, ConfigError
from k3text.ops import kda as kda_ops
from k3text.serving.scheduler import SamplingParams
from k3text.tools import collectives, compile_check, memory

from helpers import assert_same_greedy, engine_for, tiny_config

CHUNK = 16


def _config(model: str, *overrides: str):
    return tiny_config(model, "max_prefill_predict_length=112", "max_target_length=128",
                       f"prefill_chunk_size={CHUNK}", f"kda_chunk_size={CHUNK}",
                       "max_decode_steps=8", "ignore_eos=true", *overrides)


def _prompt(cfg, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, cfg.vocab_size, n).tolist()


def _assert_prefixes_equal(got, want, length: int, atol: float = 1e-4) -> None:
    """`got` row 0 (and every other row: each holds the sequence) against `want` row 0."""
    rows = got.logits.shape[0]
    for r in range(rows):
        np.testing.assert_allclose(np.asarray(got.logits[r]), np.asarray(want.logits[0]),
                                   atol=atol, rtol=1e-4, err_msg=f"logits, row {r}")
        for name in ("kda_recurrent", "kda_conv"):
            np.testing.assert_allclose(np.asarray(getattr(got.state, name)[:, r]),
                                       np.asarray(getattr(want.state, name)[:, 0]),
                                       atol=atol, rtol=1e-4, err_msg=f"{name}, row {r}")
        # Cache rows past the prompt are never read (decode overwrites them first).
        np.testing.assert_allclose(np.asarray(got.state.mla_cache[:, r, :length]),
                                   np.asarray(want.state.mla_cache[:, 0, :length]),
                                   atol=atol, rtol=1e-4, err_msg=f"mla_cache, row {r}")
        assert int(got.state.lengths[r]) == int(want.state.lengths[0]) == length


def _recurrence_f64(q, k, v, g, beta, s0):
    """The delta rule token by token in float64 (an independent reference)."""
    q, k, v, g, beta, state = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, s0))
    o = np.zeros(v.shape)
    for t in range(q.shape[1]):
        state = state * np.exp(g[:, t])[..., None]
        error = v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], state)
        state = state + np.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * error)
        o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], state)
    return o, state


@pytest.mark.parametrize("implementation,gates", [
    ("recurrent", "bounded and strong"), ("chunked", "bounded and strong"),
    ("chunked", "bounded"), ("tokamax_mosaic", "bounded")])
def test_rows_as_slices_equal_the_float64_recurrence(implementation, gates, monkeypatch):
    """The op on its own: the delta rule of a sequence cut into 4 rows against the float64
    recurrence over the whole sequence, with an incoming state and the last rows padding.
    Gates at K3's bound, and strong unbounded decays (to -33 per token) where the
    implementation takes them. tokamax's Mosaic kernel runs in Pallas's TPU interpreter, over
    V + K value columns as the slices need."""
    rng = np.random.default_rng(1)
    rows, t, h, dk, dv = 4, 16, 2, 16, 8
    n = rows * t
    q, k = (kda_ops.l2_normalize(jnp.asarray(rng.normal(size=(1, n, h, dk)), jnp.float32))
            for _ in range(2))
    v = jnp.asarray(rng.normal(size=(1, n, h, dv)), jnp.float32)
    bounded = -rng.uniform(0, 5, (1, n, h, dk))
    g = np.where(rng.random((1, n, h, dk)) < 0.3, -5.0, bounded)
    if gates != "bounded":
        g = np.where(rng.random((1, n, h, dk)) < 0.3, -rng.uniform(0, 33, g.shape), g)
    beta = rng.uniform(0, 1, (1, n, h))
    filled = n - t - 3  # the last row padding, the one before it partly
    keep = (np.arange(n) < filled)[None, :]
    g = jnp.asarray(np.where(keep[..., None, None], g, 0.0), jnp.float32)
    beta = jnp.asarray(np.where(keep[..., None], beta, 0.0), jnp.float32)
    s0 = jnp.asarray(rng.normal(size=(1, h, dk, dv)), jnp.float32)
    want_o, want_s = _recurrence_f64(q, k, v, g, beta, s0)

    def op(q, k, v, g, beta, s):
        return kda_ops.prefill(q, k, v, g, beta, implementation=implementation, initial_state=s,
                               chunk_size=CHUNK, gate_lower_bound=-5.0 if gates == "bounded"
                               else None, precision=jax.lax.Precision.HIGHEST)

    split = lambda a: a.reshape(rows, t, *a.shape[2:])  # noqa: E731
    args = (*(split(a) for a in (q, k, v, g, beta)), jnp.repeat(s0, rows, axis=0))

    def run(*args):
        return kda_ops.prefill_across_rows(op, *args, precision=jax.lax.Precision.HIGHEST)

    if implementation == "tokamax_mosaic":
        from jax.sharding import AbstractDevice, AbstractMesh, AxisType
        from tokamax.config import cross_compile

        monkeypatch.setenv("PALLAS_INTERPRET", "1")
        device = AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
        mesh = AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=device)
        with cross_compile(True), jax.sharding.use_abstract_mesh(mesh):
            traced = jax.jit(run).trace(*args)
        got_o, got_s = traced.lower(lowering_platforms=("cpu",)).compile()(*args)
    else:
        got_o, got_s = jax.jit(run)(*args)
    np.testing.assert_allclose(np.asarray(got_o).reshape(1, n, h, dv)[:, :filled],
                               want_o[:, :filled], atol=5e-5, rtol=5e-5)
    for r in range(rows):
        np.testing.assert_allclose(np.asarray(got_s[r]), want_s[0], atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("model", ["k3-tiny", "kimi-linear-tiny"])
@pytest.mark.parametrize("length", [17, 63, 100])
def test_one_device_equals_chunked_prefill(model, length):
    """Lengths ending mid-chunk in the first, a middle and the last row of a call, over 1 and
    2 calls of 4 chunks. The chunked reference prefills into 4 rows too: the same matmul shapes,
    so what differs is only the order of the delta rule's sums (the tokens of the first row
    agree exactly)."""
    chunked = engine_for(_config(model), seed=2)
    parallel = engine_for(_config(model, "prefill_context_parallelism=4"), seed=2)
    prompt = _prompt(chunked.cfg, length)
    assert parallel.context_parallel([prompt]) and not chunked.context_parallel([prompt])
    want = chunked.prefill([prompt], 4)
    got = parallel.prefill([prompt])
    assert got.logits.shape[0] == 4
    _assert_prefixes_equal(got, want, length)


@pytest.fixture(scope="module")
def reference():
    cfg = _config("k3-tiny")
    prompts = [_prompt(cfg, n, seed=n) for n in (100, 40, 9)]
    engine = engine_for(cfg, seed=4)
    prefixes = {rows: engine.prefill(prompts[:1], rows) for rows in (2, 4)}
    return cfg, prompts, prefixes, engine.decode_batch(prompts, batch=4, top_n=2)


@pytest.mark.parametrize("mode,rows", [("local", 2), ("all_to_all", 4)])
def test_eight_devices_equal_one_device_chunked(reference, mode, rows):
    """Rows over data=2 (tensor 2 x expert 2 inside, the MLA cache split over those 4): the
    prefix and the decode after it equal one device's chunked prefill and decode."""
    cfg, prompts, want_prefixes, want = reference
    split = cfg.replace(ici_data_parallelism=2, ici_tensor_parallelism=2,
                        ici_expert_parallelism=2, moe_ep_mode=mode, per_device_batch_size=2,
                        prefill_context_parallelism=rows)
    engine = engine_for(split, seed=4)
    assert engine.ctx.size("batch") == 2 and engine.ctx.size("cache_seq") == 4
    _assert_prefixes_equal(engine.prefill(prompts[:1]), want_prefixes[rows], len(prompts[0]),
                           atol=2e-4)  # 8 devices sum the experts in another order
    # The offline driver's warm-up for prompts prefilled one at a time: every program at every
    # shape decode_batch then runs (the context-parallel prefix's insert included).
    engine.warm_up(4, prefill_batch=engine.ctx.size("batch"))
    warmed = set(engine._shapes_seen)
    got = engine.decode_batch(prompts, batch=4)
    assert engine._shapes_seen == warmed, engine._shapes_seen - warmed
    assert_same_greedy(got.output_ids, want.output_ids, want.output_top_logprobs,
                       got.output_logprobs, want.output_logprobs)


@pytest.mark.parametrize("overrides,message", [
    (["prefill_context_parallelism=0"], "prefill_context_parallelism must be >= 1"),
    (["prefill_context_parallelism=3", "ici_data_parallelism=2"],
     "must be a multiple of the batch mesh axes' size"),
    (["prefill_context_parallelism=2", "prefill_chunk_size=2", "kda_chunk_size=2"],
     "prefill_chunk_size \\(2\\) >= short_conv_kernel_size - 1"),
    (["prefill_context_parallelism=2", "enable_prefix_caching=true"],
     "cannot be combined"),
])
def test_bad_settings_are_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config("k3-tiny", *overrides)


def test_the_compiled_call_moves_only_small_cross_row_arrays():
    """The 8-device context-parallel call (rows over data=2) moves no weight, and what crosses
    the rows per KDA layer is at most 3 small collectives (the conv tails and the slices' state
    maps, never a shift done as all-to-alls); per MLA layer one gather of the call's latents."""
    cfg = _config("k3-tiny", "ici_data_parallelism=2", "ici_tensor_parallelism=2",
                  "ici_expert_parallelism=2", "per_device_batch_size=2",
                  "prefill_context_parallelism=2")
    mesh = sharding.make_mesh(cfg, jax.devices()[:8])
    ctx = sharding.MeshContext(mesh, cfg.logical_axis_rules)
    with sharding.use_mesh(mesh, ctx.rules):
        fn, args = compile_check.programs(compile_check.abstract_inputs(cfg, ctx))[
            "context-parallel prefill"]
        compiled, partitioned = collectives.partitioned_hlo(fn.lower(*args))
    report = collectives.read(compiled.as_text(), partitioned_module=partitioned)
    assert not report.moving_parameters()
    st, lin = cfg.structure, cfg.linear_attn_config
    cross = [c for c in report.collectives if "ops/kda/context_parallel.py" in c.source]
    assert 0 < sum(c.per_call for c in cross) <= 3 * st.num_kda + 1
    assert {c.kind for c in cross} <= {"all-gather", "all-reduce"}
    rows, heads = 2, lin.num_heads // 2
    largest_map = rows * heads * lin.head_dim * 2 * lin.head_dim * 4
    assert max(c.bytes for c in cross) <= largest_map
    latents = [c for c in report.collectives if "MLAAttention.latent" in c.source]
    assert sum(c.per_call for c in latents) == st.num_mla
    assert {c.bytes for c in latents} == {rows * CHUNK * cfg.mla_latent_dim * 4}


def test_the_memory_tool_says_when_it_pays(capsys):
    """v7x16 has one batch shard: it cannot pay there. With 4 data replicas of Kimi Linear a
    100,000-token prompt takes a quarter of the calls, and what a call moves is its latent and
    state-map gathers, computed independently here."""
    assert memory.main([str(CONFIG_DIR / "inference" / "v7x16.yml")]) == 0
    assert "this mesh has one batch shard: a context-parallel call's rows would run one after " \
           "another" in capsys.readouterr().out
    model = str(CONFIG_DIR / "models" / "kimi-linear-tiny.yml")
    assert memory.main([model, "ici_data_parallelism=4", "ici_tensor_parallelism=2",
                        "max_target_length=131072", "prefill_context_parallelism=4",
                        "context=100000"]) == 0
    printed = capsys.readouterr().out
    cfg = tiny_config("kimi-linear-tiny")
    chunk, lin = cfg.prefill_chunk_size, cfg.linear_attn_config
    calls = -(-100_000 // chunk)
    assert f"{calls:,} chunked calls on one batch shard (the other 3 idle" in printed
    assert f"-> {-(-calls // 4):,} context-parallel calls" in printed
    latents = 4 * chunk * cfg.mla_latent_dim * 4 // 1024  # fp32 activations in this config
    assert f"MLA latent gathers of {latents:.2f} KiB" in printed
    maps = 4 * (lin.num_heads // 2) * lin.head_dim * 2 * lin.head_dim * 4 / 1024
    assert f"KDA state-map gathers of {maps:.2f} KiB" in printed


def test_the_scheduler_prefills_long_prompts_context_parallel():
    """Served in-process on 8 devices (rows over data=2): long prompts take the context-parallel
    call, short ones the chunked groups (a group stops at a long prompt), and every
    output equals the same workload served with chunked prefill only (greedy and seeded,
    tokens identical). The default `serve_prefill_batch` (1) is rounded up to the two batch
    shards, and the server's warm-up compiles every program at every shape the workload then
    runs."""
    from k3text.serving.scheduler import prefill_rows

    cfg = _config("k3-tiny", "ici_data_parallelism=2", "ici_tensor_parallelism=2",
                  "ici_expert_parallelism=2", "per_device_batch_size=2",
                  "serve_steps_per_call=2", "serve_prefill_token_budget=32")
    assert cfg.serve_prefill_batch == 1 and prefill_rows(cfg) == 2
    rng = np.random.default_rng(6)
    requests = []
    for n in (100, 5, 40, 17, 64, 3, 90, 33):
        seeded = rng.random() < 0.4
        requests.append((rng.integers(3, cfg.vocab_size, n).tolist(),
                         SamplingParams(max_tokens=int(rng.integers(2, 6)),
                                        temperature=0.8 if seeded else 0.0,
                                        seed=int(rng.integers(1 << 30)) if seeded else None,
                                        logprobs=2, ignore_eos=True)))
    chunked, _ = serve(engine_for(cfg, seed=3), cfg, requests)
    parallel_cfg = cfg.replace(prefill_context_parallelism=2)
    engine = engine_for(parallel_cfg, seed=3)
    engine.warm_up(cfg.global_batch_size, cfg.serve_steps_per_call,
                   prefill_batch=prefill_rows(cfg), top_n=cfg.serve_max_logprobs, serving=True)
    warmed = set(engine._shapes_seen)
    calls = collections.Counter()

    def counting(name):
        call = getattr(engine, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return call(*args, **kwargs)
        return counted

    for name in ("prefill_slices", "prefill_chunk", "dispatch_decode_and_prefill"):
        setattr(engine, name, counting(name))
    parallel, scheduler = serve(engine, parallel_cfg, requests)
    assert ("context-parallel prefill", "2 x 16 tokens") in engine._shapes_seen
    # Every prompt longer than a chunk runs context-parallel, 2 x 16 tokens per call (100, 40,
    # 17, 64, 90, 33 tokens: 4 + 2 + 1 + 2 + 3 + 2 calls), even behind a short one that starts
    # a chunked group; the two short ones (5, 3) run chunked, alone or riding decode calls.
    assert calls["prefill_slices"] == 14, calls
    assert calls["prefill_chunk"] + calls["dispatch_decode_and_prefill"] >= 2, calls
    assert engine._shapes_seen == warmed, engine._shapes_seen - warmed  # nothing compiled late
    assert_same_greedy([b["ids"] for b in parallel], [a["ids"] for a in chunked],
                       greedy_tops(chunked), [b["lps"] for b in parallel],
                       [a["lps"] for a in chunked])
    assert scheduler.metrics.running._value.get() == 0
