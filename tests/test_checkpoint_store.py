"""k3text checkpoints: chunking, save_model (with MXFP4 export), load_model's checks, and the
converter's memory bound."""

import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from k3text.checkpoint import load_model, save_model, store, synthetic
from k3text.checkpoint.safetensors_io import CheckpointError
from k3text.config import ConfigError, load_config
from k3text.layers.initializers import Init
from k3text.models.decoder import Decoder
from k3text.ops.mxfp4 import quantize_mxfp4

from helpers import MODELS, coordinator_port, mesh_context


def test_chunks_tile_every_write_region_and_stay_under_the_cap():
    # Four experts, each written as gate rows [0, 8) and up rows [8, 16).
    regions = [((e, e + 1), (half * 8, half * 8 + 8), (0, 32)) for e in range(4)
               for half in (0, 1)]
    assert store.chunk_shape((4, 16, 32), 1, regions) == (1, 8, 32)
    big = (1 << 14, 1 << 13)  # 256 MiB of bfloat16 written at once
    chunk = store.chunk_shape(big, 2, [((0, big[0]), (0, big[1]))])
    assert np.prod(chunk) * 2 <= store.CHUNK_BYTES and all(b % c == 0 for b, c in
                                                            zip(big, chunk, strict=True))


def _flat(model):
    return {".".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(model))}


def test_save_model_exports_experts_as_mxfp4(tmp_path):
    trained_cfg = load_config(MODELS / "k3-tiny.yml", ["expert_weight_format=bf16"])
    trained = _flat(Decoder(trained_cfg, Init(4)))
    target = load_config(MODELS / "k3-tiny.yml")  # expert_weight_format: mxfp4
    save_model(target, trained, tmp_path / "export")
    cfg = load_config(MODELS / "k3-tiny.yml", [f"load_parameters_path={tmp_path / 'export'}"])
    restored = _flat(load_model(cfg, mesh_context(cfg, 1), tmp_path / "export"))
    for name, value in trained.items():
        if name.endswith((".experts.gate_up", ".experts.down")):
            packed, scale = quantize_mxfp4(value)
            np.testing.assert_array_equal(restored.pop(f"{name}_packed"), packed)
            np.testing.assert_array_equal(restored.pop(f"{name}_scale"), scale)
        else:
            np.testing.assert_array_equal(restored.pop(name), value, err_msg=name)
    assert not restored


def test_save_model_refuses_a_model_of_another_config(tmp_path):
    model = Decoder(load_config(MODELS / "kimi-linear-tiny.yml"), Init(0))
    with pytest.raises(CheckpointError, match="does not match the config"):
        save_model(load_config(MODELS / "k3-tiny.yml"), model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_load_model_checks_the_checkpoint_against_the_config(tmp_path):
    cfg = load_config(MODELS / "kimi-linear-tiny.yml")
    save_model(cfg, Decoder(cfg, Init(0)), tmp_path / "ckpt")
    ctx = mesh_context(cfg, 1)
    other = cfg.replace(rms_norm_eps=1e-6)
    with pytest.raises(ConfigError, match=r"another model: rms_norm_eps = 1e-05"):
        load_model(other, ctx, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.yml").unlink()  # a bare parameter tree: shapes still checked
    wider = cfg.replace(hidden_size=96)
    with pytest.raises(CheckpointError, match=r"embed.table is stored with shape \(128, 64\), "
                                              r"the model config needs \(128, 96\)"):
        load_model(wider, mesh_context(wider, 1), tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="not a k3text checkpoint"):
        load_model(cfg, ctx, tmp_path)


# The converter in its own process, so its peak RSS is its own: a checkpoint several times the
# in-flight budget must not raise the peak by much more than that budget.
_MEASURE = """
import resource, sys
from k3text.checkpoint import convert, store
store.IN_FLIGHT_BYTES = int(sys.argv[3])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert.make_plan(convert.open_source(sys.argv[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert.convert(sys.argv[1], sys.argv[2], progress=False)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""
_PROBE = """base_config: {base}
model_name: rss-probe
vocab_size: 4096
hidden_size: 256
num_hidden_layers: 12
intermediate_size: 512
num_experts: 32
moe_intermediate_size: 256
linear_attn_config:
  kda_layers: [1, 2, 3, 5, 6, 7, 9, 10, 11]
  full_attn_layers: [4, 8, 12]
"""


def test_conversion_memory_stays_bounded(tmp_path):
    (tmp_path / "model.yml").write_text(_PROBE.format(base=MODELS / "kimi-linear-tiny.yml"))
    cfg = load_config(tmp_path / "model.yml")
    synthetic.write_checkpoint(cfg, tmp_path / "hf", shards=4)
    size = sum(f.stat().st_size for f in (tmp_path / "hf").glob("*.safetensors"))
    layer = 3 * 32 * 256 * 256 * 4  # one MoE layer's experts, fp32
    budget = 32 << 20
    assert size > 8 * budget and size > 10 * layer
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "hf"),
                           str(tmp_path / "out"), str(budget)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    growth = int(done.stdout)
    assert growth < budget + layer, f"peak RSS grew {growth / 2**20:.0f} MiB converting " \
                                    f"{size / 2**20:.0f} MiB"


_RESTORE_WORKER = """
import sys
import numpy as np
from flax import nnx
from k3text import sharding
from k3text.checkpoint import load_model, synthetic
from k3text.config import load_config

model_file, ckpt, port, rank = sys.argv[1:]
cfg = load_config(model_file, [f"load_parameters_path={ckpt}", "ici_expert_parallelism=2",
                               "ici_tensor_parallelism=4", "jax_distributed_initialize=true",
                               f"coordinator_address=localhost:{port}", "num_processes=2",
                               f"process_id={rank}"])
sharding.maybe_initialize_distributed(cfg)
import jax
ctx = sharding.MeshContext(sharding.make_mesh(cfg), cfg.logical_axis_rules)
expected = synthetic.random_params(load_config(model_file), seed=3)
shards = 0
for path, var in nnx.to_flat_state(nnx.state(load_model(cfg, ctx, ckpt))):
    array = var.get_value()
    assert not array.is_fully_addressable
    for shard in array.addressable_shards:
        want = expected[tuple(str(p) for p in path)][shard.index]
        np.testing.assert_array_equal(np.asarray(shard.data), want)
        shards += 1
print(jax.process_index(), jax.local_device_count(), shards)
"""


@pytest.mark.slow
def test_restore_across_two_processes(tmp_path):
    import os

    model_file = MODELS / "k3-tiny.yml"
    cfg = load_config(model_file)
    save_model(cfg, synthetic.random_params(cfg, seed=3), tmp_path / "ckpt")
    port = coordinator_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    workers = [subprocess.Popen([sys.executable, "-c", _RESTORE_WORKER, str(model_file),
                                 str(tmp_path / "ckpt"), str(port), str(rank)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for rank in (0, 1)]
    results = [w.communicate(timeout=240) for w in workers]
    for worker, (_, err) in zip(workers, results, strict=True):
        assert worker.returncode == 0, err[-3000:]
    reports = sorted(out.splitlines()[-1].split() for out, _ in results)  # after gloo's lines
    assert [r[:2] for r in reports] == [["0", "4"], ["1", "4"]]
    assert reports[0][2] == reports[1][2] and int(reports[0][2]) > 0  # each checked its half
