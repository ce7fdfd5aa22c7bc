"""Operator tools (params, memory, roofline) against the K3 reference numbers (K3_MODEL.md §4).

Byte counts that follow from shapes are pinned exactly; parameter counts to the stated
tolerance; roofline figures to 2%.
"""

import math

import pytest

from k3text.config import CONFIG_DIR, load_config
from k3text.tools import inventory, memory, params, roofline
from k3text.tools.hardware import HARDWARE
from k3text.tools.tables import GiB

K3 = CONFIG_DIR / "models" / "kimi-k3.yml"
TP32 = ["ici_tensor_parallelism=32"]


@pytest.fixture(scope="module")
def k3():
    return load_config(K3)


@pytest.fixture(scope="module")
def k3_tensors(k3):
    return inventory.inventory(k3)


@pytest.fixture(scope="module")
def k3_params(k3, k3_tensors):
    return params.param_report(k3, k3_tensors)


# --------------------------------------------------------------------------------------------
# Parameters.
# --------------------------------------------------------------------------------------------


def test_k3_layer_and_expert_params(k3_params):
    assert k3_params.per_layer("kda") == pytest.approx(443.7e6, abs=0.1e6)
    assert k3_params.per_layer("mla") == pytest.approx(232.2e6, abs=0.1e6)
    assert k3_params.one_routed_expert == pytest.approx(33.03e6, abs=0.1e6)
    assert k3_params.params["kda"] == pytest.approx(30.62e9, rel=1e-3)  # 69 layers
    assert k3_params.params["mla"] == pytest.approx(5.57e9, rel=1e-3)  # 24 layers
    assert k3_params.params["routed_experts"] == pytest.approx(2.7228e12, rel=1e-4)


def test_k3_total_and_active(k3, k3_params):
    assert k3_params.total == pytest.approx(2.7795e12, rel=0.005)
    assert params.active_params(k3, k3_params) == pytest.approx(104.19e9, rel=0.01)
    rest = k3_params.total - k3_params.params["routed_experts"]
    assert rest == pytest.approx(56.7e9, rel=0.01)


def test_k3_stored_bytes_match_the_checkpoint(k3_params):
    """Checkpoint inventory: BF16 105.67 GiB, F32 0.04 GiB, U8 1,347.12 GiB, 1,452.83 in all."""
    by_dtype = {d: b / GiB for d, b in k3_params.bytes_by_dtype.items()}
    assert by_dtype["bfloat16"] == pytest.approx(105.67, abs=0.005)
    assert by_dtype["float32"] == pytest.approx(0.04, abs=0.005)
    assert by_dtype["uint8"] == pytest.approx(1347.12, abs=0.005)
    assert k3_params.stored_bytes / GiB == pytest.approx(1452.83, abs=0.01)
    # 1.560 TB; the 1.553 TB of K3_MODEL.md §4 assumes MXFP4 latent projections (see
    # test_whole_model_step).
    assert k3_params.stored_bytes / 1e12 == pytest.approx(1.560, abs=0.001)


def test_mxfp4_packed_bytes_hold_two_params_and_scales_none(k3_tensors):
    experts = [t for t in k3_tensors if t.component == "routed_experts"]
    assert {t.name.endswith("_packed") for t in experts} == {True, False}  # weights and scales
    for t in experts:
        packed = t.name.endswith("_packed")
        assert t.params == (2 * math.prod(t.shape) if packed else 0)


def test_every_parameter_has_a_component():
    for name in ("kimi-linear-48b-a3b", "kimi-linear-tiny", "k3-tiny"):
        cfg = load_config(CONFIG_DIR / "models" / f"{name}.yml")
        report = params.param_report(cfg)
        assert set(report.params) <= set(inventory.COMPONENTS)
        assert 0 < params.active_params(cfg, report) < report.total


def test_kimi_linear_is_48b_a3b():
    cfg = load_config(CONFIG_DIR / "models" / "kimi-linear-48b-a3b.yml")
    report = params.param_report(cfg)
    assert report.total == pytest.approx(48e9, rel=0.05)
    assert params.active_params(cfg, report) == pytest.approx(3e9, rel=0.05)


# --------------------------------------------------------------------------------------------
# Memory.
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k3_tp32():
    return load_config(K3, TP32)


