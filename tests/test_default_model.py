"""The shipped default model (assets/k3-small, trained by configs/train/k3-small.yml) answers
held-in facts through the decode CLI: with its MXFP4 experts as shipped, with the same experts in
BF16, with its KDA state stored in bfloat16, and on 8 devices in both MoE modes."""

import json

import jax
import pytest

from k3text import corpus, sharding
from k3text.checkpoint import load_model, save_model
from k3text.config import CONFIG_DIR, load_config
from k3text.decode import main

CPU = CONFIG_DIR / "inference" / "cpu.yml"
# Every third fact: all ten relations, 161 prompts.
HELD_IN = corpus.facts(0)[::3]


@pytest.fixture(scope="module")
def held_in_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "held_in.jsonl"
    lines = [json.dumps({"prompt": f.prompt, "expected": f.completion.strip()}) for f in HELD_IN]
    path.write_text("\n".join(lines) + "\n")
    return path


def accuracy(config, held_in_file, tmp_path, *overrides) -> float:
    out = tmp_path / "out.jsonl"
    assert main([str(config), f"prompts_file={held_in_file}", f"output_file={out}",
                 f"per_device_batch_size={len(HELD_IN)}", "progress=false", *overrides]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(HELD_IN)
    return sum(r["correct"] for r in records) / len(records)


def test_shipped_mxfp4_model_answers_held_in_facts(held_in_file, tmp_path):
    cfg = load_config(CPU)
    assert cfg.expert_weight_format == "mxfp4"
    assert accuracy(CPU, held_in_file, tmp_path) >= 0.95


def test_same_model_with_bf16_experts(held_in_file, tmp_path):
    cfg = load_config(CPU)
    ctx = sharding.MeshContext(sharding.make_mesh(cfg, jax.devices()[:1]), cfg.logical_axis_rules)
    bf16 = tmp_path / "bf16"
    save_model(cfg.replace(expert_weight_format="bf16"),
               load_model(cfg, ctx, cfg.load_parameters_path), bf16)
    assert load_config(CPU, [f"load_parameters_path={bf16}"]).expert_weight_format == "bf16"
    assert accuracy(CPU, held_in_file, tmp_path, f"load_parameters_path={bf16}") >= 0.95


def test_same_model_with_a_bfloat16_kda_state(held_in_file, tmp_path):
    assert accuracy(CPU, held_in_file, tmp_path, "kda_state_dtype=bfloat16") >= 0.95


@pytest.mark.parametrize("mode", ["local", "all-to-all"])
def test_on_8_devices(held_in_file, tmp_path, mode):
    config = CONFIG_DIR / "inference" / f"cpu8-{mode}.yml"
    assert load_config(config).num_devices == 8
    assert accuracy(config, held_in_file, tmp_path) >= 0.95


def test_main_command_prints_scored_answers(capsys):
    assert main([str(CPU), "progress=false"]) == 0
    out, err = capsys.readouterr()
    assert out.count("[correct]") >= 19, out  # of the 20 built-in prompts
    assert "accuracy: " in out
    # The built-in prompts fit the narrowest bucket: the driver compiles no other width.
    prefills = [line for line in err.splitlines() if "compiling prefill" in line]
    assert prefills == ["k3text.engine: compiling prefill chunk for 20 x 16 tokens (once per "
                        "shape)"], err
