"""The full-model decode step and prefill chunk compile on a fake mesh, lower for TPU from this
CPU machine, and the full-size K3 check on 32 fake devices reports the report's weight bytes."""

import re
import subprocess
import sys

import pytest

from k3text import sharding
from k3text.tools import compile_check

from helpers import ROOT, mesh_context, tiny_config


@pytest.mark.parametrize("mode,transport", [("local", "padded"), ("all_to_all", "auto")])
def test_whole_model_lowers_for_tpu_with_tokamax_kernels(mode, transport):
    """Exported for TPU (an abstract TPU v7x mesh), `auto` picks what a TPU runs: tokamax's
    Mosaic KDA kernels in both programs (the decode step's fused conv + delta rule, the prefill
    chunk's chunked kernel; two kernel calls each, once in the scanned layer group) and the
    ragged all-to-all; with XLA forms forced, no kernel is left, so a fallback cannot hide a
    kernel that never ran."""
    xla_forms = ["kda_implementation=chunked", "kda_decode_implementation=xla"]
    for forms, kernels in (([], 2), (xla_forms, 0)):
        cfg = tiny_config("k3-tiny", "ici_tensor_parallelism=2", "ici_expert_parallelism=4",
                          f"moe_ep_mode={mode}", f"moe_a2a_transport={transport}", *forms)
        ctx = mesh_context(cfg)
        with sharding.use_mesh(ctx.mesh, ctx.rules):
            for name, (fn, args) in compile_check.programs(
                    compile_check.abstract_inputs(cfg, ctx)).items():
                text = compile_check.export_for_tpu(fn, args, ctx.mesh)
                assert text.count("tpu_custom_call") == kernels, name
                assert ("ragged_all_to_all" in text) == (mode == "all_to_all"), name


def test_mxfp4_experts_lower_for_tpu_through_tokamax_grouped_matmul():
    """Experts wide enough for its 128-wide tiles run through tokamax's Pallas TPU grouped matmul
    (gate_up and down: two kernel calls, once in the scanned layer group), the packed MXFP4
    bytes handed to it as float4 values and scales; a forced `grouped` leaves none."""
    wide = ["moe_intermediate_size=128", "routed_expert_hidden_size=128",
            "expert_weight_format=mxfp4", "ici_tensor_parallelism=2", "ici_expert_parallelism=4"]
    for forms, kernels in (([], 2), (["moe_expert_implementation=grouped"], 0)):
        cfg = tiny_config("k3-tiny", *wide, *forms)
        ctx = mesh_context(cfg)
        with sharding.use_mesh(ctx.mesh, ctx.rules):
            for name, (fn, args) in compile_check.programs(
                    compile_check.abstract_inputs(cfg, ctx)).items():
                text = compile_check.export_for_tpu(fn, args, ctx.mesh)
                assert text.count('kernel_name = "pallas_tpu_ragged_dot_gmm"') == kernels, name
                assert ("f4E2M1FN" in text) == bool(kernels), name


