"""Bad outputs are refused before any work, exports are never replaced unasked, results files are
always valid JSON, and signals end a command with one line and the conventional exit status."""

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from k3text import decode, files, sharding, train
from k3text.checkpoint import store
from k3text.config import CONFIG_DIR, ConfigError, load_config
from k3text.layers.initializers import Init
from k3text.models.decoder import Decoder
from k3text.tools import memory

from helpers import MODELS, ROOT

CPU = str(ROOT / "configs" / "inference" / "cpu.yml")


@pytest.mark.parametrize("target,message", [
    ("{tmp}", "is a directory"),
    ("/proc/k3text-out.jsonl", "cannot write in /proc"),
    ("{tmp}/file.txt/out.jsonl", "is not a directory"),
])
def test_decode_refuses_an_unwritable_output_before_loading_anything(tmp_path, capsys, target,
                                                                     message, monkeypatch):
    (tmp_path / "file.txt").write_text("x")
    built = []
    monkeypatch.setattr(decode, "build", lambda cfg: built.append(cfg))
    rc = decode.main([CPU, f"output_file={target.format(tmp=tmp_path)}", "progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not built
    assert err[-1].startswith("error: output_file") and message in err[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_check_output_file_accepts_new_directories_and_leaves_nothing(tmp_path):
    target = tmp_path / "a" / "b" / "out.jsonl"
    assert files.check_output_file(target) == target
    assert list(tmp_path.iterdir()) == []  # nothing made until the real write
    files.write_atomically(target, lambda f: f.write("{}\n"))
    assert target.read_text() == "{}\n" and sorted(p.name for p in target.parent.iterdir()) \
        == ["out.jsonl"]


def test_results_with_non_finite_numbers_stay_valid_json(tmp_path):
    path = tmp_path / "out.jsonl"
    decode.write_jsonl(str(path), [{"output_logprobs": [-0.5, math.nan, -math.inf],
                                    "nested": {"x": math.inf}}])
    record = json.loads(path.read_text())  # the strict parser: NaN is not JSON
    assert record == {"output_logprobs": [-0.5, None, None], "nested": {"x": None}}


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")

    def broken(f):
        f.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        files.write_atomically(path, broken)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_training_never_replaces_an_export_unasked(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.yml").write_text("kept")
    cfg = load_config(CONFIG_DIR / "train" / "k3-small.yml", [f"export_path={export}"])
    with pytest.raises(ConfigError, match="export_overwrite=true"):
        train.train(cfg)  # refused before the tokenizer, the data or a compile
    assert (export / "model.yml").read_text() == "kept"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        train.check_export_path(cfg.replace(export_path=str(tmp_path / "file"),
                                            export_overwrite=True))
    train.check_export_path(cfg.replace(export_overwrite=True))  # asked for: allowed


def test_the_shipped_model_is_not_the_training_export():
    cfg = load_config(CONFIG_DIR / "train" / "k3-small.yml")
    assert "assets" not in cfg.export_path and not cfg.export_overwrite


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_decode_ends_in_one_line(tmp_path, signum):
    output = tmp_path / "out.jsonl"
    log = tmp_path / "err.txt"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "k3text.decode", CPU,
                                 f"output_file={output}", "max_decode_steps=64",
                                 "ignore_eos=true", "progress=false"],
                                stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 120
        while proc.poll() is None and not log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # the first log line: the command is past its imports
        time.sleep(1.0)
        proc.send_signal(signum)
        proc.wait(timeout=120)
    text = log.read_text()
    assert proc.returncode == 128 + signum, text[-2000:]
    assert "Traceback" not in text
    assert text.strip().splitlines()[-1] == ("k3text.decode: interrupted" if signum ==
                                             signal.SIGINT else "k3text.decode: terminated")
    assert not output.exists() and list(tmp_path.iterdir()) == [log]


# --------------------------------------------------------------------------------------------
# Damaged checkpoints.
# --------------------------------------------------------------------------------------------

DAMAGED = "groups.layers.0.mixer.qkv_proj"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = load_config(MODELS / "k3-tiny.yml")
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    store.save_model(cfg, Decoder(cfg, Init(0)), path)
    return path


def without_checksums(array: Path) -> None:
    """Rewrite an array as checkpoints written before chunk checksums were (the shipped one)."""
    meta = json.loads((array / "zarr.json").read_text())
    meta["codecs"] = [c for c in meta["codecs"] if c["name"] != "crc32c"]
    (array / "zarr.json").write_text(json.dumps(meta))
    for chunk in (array / "c").rglob("*"):
        if chunk.is_file():
            chunk.write_bytes(chunk.read_bytes()[:-4])


def first_chunk(array: Path) -> Path:
    return min(p for p in (array / "c").rglob("*") if p.is_file())


def damage(path: Path, how: str) -> str:
    params = path / store.PARAMS_DIR
    name = "groups.layers.0.mlp.experts.gate_up_scale" if how == "nan scale codes" else DAMAGED
    array = params / name
    rng = np.random.default_rng(0)
    if how == "metadata removed":
        (array / "zarr.json").unlink()
    elif how == "chunk removed":
        first_chunk(array).unlink()
    elif how == "chunk truncated":
        chunk = first_chunk(array)
        chunk.write_bytes(chunk.read_bytes()[:-10])
    elif how == "random bytes":  # checksummed chunks fail their read
        chunk = first_chunk(array)
        chunk.write_bytes(rng.integers(0, 256, chunk.stat().st_size, np.uint8).tobytes())
    elif how == "random bytes, no checksums":  # the value check catches them
        without_checksums(array)
        chunk = first_chunk(array)
        chunk.write_bytes(rng.integers(0, 256, chunk.stat().st_size, np.uint8).tobytes())
    elif how == "nan scale codes":
        without_checksums(array)
        chunk = first_chunk(array)
        chunk.write_bytes(b"\xff" * chunk.stat().st_size)
    return name


@pytest.mark.parametrize("how", ["metadata removed", "chunk removed", "chunk truncated",
                                 "random bytes", "random bytes, no checksums",
                                 "nan scale codes"])
def test_a_damaged_checkpoint_is_one_line_naming_the_array(saved, tmp_path, capsys, how):
    path = Path(shutil.copytree(saved, tmp_path / "ckpt"))
    name = damage(path, how)
    output = tmp_path / "out.jsonl"
    args = [str(MODELS / "k3-tiny.yml"), f"load_parameters_path={path}", "prompt_ids=5,6,7",
            "max_decode_steps=2", "progress=false", f"output_file={output}"]
    if how == "random bytes":  # a failed read inside Orbax: what the process prints up to exit
        done = subprocess.run([sys.executable, "-m", "k3text.decode", *args],
                              capture_output=True, text=True, timeout=300)
        rc, text = done.returncode, done.stderr
        assert "Traceback" not in text, text[-3000:]
    else:
        rc, text = decode.main(args), capsys.readouterr().err
    last = text.strip().splitlines()[-1]
    assert rc == 2 and not output.exists()
    assert last.startswith("error: ") and name in last and "damaged" in last, last


def test_an_undamaged_checkpoint_without_checksums_still_loads(saved, tmp_path):
    path = Path(shutil.copytree(saved, tmp_path / "ckpt"))
    without_checksums(path / store.PARAMS_DIR / DAMAGED)
    cfg = load_config(MODELS / "k3-tiny.yml")
    ctx = sharding.MeshContext(sharding.make_mesh(cfg, jax.devices()[:1]),
                               cfg.logical_axis_rules)
    loaded = nnx.state(store.load_model(cfg, ctx, path))
    expected = nnx.state(Decoder(cfg, Init(0)))
    for (p, a), (_, b) in zip(nnx.to_flat_state(loaded), nnx.to_flat_state(expected),
                              strict=True):
        if "experts" not in p:  # experts were quantised to MXFP4 on the way out
            np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()),
                                          err_msg=str(p))


# --------------------------------------------------------------------------------------------
# Values nobody used to check.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override,message", [
    ("max_decode_steps=0", "'max_decode_steps' must be positive"),
    ("max_decode_steps=-3", "'max_decode_steps' must be positive"),
    ("per_device_batch_size=-1", "'per_device_batch_size' must be positive"),
    ("decode_sampling_top_k=100000", "decode_sampling_top_k must be in [0, vocab_size=512]"),
    ("train_steps=-1", "'train_steps' must be >= 0"),
    ("learning_rate=0", "'learning_rate' must be positive"),
])
def test_invalid_values_are_one_line_errors(capsys, override, message):
    assert decode.main([CPU, override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err[-1]


def test_a_model_with_dense_layers_needs_their_width():
    with pytest.raises(ConfigError, match="'intermediate_size' must be positive"):
        load_config(MODELS / "k3-tiny.yml", ["intermediate_size=0"])


def test_training_needs_more_steps_than_warmup():
    cfg = load_config(CONFIG_DIR / "train" / "k3-small.yml", ["train_steps=2",
                                                              "warmup_steps=5"])
    with pytest.raises(ConfigError, match=r"warmup_steps \(5\) must be below train_steps"):
        train.train(cfg)


@pytest.mark.parametrize("args,message", [
    (["batch=0"], "batch=0: must be at least 1"),
    (["context=0"], "context=0: must be at least 1"),
    (["--hbm-gib", "-1"], "--hbm-gib -1.0: must not be negative"),
])
def test_memory_tool_refuses_meaningless_sizes(capsys, args, message):
    assert memory.main([str(MODELS / "kimi-k3.yml"), *args]) == 2
    assert message in capsys.readouterr().err


def test_warm_up_compiles_what_generate_runs(capsys):
    """The decode summary reports compile time on its own line: `Engine.warm_up` compiles the
    programs and `generate` then compiles nothing, so its timings are the real speed."""
    engine, _ = decode.build(load_config(CPU))
    traced = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, seconds, **kwargs: traced.append(name))
    assert engine.warm_up(4) > 0
    assert "/jax/core/compile/jaxpr_trace_duration" in traced
    traced.clear()
    engine.decode_batch([[5, 6, 7], [8, 9]], batch=4)
    assert not [name for name in traced if "compile" in name]


@pytest.mark.parametrize("content,message", [
    (None, "is a directory"),
    (b'{"prompt_ids": [5, 6]}\n{"prompt": "caf\xe9"}\n', "prompts.jsonl:2: not UTF-8 text"),
])
def test_bad_prompts_files_name_the_file_and_line(tmp_path, capsys, content, message):
    path = tmp_path / "prompts.jsonl"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    assert decode.main([CPU, f"prompts_file={path}", "progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err[-1]


def test_random_weights_are_said_loudly(tmp_path, capsys, caplog):
    config = tmp_path / "empty.yml"
    config.write_text("")
    with caplog.at_level("WARNING", logger="k3text"):
        decode.build(load_config(config))
    assert "decoding RANDOM weights" in caplog.text


def test_a_decode_state_too_large_for_the_device_is_one_line(capsys):
    # 1,000 slots of 2**31 positions: petabytes, beyond any address space (no overcommit).
    rc = decode.main([CPU, "max_target_length=2147483647", "per_device_batch_size=1000",
                      "prompt_ids=5,6,7", "max_decode_steps=2", "progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "GiB per device" in err[-1] and "max_target_length" in err[-1], err[-1]


def test_training_refuses_a_mesh_it_would_ignore():
    cfg = load_config(CONFIG_DIR / "train" / "k3-small.yml", ["ici_tensor_parallelism=2"])
    with pytest.raises(ConfigError, match="runs on one device; it would ignore "
                                          "ici_tensor_parallelism=2"):
        train.train(cfg)
