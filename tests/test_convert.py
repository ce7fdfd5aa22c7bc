"""Checkpoint conversion (Hugging Face safetensors -> k3text) and loading, end to end.

transformers' `save_pretrained`, a synthesized K3 checkpoint and the k3-tiny fixture go through
the converter CLI and `python -m k3text.decode`; the name tables are held to each other in both
directions; the K3 inventory is reproduced from its config; converted checkpoints restore
slice by slice on 1 and 8 devices.
"""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

from k3text.checkpoint import convert, hf, hf_config, load_model, names, synthetic
from k3text.config import MODEL_KEYS, ConfigError, config_from_dict, load_config
from k3text.decode import main as decode_main
from k3text.inference.engine import Engine

from helpers import MODELS, ROOT, assert_same_greedy, mesh_context

FIXTURE = Path(os.environ.get("K3TEXT_FIXTURES", ROOT.parent / "shared" / "fixtures")) / "k3-tiny"
CPU = ROOT / "configs" / "inference" / "cpu.yml"
EXACT = ["dtype=float32", "matmul_precision=highest", "progress=false"]


def run_convert(capsys, *args):
    rc = convert.main([*map(str, args), "--no-progress"])
    out, err = capsys.readouterr()
    return rc, out, err


def decode(config, checkpoint, prompts, workdir, *overrides):
    """Records of `python -m k3text.decode CONFIG load_parameters_path=... prompts_file=...`."""
    prompts_file, output = workdir / "prompts.jsonl", workdir / "out.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    load = [f"load_parameters_path={checkpoint}"] if checkpoint else []
    assert decode_main([str(config), *load, f"prompts_file={prompts_file}",
                        f"output_file={output}", "return_log_prob=true", "ignore_eos=true",
                        "decode_sampling_strategy=greedy", *EXACT, *overrides]) == 0
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["prompt_ids"] for r in records] == [list(p) for p in prompts]
    return records


# --------------------------------------------------------------------------------------------
# Name tables and config.json, both directions.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model,layout", [("k3-tiny", "k3"), ("kimi-linear-tiny", "moonshot"),
                                          ("kimi-linear-tiny", "transformers")])
def test_reverse_then_forward_name_table_is_identity(model, layout):
    cfg = load_config(MODELS / f"{model}.yml")
    params = synthetic.random_params(cfg, seed=3)
    tensors = list(hf.hf_tensors(cfg, params, layout))
    assert len({n for n, _ in tensors}) == len(tensors)
    back = hf.params_from_tensors(cfg, tensors, layout)
    assert back.keys() == params.keys()
    for path, value in params.items():
        np.testing.assert_array_equal(back[path], value, err_msg=".".join(path))


@pytest.mark.parametrize("model", ["kimi-k3", "k3-tiny", "kimi-linear-tiny",
                                   "kimi-linear-48b-a3b"])
def test_config_json_reads_back_to_the_same_model(model):
    cfg = load_config(MODELS / f"{model}.yml")
    layout = names.default_layout(cfg)
    back = config_from_dict(hf_config.model_keys(hf_config.config_json(cfg, layout)))
    assert {k: back[k] for k in MODEL_KEYS} == {k: cfg[k] for k in MODEL_KEYS}


def test_kimi_k3_inventory_from_its_config_alone(capsys):
    inv = convert.expected_inventory(load_config(MODELS / "kimi-k3.yml"), "k3")
    # K3_MODEL.md §3.2: 2,460 non-expert tensors, 2,367 once gate+up are fused; k3text also
    # fuses each KDA layer's q/k/v projections and convs (69 x (6 -> 2)) and splits each MLA
    # kv_b_proj in two (24 x (1 -> 2)).
    assert (inv.text, inv.non_expert, inv.non_expert_fused, inv.expert, inv.expert_stacked) \
        == (497_052, 2_460, 2_367 - 69 * 4 + 24, 494_592, 368)
    assert inv.tensors_by_dtype == {"BF16": 1_954, "F32": 506, "U8": 494_592}
    gib = {k: round(v / 2**30, 2) for k, v in inv.bytes_by_dtype.items()}
    assert gib == {"BF16": 105.67, "F32": 0.04, "U8": 1347.12}
    assert convert.main(["--model-config", str(MODELS / "kimi-k3.yml"), "--dry-run"]) == 0
    assert "497,052" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# End to end: convert, then decode with the CLI.
# --------------------------------------------------------------------------------------------