@pytest.mark.slow
def test_v7x16_full_size_compile_check():
    """Full K3 on 32 fake devices: compiled per-device bytes and collectives, and both programs
    lowered for TPU with the implementations a TPU runs, carrying tokamax's Mosaic KDA kernels
    (the decode step's fused conv + delta rule, the prefill chunk's chunked kernel) and, in the
    prefill chunk, its grouped matmul over the MXFP4 experts."""
    result = subprocess.run(
        [sys.executable, "-m", "k3text.tools.compile_check",
         str(ROOT / "configs/inference/v7x16.yml"), "--tpu"],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    (decode_kernels, decode_names), (prefill_kernels, prefill_names) = re.findall(
        r"lowers for TPU: [\d.]+ MB of StableHLO, (\d+) Mosaic kernel calls \((.*)\)",
        result.stdout)
    # Batch-1 decode routes 16 slots to 28 held experts: the hit-experts loop, no grouped matmul.
    assert decode_kernels == "2" and "gmm" not in decode_names, result.stdout
    assert prefill_kernels == "4" and "2 x pallas_tpu_ragged_dot_gmm" in prefill_names, \
        result.stdout
    weights = float(re.search(r"weights ([\d.]+) GiB/device", result.stdout)[1])
    # The report's serving stack measured 45.43 GiB with the low-rank down projections split
    # too; k3text keeps them whole (+0.75 GiB) so their outputs need no all-reduce.
    assert weights == pytest.approx(46.18, rel=0.002)
    for name in ("decode step", "prefill chunk"):
        line = next(x for x in result.stdout.splitlines() if x.startswith(name))
        argument, temp = (float(v) for v in re.findall(r"(?:argument|temp)\s+([\d.]+)", line))
        assert argument > weights and temp > 0
    # Each program's communication report follows its memory line; nothing moves a weight.
    assert "!!" not in result.stdout and "<- parameter" not in result.stdout
    reports = re.findall(r"collectives per call: ([\d,]+) = ([\d.]+) per layer \(.*?\), "
                         r"([\d,.]+) MB per device as compiled \(([\d,.]+) MB at the "
                         r"partitioner's dtypes", result.stdout)
    assert len(reports) == 2
    (count, per_layer, _, partitioned), _prefill = reports
    # Batch-1 decode: per layer its output all-reduce, and per MoE layer one gather of the
    # router scores with the latent, the expert combine and the up projection's all-reduce
    # (9.4 GB and 1,765 collectives before the layouts were pinned); per MLA layer the split
    # cache's merge: the query gather, the score maxima, the merged sums reduce-scattered.
    assert int(count) == 371 + 3 * 24 and float(per_layer) < 5
    assert float(partitioned) < 10
    decode = result.stdout.split("\nprefill chunk")[0]
    rows = re.findall(r"^\s+([\d,]+) x (\S+)\s+\S.*?\s([\d.]+)\s+([\d.]+)\s+(\S+)", decode,
                      re.M)
    merge = [r for r in rows if r[4].startswith("ops/mla.py")]
    assert sorted((r[0], r[1]) for r in merge) == [
        ("24", "all-gather"), ("24", "all-reduce"), ("24", "reduce-scatter")]
    # The query, [1, 96 heads, 576] in bf16 (f32 as XLA:CPU compiles it), is the largest: no
    # collective carries more than a few rows of activations, and none any of the cache.
    assert max(float(r[3]) for r in merge) * 1e6 == pytest.approx(96 * 576 * 2, rel=0.01)
    assert rows and max(float(r[2]) for r in rows if r not in merge) * 1e6 <= 64 * 1024


@pytest.mark.slow
def test_v7x16_decodes_4_sequences_of_a_million_tokens():
    """Full K3 on 32 fake devices at 1M tokens of context and 4 sequences: the compiler's
    per-device bytes of the decode step are the weights plus 4 sequences' split decode state
    (1/32 of each MLA cache), and fit a v7x device's 94.74 GiB with the temporaries."""
    result = subprocess.run(
        [sys.executable, "-m", "k3text.tools.compile_check",
         str(ROOT / "configs/inference/v7x16.yml"), "max_target_length=1048576",
         "max_prefill_predict_length=1044480", "per_device_batch_size=4"],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    weights = float(re.search(r"weights ([\d.]+) GiB/device", result.stdout)[1])
    state = float(re.search(r"decode state ([\d.]+) GiB/device", result.stdout)[1])
    # 4 x 1,048,576 positions x 27,648 B / 32 devices, plus 4 sequences' KDA state split 32
    # ways (449 MB each), and the lengths.
    assert state == pytest.approx((4 * 1048576 * 27648 / 32 + 4 * 449372160 / 32) / 2**30,
                                  abs=0.01)
    line = next(x for x in result.stdout.splitlines() if x.startswith("decode step"))
    argument, temp = (float(v) for v in re.findall(r"(?:argument|temp)\s+([\d.]+)", line))
    assert argument == pytest.approx(weights + state, abs=0.02)
    assert argument + temp < 94.74
