"""The full-model decode step and prefill chunk compile on a fake mesh, lower for TPU from this
CPU machine, and the full-size K3 check on 32 fake devices reports the report's weight bytes."""

import re
import subprocess
import sys

import jax
import pytest

from k3text import sharding
from k3text.tools import compile_check

from helpers import ROOT, mesh_context, tiny_config


@pytest.mark.parametrize("mode,transport", [("local", "auto"), ("all_to_all", "ragged")])
def test_whole_model_lowers_for_tpu(mode, transport):
    cfg = tiny_config("k3-tiny", "ici_tensor_parallelism=2", "ici_expert_parallelism=4",
                      f"moe_ep_mode={mode}", f"moe_a2a_transport={transport}")
    ctx = mesh_context(cfg)
    with sharding.use_mesh(ctx.mesh, ctx.rules):
        for name, (fn, args) in compile_check.programs(
                compile_check.abstract_inputs(cfg, ctx)).items():
            exported = jax.export.export(fn, platforms=["tpu"], disabled_checks=[
                jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(*args)
            text = exported.mlir_module()
            assert ("ragged_all_to_all" in text) == (transport == "ragged"), name


@pytest.mark.slow
def test_v7x16_full_size_compile_check():
    result = subprocess.run(
        [sys.executable, "-m", "k3text.tools.compile_check",
         str(ROOT / "configs/inference/v7x16.yml")],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    weights = float(re.search(r"weights ([\d.]+) GiB/device", result.stdout)[1])
    assert weights == pytest.approx(45.43, rel=0.002)
    for name in ("decode step", "prefill chunk"):
        line = next(x for x in result.stdout.splitlines() if x.startswith(name))
        argument, temp = (float(v) for v in re.findall(r"(?:argument|temp)\s+([\d.]+)", line))
        assert argument > weights and temp > 0
    # Each program's communication report follows its memory line.
    reports = re.findall(r"collectives per call: ([\d,]+) \(.*?\), ([\d,.]+) MB per device",
                         result.stdout)
    assert len(reports) == 2 and all(int(n.replace(",", "")) > 0 for n, _ in reports)