def test_decode_state_bytes(k3_tp32):
    cost = memory.sequence_cost(k3_tp32, memory.mesh_context(k3_tp32))
    assert cost.rows == 1
    # 24 MLA layers x 576 latent values per token, the positions split over the 32 devices.
    assert cost.per_position * 32 == 24 * 576 * 4 == 55_296
    for dtype, per_token in (("bfloat16", 27_648), ("float8_e4m3fn", 13_824)):
        c = k3_tp32.replace(mla_cache_dtype=dtype)
        assert memory.sequence_cost(c, memory.mesh_context(c)).per_position * 32 == per_token
    shapes = memory.state_shapes(k3_tp32, 1, 1)
    assert shapes.kda_recurrent.size * 4 == 434_110_464  # 69 x 96 x 128 x 128 fp32
    assert shapes.kda_conv.size == 7_630_848  # 69 x 3 x (q, k, v) x 12288
    assert memory.kda_state_per_sequence(k3_tp32) == 434_110_464 + 2 * 7_630_848
    assert cost.kda * 32 == memory.kda_state_per_sequence(k3_tp32)  # heads split 32 ways


def test_kda_state_and_mla_cache_cross_over_near_32k_tokens_at_fp8(k3):
    kda = memory.kda_state_per_sequence(k3)
    assert round(memory.crossover_tokens(kda, 13_824)) == 32_507


def test_k3_weights_per_device_at_tp32(k3_tp32):
    shards = memory.weight_shards(k3_tp32, memory.mesh_context(k3_tp32))
    per_device = sum(s.per_device for s in shards)
    stored = sum(s.tensor.nbytes for s in shards)
    floor = sum(memory.replicated_floor(shards).values())
    assert stored / 32 / GiB == pytest.approx(45.40, abs=0.005)
    # Every tensor is either split 32 ways or whole on every device.
    assert per_device == stored // 32 + floor * 31 // 32
    # With the low-rank down projections whole on every device (base rules), the floor is the
    # report's own stack's 0.81 GiB and the total its measured 46.18 GiB/device.
    assert floor / GiB == pytest.approx(0.81, abs=0.01)
    assert per_device / GiB == pytest.approx(46.18, abs=0.01)
    assert {"mixer.q_a_proj", "mixer.kv_a_proj", "mixer.f_a_proj"} <= set(
        memory.replicated_floor(shards))


def test_v7x16_keeps_the_low_rank_inputs_whole_and_can_split_them_to_45_4_gib():
    # v7x16 keeps the low-rank down projections whole (their outputs then need no all-reduce:
    # tests/test_communication.py); split too, the weights are the serving stack's 45.43 GiB.
    cfg = load_config(CONFIG_DIR / "inference" / "v7x16.yml")
    shards = memory.weight_shards(cfg, memory.mesh_context(cfg))
    assert sum(s.per_device for s in shards) / GiB == pytest.approx(46.18, abs=0.01)
    rules = {name: list(axes) for name, axes in cfg.logical_axis_rules.items()}
    split = cfg.replace(logical_axis_rules={**rules, "lora_in": ["tensor"]})
    shards = memory.weight_shards(split, memory.mesh_context(split))
    assert sum(memory.replicated_floor(shards).values()) < 0.01 * GiB
    assert sum(s.per_device for s in shards) / GiB == pytest.approx(45.43, rel=0.002)


def test_capacity_is_the_largest_that_fits(k3_tp32):
    cost = memory.sequence_cost(k3_tp32, memory.mesh_context(k3_tp32))
    free = 49 * GiB
    positions = memory.cache_positions(k3_tp32, 131_072)
    batch = memory.max_batch(free, cost, positions)
    assert batch * cost.row_bytes(positions) <= free < (batch + 1) * cost.row_bytes(positions)
    context = memory.max_context(k3_tp32, free, cost, 4)
    assert context % k3_tp32.prefill_chunk_size == 0
    assert 4 * cost.row_bytes(context) <= free
    assert 4 * cost.row_bytes(context + k3_tp32.prefill_chunk_size) > free


def test_memory_cli(capsys):
    assert memory.main([str(K3), *TP32, "batch=4", "context=131072"]) == 0
    out = capsys.readouterr().out
    assert "55,296 B" in out and "434,110,464 B" in out and "7,630,848 elements" in out
    assert "32,507" in out
    assert "longest context at batch=4" in out