def test_transformers_save_pretrained_decodes_like_generate(tmp_path, capsys):
    import torch

    from hf_reference import hf_logits, tiny_hf_model

    model = tiny_hf_model(seed=11, num_hidden_layers=4, full_attn_layers=[2, 4])
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path / "hf")
    rc, _, err = run_convert(capsys, "--hf-dir", tmp_path / "hf", "--out", tmp_path / "k3text")
    assert rc == 0, err
    steps = 8
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 96, n).tolist() for n in (3, 20, 66)]
    records = decode(CPU, tmp_path / "k3text", prompts, tmp_path, f"max_decode_steps={steps}",
                     "max_prefill_predict_length=128", "max_target_length=160",
                     "per_device_batch_size=3")
    for i, (prompt, record) in enumerate(zip(prompts, records, strict=True)):
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), do_sample=False,
                                    max_new_tokens=steps, pad_token_id=0)[0, len(prompt):]
        theirs = theirs.tolist()
        # Token equality is only meaningful where the reference's choice is not a near-tie.
        logits = hf_logits(model, np.asarray([prompt + theirs]))[0, len(prompt) - 1: -1]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        margins = top2[:, 1] - top2[:, 0]
        clear = int(np.argmax(margins < 1e-3)) if (margins < 1e-3).any() else steps
        assert clear >= 3, f"prompt {i}: reference has a near-tie at step {clear}"
        assert record["output_ids"][:clear] == theirs[:clear], f"prompt {i}"
        expected = jax.nn.log_softmax(logits, axis=-1)[np.arange(steps), theirs]
        np.testing.assert_allclose(record["output_logprobs"][:clear], expected[:clear],
                                   atol=1e-4, err_msg=f"prompt {i}")


SMALL_K3 = f"""base_config: {MODELS / 'k3-tiny.yml'}
model_name: k3-small
num_hidden_layers: 5
linear_attn_config:
  kda_layers: [1, 2, 3]
  full_attn_layers: [4, 5]
"""
PROMPTS = [[5, 17, 40], [9] * 70, [3]]
DECODE = ["max_decode_steps=6", "max_prefill_predict_length=128", "max_target_length=160",
          "per_device_batch_size=3"]


def synthesize_and_convert(root, model_config, seed=5, shards=3, layout=None):
    """A random HF checkpoint of `model_config` (the test-checkpoint tool), converted."""
    extra = ["--layout", layout] if layout else []
    assert synthetic.main(["--model-config", str(model_config), "--out", str(root / "hf"),
                           "--seed", str(seed), "--shards", str(shards), *extra]) == 0
    (root / "hf" / "tiktoken.model").write_text("tokenizer of this checkpoint\n")
    assert convert.main(["--hf-dir", str(root / "hf"), "--out", str(root / "k3text"),
                         "--model-config", str(model_config), "--no-progress"]) == 0
    return root


@pytest.fixture(scope="module")
def small_k3(tmp_path_factory):
    """A random 5-layer K3 (every K3 feature, MXFP4 experts) in the released layout, converted,
    and its greedy decode through the CLI on one device."""
    root = tmp_path_factory.mktemp("small_k3")
    (root / "model.yml").write_text(SMALL_K3)
    synthesize_and_convert(root, root / "model.yml")
    records = decode(root / "model.yml", root / "k3text", PROMPTS, root, *DECODE)
    return root, records


def test_synthetic_k3_checkpoint_is_in_the_released_layout(small_k3):
    root, _ = small_k3
    config = json.loads((root / "hf" / "config.json").read_text())
    assert config["model_type"] == "kimi_k3"
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    index = json.loads((root / "hf" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) == 3 and all((root / "hf" / s).is_file() for s in shards)
    assert "language_model.model.layers.1.block_sparse_moe.experts.15.w3.weight_scale" in \
        index["weight_map"]
    assert set(synthetic.VISION_TENSORS) <= index["weight_map"].keys()


def test_synthetic_k3_decodes_like_the_same_weights_in_memory(small_k3, tmp_path):
    root, converted = small_k3
    in_memory = decode(root / "model.yml", None, PROMPTS, tmp_path, "init_seed=5", *DECODE)
    for ours, reference in zip(converted, in_memory, strict=True):
        assert ours["output_ids"] == reference["output_ids"]
        np.testing.assert_allclose(ours["output_logprobs"], reference["output_logprobs"],
                                   atol=1e-6)


def test_fixture_decodes_to_its_golden_tokens(tmp_path, capsys):
    if not FIXTURE.is_dir():
        pytest.skip(f"k3-tiny fixture not found at {FIXTURE} (set K3TEXT_FIXTURES)")
    golden = json.loads((FIXTURE / "golden.json").read_text())
    rc, out, _ = run_convert(capsys, "--hf-dir", FIXTURE, "--dry-run")
    assert rc == 0 and "ok: the checkpoint matches" in out, out
    rc, _, err = run_convert(capsys, "--hf-dir", FIXTURE, "--out", tmp_path / "k3text")
    assert rc == 0, err
    cases = golden["cases"]
    assert min(min(c["top1_top2_margins"]) for c in cases) > 0.01
    records = decode(CPU, tmp_path / "k3text", [c["prompt_ids"] for c in cases], tmp_path,
                     f"max_decode_steps={golden['steps']}", "max_prefill_predict_length=128",
                     "max_target_length=160", f"per_device_batch_size={len(cases)}")
    for case, record in zip(cases, records, strict=True):
        assert record["output_ids"] == case["output_ids"]
        np.testing.assert_allclose(record["output_logprobs"], case["output_logprobs"],
                                   atol=1e-4)


# --------------------------------------------------------------------------------------------
# Restore on 1 and 8 devices.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model,layout", [("k3-tiny", None), ("kimi-linear-tiny", "moonshot"),
                                          ("kimi-linear-tiny", "transformers")])
