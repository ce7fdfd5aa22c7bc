"""The config system: loading, overrides, validation errors, derived structure."""

import subprocess
import sys
from pathlib import Path

import pytest

from k3text.config import (
    ConfigError,
    LayerSpec,
    base_defaults,
    config_from_dict,
    find_scan_plan,
    load_config,
)

from helpers import MODELS, ROOT


def test_every_key_has_a_typed_default_and_models_load():
    for path in MODELS.glob("*.yml"):
        cfg = load_config(path)
        assert cfg.num_hidden_layers == len(cfg.structure.layers)
    assert all(v is not None for v in base_defaults().values())


def test_overrides_nested_keys_and_types():
    cfg = load_config(MODELS / "k3-tiny.yml", ["linear_attn_config.num_heads=8",
                                                "routed_scaling_factor=2", "prompt=123"])
    assert cfg.linear_attn_config.num_heads == 8
    assert cfg.routed_scaling_factor == 2.0 and isinstance(cfg.routed_scaling_factor, float)
    assert cfg.prompt == "123"
    assert "linear_attn_config.num_heads" in cfg.explicit_keys
    # YAML 1.1 reads 1e-3 as text (no dot, no exponent sign): a float key takes it as a number.
    assert load_config(None, ["learning_rate=1e-3"]).learning_rate == 0.001
    with pytest.raises(AttributeError):
        cfg.hidden_size = 3


@pytest.mark.parametrize("override,message", [
    (["hiden_size=3"], "unknown config key 'hiden_size' in the command line (did you mean "
                       "'hidden_size'?)"),
    (["hidden_size=abc"], "config key 'hidden_size' in the command line must be int, got 'abc'"),
    (["scan_layers=1"], "must be bool"),
    (["linear_attn_config.full_attn_layers=[4,14]"], "full_attn_layers [14] out of range"),
    (["ici_tensor_parallelism=4", "linear_attn_config.num_heads=6"],
     "linear_attn_config.num_heads = 6 does not divide over the 'heads' mesh axes (tensor=4"),
    (["ici_tensor_parallelism=3"], "vocab_size = 128 does not divide over the 'vocab' mesh axes"),
    (["ici_tensor_parallelism=2", "per_device_batch_size=2",
      "logical_axis_rules={batch: [data, tensor]}"],
     "logical_axis_rules.batch and logical_axis_rules.vocab both split over tensor"),
    (["moe_ep_mode=ring"], "must be one of ['local', 'all_to_all']"),
    (["num_experts_per_token=99"], "num_experts_per_token (99)"),
    (["hidden_act=situ", "activation_situ_beta=0"], "activation_situ_beta is not set"),
    (["prefill_chunk_size=100"], "multiple of kda_chunk_size"),
    (["kda_chunk_size=48", "prefill_chunk_size=96"], "kda_chunk_size must be a power of two"),
    (["prefill_buckets=[32,16]"], "prefill_buckets must be increasing positive token widths"),
    (["prefill_buckets=[0,16]"], "prefill_buckets must be increasing positive token widths"),
    (["noequals"], "is not of the form key=value"),
    (["return_top_logprobs=21"], "return_top_logprobs must be in [0, 20], got 21"),
    (["serve_max_logprobs=-1"], "serve_max_logprobs must be in [0, 20], got -1"),
])
def test_bad_values_give_one_clear_message(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(MODELS / "kimi-linear-tiny.yml", override)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_expert_divisibility_names_the_key():
    with pytest.raises(ConfigError, match="num_experts = 8 does not divide"):
        load_config(MODELS / "kimi-linear-tiny.yml", ["ici_expert_parallelism=16"])


def test_base_config_chain_and_model_config(tmp_path):
    (tmp_path / "parent.yml").write_text(f"model_config: {MODELS / 'k3-tiny.yml'}\n"
                                         "max_decode_steps: 5\n")
    (tmp_path / "child.yml").write_text("base_config: parent.yml\nmax_decode_steps: 7\n")
    cfg = load_config(tmp_path / "child.yml")
    assert cfg.max_decode_steps == 7 and cfg.model_name == "k3-tiny"
    (tmp_path / "cycle.yml").write_text("base_config: cycle.yml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "cycle.yml")
    (tmp_path / "bad.yml").write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(tmp_path / "bad.yml")


def test_paths_in_files_are_relative_to_the_file(tmp_path, monkeypatch):
    sub = tmp_path / "configs"
    sub.mkdir()
    (sub / "paths.yml").write_text("tokenizer_path: ../assets/tok.model\n"
                                   "output_file: /abs/out.jsonl\n"
                                   "compilation_cache_dir: ~/cache\n")
    monkeypatch.chdir(ROOT)
    cfg = load_config(sub / "paths.yml", ["prompts_file=prompts.jsonl"])
    assert cfg.tokenizer_path == str(tmp_path / "assets" / "tok.model")
    assert cfg.output_file == "/abs/out.jsonl"
    assert cfg.compilation_cache_dir == str(Path.home() / "cache")
    assert cfg.prompts_file == "prompts.jsonl"  # command line: the working directory's
    # `~` on the command line too (a shell leaves it alone after `key=`).
    assert load_config(None, ["output_file=~/o.jsonl"]).output_file == str(Path.home() / "o.jsonl")


def test_checkpoint_model_config_takes_precedence(tmp_path):
    import yaml

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    stored = load_config(ROOT / "configs/inference/cpu.yml").model_dict()  # as a save writes it
    stored.update(hidden_size=96, model_name="stored")
    (ckpt / "model.yml").write_text(yaml.safe_dump(stored))
    cfg = load_config(ROOT / "configs/inference/cpu.yml", [f"load_parameters_path={ckpt}"])
    assert cfg.hidden_size == 96 and cfg.model_name == "stored"
    with pytest.raises(ConfigError, match="'hidden_size=64' on the command line disagrees"):
        load_config(ROOT / "configs/inference/cpu.yml",
                    [f"load_parameters_path={ckpt}", "hidden_size=64"])


def test_k3_structure_and_scan_plan():
    cfg = load_config(MODELS / "kimi-k3.yml")
    st = cfg.structure
    assert (st.num_kda, st.num_mla) == (69, 24)
    assert (st.scan.lead, st.scan.period, st.scan.num_groups, st.scan.trail) == (4, 4, 22, 1)
    assert st.attn_res_blocks == 8
    assert st.layers[0] == LayerSpec("kda", "dense") and st.layers[92] == LayerSpec("mla", "moe")
    assert cfg.intermediate_size == 33792 and cfg.num_shared_experts == 2
    assert cfg.activation_situ_linear_beta == 25.0 and cfg.rms_norm_eps == 1e-5


def test_scan_plan_prefers_most_coverage_then_alignment():
    k, m = LayerSpec("kda", "moe"), LayerSpec("mla", "moe")
    plan = find_scan_plan([k, k, m] * 3 + [k])
    assert (plan.lead, plan.period, plan.num_groups, plan.trail) == (0, 3, 3, 1)
    assert find_scan_plan([k, m]).num_groups == 0


def test_config_from_dict_validates():
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        config_from_dict({"num_key_value_heads": 3})


def test_cli_bad_config_exits_nonzero_with_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "k3text.decode", str(ROOT / "configs/inference/cpu.yml"),
         "max_decode_step=3"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: unknown config key 'max_decode_step' in the command line (did you mean "
        "'max_decode_steps'?)")