def test_cli_errors_are_one_line(capsys):
    assert memory.main([str(K3), "ici_tensor_paralelism=32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown config key") and err.count("\n") == 1
    assert memory.main([str(K3), "batch=many"]) == 2
    assert "batch must be an integer" in capsys.readouterr().err
    # A size past float precision was an OverflowError traceback in the arithmetic.
    assert memory.main([str(K3), "context=" + "9" * 310]) == 2
    assert "context must be at most 2**53" in capsys.readouterr().err
    assert roofline.main([str(K3), "context=0"]) == 2
    assert capsys.readouterr().err == "error: context=0: must be at least 1\n"


# --------------------------------------------------------------------------------------------
# Roofline.
# --------------------------------------------------------------------------------------------


V7X_16 = roofline.Machine(HARDWARE["v7x"], 16)


def test_expected_experts_hit():
    assert roofline.expected_experts_hit(896, 16, 1) == pytest.approx(16)
    assert roofline.expected_experts_hit(896, 16, math.inf) == 896
    hits = [roofline.expected_experts_hit(896, 16, b) for b in (1, 8, 64, 512)]
    assert hits == sorted(hits) and hits[-1] < 896


def test_batch1_decode_traffic(k3, k3_tensors):
    bf16 = roofline.grouped(roofline.decode_weight_bytes(k3, k3_tensors, 1))
    mxfp4 = roofline.grouped(roofline.decode_weight_bytes(k3, k3_tensors, 1, "mxfp4"))
    assert bf16["attention"] == pytest.approx(72.4e9, rel=0.02)
    assert bf16["routed experts hit"] == pytest.approx(25.8e9, rel=0.02)
    # With the latent projections as MXFP4 (the report's §5.4 assumption): 130.0 GB, 1.10 ms.
    assert sum(mxfp4.values()) == pytest.approx(130.0e9, rel=0.02)
    assert V7X_16.memory_seconds(sum(mxfp4.values())) == pytest.approx(1.10e-3, rel=0.02)
    # As stored (BF16): 136.99 GB. K3_MODEL.md's 136.3 / 38.1 subtract the MXFP4 size (GB)
    # from the BF16 size in GiB; the BF16 - MXFP4 difference is 6.94 GB, not 6.3.
    latent = [t for t in k3_tensors if t.component == "latent_proj"]
    delta = sum(t.nbytes - roofline.weight_bytes(t, "mxfp4") for t in latent)
    assert sum(bf16.values()) == pytest.approx(sum(mxfp4.values()) + delta)
    assert delta == pytest.approx(6.94e9, rel=1e-3)
    assert bf16["rest"] == pytest.approx(38.1e9, rel=0.02)
    assert sum(bf16.values()) == pytest.approx(136.3e9, rel=0.02)
    assert V7X_16.memory_seconds(sum(bf16.values())) == pytest.approx(1.15e-3, rel=0.02)


def test_whole_model_step(k3, k3_tensors):
    whole = sum(roofline.decode_weight_bytes(k3, k3_tensors, math.inf).values())
    assert whole == sum(t.nbytes for t in k3_tensors)
    assert V7X_16.memory_seconds(whole) == pytest.approx(13.2e-3, rel=0.02)
    # Report §5.4 (latent projections as MXFP4): 1,553 GB, 13.15 ms.
    mxfp4 = sum(roofline.decode_weight_bytes(k3, k3_tensors, math.inf, "mxfp4").values())
    assert mxfp4 == pytest.approx(1553e9, rel=1e-3)
    assert V7X_16.memory_seconds(mxfp4) == pytest.approx(13.15e-3, rel=0.02)


def test_prefill_flops(k3, k3_tensors):
    flops = roofline.weight_flops_per_token(k3, k3_tensors)
    assert flops == pytest.approx(208e9, rel=0.02)
    # Report §5.5: v7x x 16 at 30% MFU, 53,144 tok/s (bf16) and twice that in fp8.
    assert roofline.prefill_tokens_per_second(V7X_16, flops, 0.30) == pytest.approx(53_144,
                                                                                  rel=0.02)
    assert roofline.prefill_tokens_per_second(V7X_16, flops, 0.30, fp8=True) == pytest.approx(
        2 * 53_144, rel=0.02)


def test_attention_flops_and_crossover(k3, k3_tensors):
    weights = roofline.weight_flops_per_token(k3, k3_tensors)
    mla = roofline.mla_decode_attention_flops(k3, 32_768)
    # Report §5.6 counts 2 x 2 x 24 x 96 x 512 x ctx: the latent scores and values only.
    assert mla["scores_latent"] + mla["values"] == pytest.approx(0.155e12, rel=0.02)
    latent_only = roofline.attention_crossover(k3, weights, ("scores_latent", "values"))
    assert latent_only == pytest.approx(45_000, rel=0.02)
    # The 64-wide k_r tail adds 64/1024 to the per-position cost.
    full = roofline.attention_crossover(k3, weights)
    assert full == pytest.approx(latent_only * 1024 / 1088)
    assert roofline.kda_recurrence_flops(k3) == 69 * 96 * 7 * 128 * 128


def test_roofline_cli(capsys):
    assert roofline.main([str(K3), "--hardware", "v7x", "--chips", "16"]) == 0
    out = capsys.readouterr().out
    assert "latent projections as stored (bfloat16)" in out and "E(1-(1-k/E)^B)" in out
    assert "136.99 GB" in out and "1.160 ms" in out
    assert roofline.main([str(K3), "--chips", "16", "--latent-proj-format", "mxfp4"]) == 0
    out = capsys.readouterr().out
    assert "latent projections counted as mxfp4" in out and "130.05 GB" in out


def test_roofline_prices_the_compiled_collectives_with_the_v7x16_band(capsys):
    # The 8-device CPU config's decode step, compiled in this process: 47 all-reduces priced
    # at the chained psum's 16.3-18.8 us, 28 all-gathers across 2.35-18.8 us (of them 8 and 4
    # the split MLA cache's merge).
    config = str(CONFIG_DIR / "inference" / "cpu8-local.yml")
    assert roofline.main([config, "--collectives", "--chips", "16"]) == 0
    out = capsys.readouterr().out.split("Decode step communication")[1]
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    assert rows["all-reduce"][1] == "47" and rows["all-gather"][1] == "28"
    low, high = (float(v) for v in rows["collectives"][2].split("-"))
    assert low == pytest.approx((47 * 16.3 + 28 * 2.35) / 1e3, abs=1e-3)
    assert high == pytest.approx(75 * 18.8 / 1e3, abs=1e-3)
    assert "synthetic" in out and "HBM floor" in out


def test_params_cli(capsys):
    assert params.main([str(K3)]) == 0
    out = capsys.readouterr().out
    assert "443.7 M" in out and "232.2 M" in out and "33.03 M" in out and "104.2 B" in out


def test_paged_cache_holds_30x_the_fixed_slots_for_a_4k_128k_mix():
    # v7x-16 accepting 1M-token requests: fixed slots each reserve 1M positions (56 fit); given
    # out by the page, a mix of 90% 4K and 10% 128K sequences holds ~30x as many (864 B per
    # token per device in bf16 + 13.6 MB of KDA state per sequence: 28.1 MB on average).
    cfg = load_config(CONFIG_DIR / "inference" / "v7x16.yml", ["max_target_length=1048576"])
    ctx = memory.mesh_context(cfg)
    cost = memory.sequence_cost(cfg, ctx)
    shards = memory.weight_shards(cfg, ctx)
    free = HARDWARE["v7x"].hbm_per_device - sum(s.per_device for s in shards)
    fixed = memory.max_batch(free, cost, memory.cache_positions(cfg, 1 << 20))
    full, mix = memory.capacity_mixes(1 << 20).values()
    assert fixed == 56
    assert memory.paged_capacity(free, cost, full, 128) == fixed  # nothing to gain at 1M each
    paged = memory.paged_capacity(free, cost, mix, 128)
    mean = cost.kda + cost.per_position * (0.9 * 4096 + 0.1 * 131072)
    assert paged == math.floor(free / mean) == 1826
    assert paged >= 20 * fixed
    # The recurrent state in bf16 halves its 13.1 MB per device: 1.31x more sequences.
    bf16 = memory.with_recurrent_dtype(cfg, ctx, cost, "bfloat16")
    assert bf16.kda == cost.kda - 434_110_464 // 32 // 2
    assert memory.paged_capacity(free, bf16, mix, 128) == 2395
    # Whole pages: a 4,097-token sequence holds 33 pages of 128 tokens.
    assert memory.paged_positions(((1.0, 4097),), 128) == 4096 + 128