def test_converted_parameters_are_the_written_ones(tmp_path, model, layout):
    synthesize_and_convert(tmp_path, MODELS / f"{model}.yml", seed=2, layout=layout)
    cfg = load_config(MODELS / f"{model}.yml", [f"load_parameters_path={tmp_path / 'k3text'}"])
    restored = load_model(cfg, mesh_context(cfg, 1), tmp_path / "k3text")
    # The tokenizer travels with the checkpoint.
    assert (tmp_path / "k3text" / "tiktoken.model").read_text() == "tokenizer of this checkpoint\n"
    expected = synthetic.random_params(load_config(MODELS / f"{model}.yml"), seed=2)
    state = nnx.to_flat_state(nnx.state(restored))
    assert len(state) == len(expected)
    for path, var in state:
        np.testing.assert_array_equal(np.asarray(var.get_value()),
                                      expected[tuple(str(p) for p in path)],
                                      err_msg=hf.param_name(path))


@pytest.mark.parametrize("mesh", [
    ["ici_expert_parallelism=2", "ici_tensor_parallelism=4"],
    ["ici_data_parallelism=2", "ici_tensor_parallelism=2", "ici_expert_parallelism=2"],
])
def test_restore_puts_every_slice_on_its_device(small_k3, mesh):
    root, _ = small_k3
    cfg = load_config(root / "model.yml", [f"load_parameters_path={root / 'k3text'}", *mesh])
    expected = synthetic.random_params(load_config(root / "model.yml"), seed=5)
    model = load_model(cfg, mesh_context(cfg), root / "k3text")
    for path, var in nnx.to_flat_state(nnx.state(model)):
        array, want = var.get_value(), expected[tuple(str(p) for p in path)]
        assert array.sharding.num_devices == 8
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index],
                                          err_msg=hf.param_name(path))


def test_restored_model_decodes_identically_on_8_devices(small_k3):
    root, one_device = small_k3
    cfg = load_config(root / "model.yml", [
        f"load_parameters_path={root / 'k3text'}", "ici_expert_parallelism=2",
        "ici_tensor_parallelism=4", "ignore_eos=true", *EXACT, *DECODE])
    ctx = mesh_context(cfg)
    engine = Engine(cfg, load_model(cfg, ctx, root / "k3text"), ctx)
    eight = engine.decode_batch(PROMPTS, batch=cfg.global_batch_size, top_n=2)
    assert_same_greedy(eight.output_ids, [r["output_ids"] for r in one_device],
                       eight.output_top_logprobs, eight.output_logprobs,
                       [r["output_logprobs"] for r in one_device])


# --------------------------------------------------------------------------------------------
# The checkpoint's model config.
# --------------------------------------------------------------------------------------------


def test_checkpoint_model_config_takes_precedence(small_k3):
    root, _ = small_k3
    cfg = load_config(CPU, [f"load_parameters_path={root / 'k3text'}"])
    # cpu.yml names the shipped k3-small (vocabulary 512); the checkpoint's model wins.
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.model_name) == (160, 5, "k3-small")
    with pytest.raises(ConfigError, match=r"'vocab_size=260' on the command line disagrees.*"
                                          r"vocab_size = 160"):
        load_config(CPU, [f"load_parameters_path={root / 'k3text'}", "vocab_size=260"])
    stored = yaml.safe_load((root / "k3text" / "model.yml").read_text())
    assert stored["expert_weight_format"] == "mxfp4"


def test_model_config_disagreeing_with_config_json_names_every_key(small_k3, tmp_path,
                                                                   capsys):
    root, _ = small_k3
    other = tmp_path / "other.yml"
    other.write_text(f"base_config: {root / 'model.yml'}\nhidden_size: 96\n"
                     "num_experts: 32\n")
    rc, _, err = run_convert(capsys, "--hf-dir", root / "hf", "--out", tmp_path / "o",
                             "--model-config", other)
    assert rc == 2 and not (tmp_path / "o").exists()
    [line] = err.strip().splitlines()
    assert "on 2 model key(s)" in line
    assert "hidden_size: 96 vs 64" in line and "num_experts: 32 vs 16" in line
