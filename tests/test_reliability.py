"""Bad outputs are refused before any work, exports are never replaced unasked, results files are
always valid JSON, and signals end a command with one line and the conventional exit status."""

import asyncio
import json
import math
import os
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
from k3text.checkpoint import convert, store, synthetic
from k3text.config import CONFIG_DIR, ConfigError, load_config
from k3text.inference.engine import build_engine
from k3text.layers.initializers import Init
from k3text.models.decoder import Decoder
from k3text.tools import cli, compile_check, memory, params, roofline

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
    monkeypatch.setattr(decode, "build_engine", lambda cfg: built.append(cfg))
    rc = decode.main([CPU, f"output_file={target.format(tmp=tmp_path)}", "progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not built
    assert err[-1].startswith("error: output_file") and message in err[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_a_staged_directory_replaces_what_a_link_points_to_and_keeps_the_link(tmp_path):
    target, link = tmp_path / "v1", tmp_path / "current"
    target.mkdir()
    (target / "old").write_text("old")
    link.symlink_to(target)
    with files.staged_directory(link, replace=True) as (staging, staged):
        (staging / "new").write_text("new")
    assert staged.completed and link.is_symlink() and link.resolve() == target
    assert sorted(p.name for p in target.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "v1"]  # nothing left


def test_check_output_file_accepts_new_directories_and_leaves_nothing(tmp_path):
    target = tmp_path / "a" / "b" / "out.jsonl"
    assert files.check_output_file(target) == target
    assert list(tmp_path.iterdir()) == []  # nothing made until the real write
    files.write_atomically(target, lambda f: f.write("{}\n"))
    assert target.read_text() == "{}\n" and sorted(p.name for p in target.parent.iterdir()) \
        == ["out.jsonl"]


def test_an_atomic_write_keeps_modes_and_links_as_open_would(tmp_path):
    old_mask = os.umask(0o027)
    try:
        new = tmp_path / "new.jsonl"
        files.write_atomically(new, lambda f: f.write("a\n"))
        assert new.stat().st_mode & 0o777 == 0o640  # 0666 less the umask
        kept = tmp_path / "kept.jsonl"
        kept.write_text("old\n")
        kept.chmod(0o600)
        files.write_atomically(kept, lambda f: f.write("b\n"))
        assert kept.stat().st_mode & 0o777 == 0o600 and kept.read_text() == "b\n"
    finally:
        os.umask(old_mask)
    real, link = tmp_path / "runs" / "latest.jsonl", tmp_path / "out.jsonl"
    real.parent.mkdir()
    real.write_text("old\n")
    link.symlink_to(real)
    assert files.check_output_file(link) == real
    files.write_atomically(link, lambda f: f.write("c\n"))
    assert link.is_symlink() and real.read_text() == "c\n"
    assert sorted(p.name for p in real.parent.iterdir()) == ["latest.jsonl"]


def test_results_never_replace_a_file_that_appeared_meanwhile(tmp_path, capsys, monkeypatch):
    """output_file is checked before any work; a file someone else wrote there while the decode
    ran is kept, and the results go beside it, named."""
    out = tmp_path / "out.jsonl"
    build = decode.build_engine

    def building_meanwhile(cfg):
        out.write_text("someone else's\n")
        return build(cfg)

    monkeypatch.setattr(decode, "build_engine", building_meanwhile)
    assert decode.main([CPU, f"output_file={out}", "progress=false", "builtin_prompts=false",
                        "prompt_ids=5,6", "max_decode_steps=2", "per_device_batch_size=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    [beside] = [p for p in tmp_path.iterdir() if p != out]
    assert err == (f"error: {out} appeared while this command ran and is kept; the output was "
                   f"written to {beside} instead")
    assert out.read_text() == "someone else's\n"
    assert json.loads(beside.read_text())["prompt_ids"] == [5, 6]


def test_a_failed_swap_puts_the_old_directory_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    replace, calls = os.replace, []

    def failing_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return replace(src, dst)

    with pytest.raises(OSError, match="Input/output error"):
        with files.staged_directory(out, replace=True) as (staging, _):
            (staging / "new").write_text("new")
            monkeypatch.setattr(os, "replace", failing_second)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "old").read_text() == "old"


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


def test_an_export_replaces_only_a_checkpoint_and_keeps_the_tokenizer_out(tmp_path):
    export = tmp_path / "results"
    export.mkdir()
    (export / "notes.txt").write_text("kept")
    cfg = load_config(CONFIG_DIR / "train" / "k3-small.yml",
                      [f"export_path={export}", "export_overwrite=true", "checkpoint_dir="])
    with pytest.raises(ValueError, match="neither empty nor a checkpoint .* "
                                         "export_overwrite=true replaces only a checkpoint"):
        train.train(cfg)
    assert [p.name for p in export.iterdir()] == ["notes.txt"]
    with pytest.raises(ConfigError, match="export_path .* and tokenizer_path .* overlap"):
        train.check_checkpoint_dir(cfg.replace(export_path=str(tmp_path / "new"),
                                               tokenizer_path=str(tmp_path / "new" / "tok")))


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
                                 "ignore_eos=true", "progress=false",
                                 # compiled in every run: still at work a second later
                                 "compilation_cache_dir="],
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


@pytest.mark.parametrize("moment", ["first drawing", "closing"])
def test_a_signal_as_a_progress_bar_draws_leaves_its_line_finished(monkeypatch, moment):
    """A command preempted right after its bar's first drawing (or signalled inside the bar's
    close) is unwound with the bar's line finished, so its last line ("interrupted; ...")
    stands on a line of its own. The signal lands inside the write itself."""

    class Stderr:
        def __init__(self) -> None:
            self.text, self.writes = "", 0

        def write(self, s: str) -> int:
            self.text += s
            self.writes += bool(s)
            if self.writes == {"first drawing": 1, "closing": 3}[moment]:
                signal.raise_signal(signal.SIGINT)
            return len(s)

        def flush(self) -> None:
            pass

    stderr = Stderr()
    monkeypatch.setattr(sys, "stderr", stderr)
    with pytest.raises(KeyboardInterrupt), files.unwinding_signals():
        with files.progress_bar(total=4, desc="converting", mininterval=0) as bar:
            bar.update(1)  # the second drawing
    assert stderr.writes >= {"first drawing": 1, "closing": 3}[moment]
    assert stderr.text.startswith("\rconverting:") and stderr.text.endswith("\n"), \
        repr(stderr.text)


def test_a_sigterm_inside_an_event_loop_callback_still_ends_the_command(capsys):
    # Orbax restores through asyncio, and asyncio logs and drops any exception a callback raises
    # except SystemExit and KeyboardInterrupt: a SIGTERM landing there must not be swallowed
    # (the task the callback would have woken then waits forever).
    async def restore() -> None:
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def callback() -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # handled before the next line runs
            woken.set_result(None)

        loop.call_soon(callback)
        await asyncio.wait_for(woken, timeout=10)

    rc = cli.main([CPU], "k3text.decode", "", lambda cfg: asyncio.run(restore()))
    assert rc == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "k3text.decode: terminated" and "Traceback" not in err


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


@pytest.mark.parametrize("content", ["", "{", '{"tree_metadata": 3}'])
def test_a_damaged_parameter_tree_is_one_line_naming_its_file(saved, tmp_path, capsys,
                                                               content):
    path = Path(shutil.copytree(saved, tmp_path / "ckpt"))
    (path / store.PARAMS_DIR / "_METADATA").write_text(content)
    rc = decode.main([str(MODELS / "k3-tiny.yml"), f"load_parameters_path={path}",
                      "prompt_ids=5,6,7", "max_decode_steps=2", "progress=false"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith(f"error: {path / store.PARAMS_DIR / '_METADATA'}: "
                                       f"damaged"), last


@pytest.mark.parametrize("content", ["", "# nothing\n", "hidden_size: 64\n"])
def test_a_checkpoint_model_file_without_its_keys_is_one_line(saved, tmp_path, capsys, content):
    """An empty, comment-only or partial model.yml is a damaged checkpoint, said before any
    weight is read (not a model of base.yml's defaults, nor a traceback)."""
    path = Path(shutil.copytree(saved, tmp_path / "ckpt"))
    (path / "model.yml").write_text(content)
    rc = decode.main([str(MODELS / "k3-tiny.yml"), f"load_parameters_path={path}",
                      "prompt_ids=5,6,7", "max_decode_steps=2", "progress=false"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith(f"error: {path / 'model.yml'} lacks"), last


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
    ("mla_key_block=0", "'mla_key_block' must be positive"),
    ("moe_dense_threshold=-1", "'moe_dense_threshold' must be >= 0"),
    ("weight_decay=-0.1", "'weight_decay' must be >= 0"),
    ("grad_clip=-1", "'grad_clip' must be positive"),
    ("num_processes=-1", "'num_processes' must be >= 0"),
    ("process_id=-5", "'process_id' must be >= 0, or -1 (from the environment), got -5"),
    ("per_device_batch_size=1.5", "per_device_batch_size (1.5) x data shards (1) must be a "
                                  "whole number of sequences, got 1.5"),
])
def test_invalid_values_are_one_line_errors(capsys, override, message):
    assert decode.main([CPU, override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err[-1]


def test_distributed_keys_left_unset_are_read_from_the_environment(monkeypatch):
    """With a coordinator address, `num_processes` 0 and `process_id` -1 reach
    `jax.distributed.initialize` as None (its "detect from the environment"), not as values it
    rejects; a process index past the job's size is a config error. Every initialised process
    traces with short locations and keys its compilation cache by them, and on the CPU compiles
    without the cache (sharding.py says why); the settings are recorded here, not applied, since
    they would outlive this test."""
    calls, settings = [], {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(jax.config, "update", lambda name, value: settings.update({name: value}))
    job = ["jax_distributed_initialize=true", "coordinator_address=10.0.0.1:1234",
           "jax_cpu_collectives=none"]
    for keys, expected in (([], (None, None)), (["num_processes=4"], (4, None)),
                           (["num_processes=4", "process_id=3"], (4, 3))):
        sharding.maybe_initialize_distributed(load_config(CPU, [*job, *keys]))
        assert (calls[-1]["num_processes"], calls[-1]["process_id"]) == expected
        assert calls[-1]["coordinator_address"] == "10.0.0.1:1234"
    sharding.maybe_initialize_distributed(load_config(CPU, job[:1] + job[2:]))
    assert calls[-1] == {}
    assert settings == {"jax_include_full_tracebacks_in_locations": False,
                        "jax_compilation_cache_include_metadata_in_key": True,
                        "jax_enable_compilation_cache": False}  # on the CPU
    with pytest.raises(ConfigError, match=r"'process_id' \(4\) must be below num_processes "
                                          r"\(4\)"):
        load_config(CPU, ["num_processes=4", "process_id=4"])


@pytest.mark.parametrize("override,message", [
    ("num_expert_group=0", "'num_expert_group' must be positive, got 0"),
    ("q_lora_rank=-4", "'q_lora_rank' must be >= 0"),
    ("attn_res_block_size=-2", "'attn_res_block_size' must be >= 0"),
    ("routed_expert_hidden_size=-32", "'routed_expert_hidden_size' must be >= 0"),
    ("rms_norm_eps=0", "'rms_norm_eps' must be positive"),
    ("eos_token_id=160", "'eos_token_id' must be a token id in [0, vocab_size=160), got 160"),
])
def test_invalid_model_values_are_one_line_errors_in_the_tools(capsys, override, message):
    """The model keys (which a checkpoint's own config would overrule in decode) through an
    operator tool, which used to print a parameter count for a negative width."""
    assert params.main([str(MODELS / "k3-tiny.yml"), override]) == 2
    out, err = capsys.readouterr()
    err = err.strip().splitlines()
    assert not out and len(err) == 1 and err[0].startswith("error: config key ") \
        and message in err[0], err


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
    engine, _ = build_engine(load_config(CPU))
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


def test_a_prompts_file_may_begin_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt_ids": [5, 6]}\n{"prompt_ids": [7]}\n')
    requests = decode.read_prompts_file(str(path), None, load_config(CPU))
    assert [r.prompt_ids for r in requests] == [(5, 6), (7,)]


@pytest.mark.parametrize("item", ["prompt=", "prompt_ids= ", "prompts_file="])
def test_an_empty_prompt_key_is_an_error_not_the_builtin_set(capsys, item):
    assert decode.main([CPU, item, "progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "is empty on the command line" in err[-1], err


def test_random_weights_are_said_loudly(tmp_path, capsys, caplog):
    config = tmp_path / "empty.yml"
    config.write_text("")
    with caplog.at_level("WARNING", logger="k3text"):
        build_engine(load_config(config))
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


# --------------------------------------------------------------------------------------------
# The other command lines given what a new user might give them.
# --------------------------------------------------------------------------------------------

TOOLS = {"params": params.main, "memory": memory.main, "roofline": roofline.main,
         "compile_check": compile_check.main, "train": train.main}


def bad_config(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A config path that is not a usable YAML file, and what its error line must say."""
    if kind == "a directory":
        (tmp_path / "configs").mkdir()
        return tmp_path / "configs", "is a directory; give a YAML file"
    if kind == "not UTF-8":
        (tmp_path / "bad.yml").write_bytes(b"hidden_size: 64\n\xff\xfe\n")
        return tmp_path / "bad.yml", "bad.yml: not UTF-8 text"
    if kind == "base_config a directory":
        (tmp_path / "configs").mkdir()
        (tmp_path / "bad.yml").write_text("base_config: configs\n")
        return tmp_path / "bad.yml", "configs is a directory"
    (tmp_path / "bad.yml").write_text("base_config: [a.yml]\n")
    return tmp_path / "bad.yml", "base_config must be a file path, got ['a.yml']"


@pytest.mark.parametrize("kind", ["a directory", "not UTF-8", "base_config a directory",
                                  "base_config a list"])
@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_config_that_is_no_yaml_file_is_one_line(tmp_path, capsys, tool, kind):
    config, message = bad_config(tmp_path, kind)
    assert TOOLS[tool]([str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err


def test_a_config_directory_in_a_fresh_process_prints_no_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "k3text.tools.params", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: config file {tmp_path} is a directory; "
                                                f"give a YAML file"]


@pytest.mark.parametrize("source,value", [("override", ".nan"), ("override", "-.inf"),
                                          ("override", "1" + "0" * 400), ("file", ".inf")])
def test_non_finite_numbers_are_refused(tmp_path, source, value):
    config = tmp_path / "model.yml"
    config.write_text(f"base_config: {MODELS / 'k3-tiny.yml'}\n"
                      + (f"learning_rate: {value}\n" if source == "file" else ""))
    overrides = [f"learning_rate={value}"] if source == "override" else []
    with pytest.raises(ConfigError, match="'learning_rate' in .* must be a finite number"):
        load_config(config, overrides)


def test_a_mistyped_layer_count_is_refused_at_once():
    with pytest.raises(ConfigError, match="'num_hidden_layers' must be at most 1000"):
        load_config(MODELS / "kimi-k3.yml", ["num_hidden_layers=99999999999999999999",
                                             "linear_attn_config.kda_layers=[]"])
    with pytest.raises(ConfigError, match=r"layers \[14, 15, 16, 17, 18, 19, 20, 21, 22, 23\] "
                                          r"and 977 more are in neither"):
        load_config(MODELS / "k3-tiny.yml", ["num_hidden_layers=1000"])  # 13 listed


@pytest.mark.parametrize("args,message", [
    (["--hbm-gib", "nan"], "--hbm-gib nan: must be a finite number"),
    (["--hbm-gib", "inf"], "--hbm-gib inf: must be a finite number"),
    (["--hbm-gib", "0"], "--hbm-gib 0.0: must be positive"),
    (["--reserve-gib", "nan"], "--reserve-gib nan: must be a finite number"),
    (["--reserve-gib", "200"], "--reserve-gib 200.0: leaves nothing of the 94.74 GiB budget"),
    (["--hbm-gib", "8", "--reserve-gib", "8"], "--reserve-gib 8.0: leaves nothing of the "
                                               "8.00 GiB budget"),
])
def test_memory_tool_refuses_budgets_that_are_no_budget(capsys, args, message):
    assert memory.main([str(MODELS / "kimi-k3.yml"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err


@pytest.mark.parametrize("main,argv", [(train.main, []), (compile_check.main, []),
                                       (compile_check.main, ["--tpu"])])
def test_no_config_is_a_usage_error(capsys, main, argv):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert not out and err.strip().splitlines()[-1] == "error: no CONFIG file given (-h for help)"


@pytest.mark.parametrize("argv", [["--port", "9000"], [CPU, "--port=9000"],
                                  [CPU, "max_decode_steps=2", "-v"]])
def test_a_flag_is_a_usage_error_naming_it(capsys, argv):
    """The commands take config keys as key=value: a flag (say vLLM's `--port`) is named as an
    unknown option, not read as a config file or an override."""
    assert decode.main(argv) == 2
    out, err = capsys.readouterr()
    flag = next(a for a in argv if a.startswith("-"))
    assert not out and err.strip().splitlines()[-1] == (
        f"error: unknown option {flag!r}: settings are config keys, given as key=value "
        f"(-h for help)")


@pytest.mark.parametrize("command", ["convert", "make_tiny_checkpoint"])
@pytest.mark.parametrize("target,force,message", [
    ("file", True, "{out} is a file, not a directory; give a directory path"),
    ("file", False, "{out} is a file, not a directory; give a directory path"),
    ("file/sub", False, "cannot create {out}: {tmp}/file is not a directory"),
    ("/proc/k3text-out", False, "cannot create {out} in /proc"),
])
def test_an_output_directory_that_cannot_be_is_one_line(small_hf, tmp_path, capsys, command,
                                                         target, force, message):
    (tmp_path / "file").write_text("kept")
    out = target if target.startswith("/") else str(tmp_path / target)
    if command == "convert":
        rc = convert.main(["--hf-dir", str(small_hf), "--out", out, "--no-progress",
                           *(["--force"] if force else [])])
    else:
        rc = synthetic.main(["--model-config", str(MODELS / "k3-tiny.yml"), "--out", out,
                             *(["--force"] if force else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {message.format(out=out, tmp=tmp_path)}"), err
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # untouched, nothing left beside it
    assert (tmp_path / "file").read_text() == "kept"


@pytest.mark.parametrize("error,status", [
    (ConfigError("bad key"), 2), (FileNotFoundError(2, "No such file", "x.yml"), 2),
    (files.OutputError("out exists"), 2), (OSError(28, "No space left on device"), 1),
    (PermissionError(13, "Permission denied", "prompts.jsonl"), 2), (ValueError("bad"), 2),
])
def test_every_command_exits_2_for_its_input_and_1_for_the_machine(tmp_path, capsys,
                                                                   monkeypatch, error, status):
    """The config CLIs, the operator tools, compile_check, the converter and
    make_tiny_checkpoint classify an error alike."""
    def fail(*args, **kwargs):
        raise error

    assert cli.main([CPU], "k3text.decode", "", fail) == status
    assert cli.run(cli.parser("k3text.tools.x", ""), [CPU], fail) == status
    monkeypatch.setattr(compile_check, "check", fail)
    assert compile_check.main([CPU]) == status
    monkeypatch.setattr(convert, "convert", fail)
    assert convert.main(["--hf-dir", str(tmp_path), "--out", str(tmp_path / "o")]) == status
    monkeypatch.setattr(synthetic, "write_checkpoint", fail)
    assert synthetic.main(["--model-config", str(MODELS / "k3-tiny.yml"), "--out",
                           str(tmp_path / "o")]) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {error}"] * 5, err


def test_running_out_of_device_memory_names_the_keys_to_lower(capsys):
    def allocate(cfg):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 GiB")

    assert cli.main([CPU], "k3text.serve", "", allocate) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: the programs do not fit in device memory (RESOURCE_EXHAUSTED: Out of memory "
        "allocating 9 GiB); lower per_device_batch_size, max_target_length or "
        "prefill_chunk_size (python -m k3text.tools.memory CONFIG shows the trade-off)"]


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory):
    """A k3-tiny Hugging Face checkpoint (module-scoped: nothing here may change it)."""
    path = tmp_path_factory.mktemp("hf") / "hf"
    synthetic.write_checkpoint(load_config(MODELS / "k3-tiny.yml"), path)
    return path


def test_convert_refuses_a_file_for_its_source(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert convert.main(["--hf-dir", str(tmp_path / "file"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'file'}: not a checkpoint "
                                               f"directory (it is not a directory)")


@pytest.mark.parametrize("where", ["itself", "its parent"])
def test_convert_never_replaces_its_own_source(small_hf, tmp_path, capsys, where):
    hf = Path(shutil.copytree(small_hf, tmp_path / "hf"))
    before = sorted(p.name for p in hf.iterdir())
    out = hf if where == "itself" else tmp_path
    assert convert.main(["--hf-dir", str(hf), "--out", str(out), "--force", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --out {out} would replace the checkpoint being converted ({hf}); "
                   f"give another directory"]
    assert sorted(p.name for p in hf.iterdir()) == before


@pytest.mark.parametrize("args,message", [
    (["--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
    (["--shards", "0"], "argument --shards: expected an integer >= 1, got '0'"),
    (["--shards", "1.5"], "argument --shards: expected an integer >= 1, got '1.5'"),
])
def test_make_tiny_checkpoint_refuses_meaningless_counts(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exited:
        synthetic.main(["--model-config", str(MODELS / "k3-tiny.yml"), "--out",
                        str(tmp_path / "out"), *args])
    assert exited.value.code == 2 and message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stop,status", [(KeyboardInterrupt, 130),
                                         (SystemExit(128 + signal.SIGTERM), 143)])
def test_make_tiny_checkpoint_checks_its_output_first_and_leaves_nothing_when_stopped(
        tmp_path, capsys, monkeypatch, stop, status):
    args = ["--model-config", str(MODELS / "k3-tiny.yml"), "--out", str(tmp_path / "out")]
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(synthetic, "random_params",
                        lambda *a: pytest.fail("built the model before checking --out"))
    assert synthetic.main(args) == 2 and "already exists" in capsys.readouterr().err
    (tmp_path / "out").rmdir()
    monkeypatch.undo()

    def stopped(*a, **k):  # as the SIGINT / SIGTERM handlers raise, mid-write
        raise stop

    monkeypatch.setattr(synthetic, "save_sharded", stopped)
    assert synthetic.main(args) == status
    assert capsys.readouterr().err.strip() == "interrupted; nothing was written"
    assert list(tmp_path.iterdir()) == []


def test_training_refuses_a_checkpoint_it_would_ignore(tmp_path):
    cfg = load_config(CONFIG_DIR / "train" / "k3-small.yml",
                      [f"load_parameters_path={tmp_path}"])
    with pytest.raises(ConfigError, match="it would ignore load_parameters_path="):
        train.train(cfg)


def test_training_checks_checkpoint_dir_and_tokenizer_path_first(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    cfg = load_config(CONFIG_DIR / "train" / "k3-small.yml",
                      [f"checkpoint_dir={tmp_path / 'file'}", "export_path="])
    with pytest.raises(ConfigError, match="checkpoint_dir .*file is a file, not a directory"):
        train.train(cfg)
    assert train.main([str(CONFIG_DIR / "train" / "k3-small.yml"), f"tokenizer_path={tmp_path}",
                       "export_path=", "checkpoint_dir="]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: tiktoken BPE file {tmp_path} is a directory; give the file")
    # A tokenizer to train where none can be written: said before the BPE trains.
    bpe = train.train_bpe
    train.train_bpe = lambda *a: pytest.fail("trained before checking where the result goes")
    try:
        with pytest.raises(ConfigError, match="tokenizer_path .*file is not a directory"):
            train.train(cfg.replace(checkpoint_dir="", tokenizer_path=str(
                tmp_path / "file" / "tok.model")))
    finally:
        train.train_bpe = bpe
    # An export replaces its whole directory: it may not hold the training checkpoints.
    for export, checkpoints in (("run", "run"), ("run", "run/ckpt"), ("run/export", "run")):
        with pytest.raises(ConfigError, match="overlap"):
            train.train(cfg.replace(export_path=str(tmp_path / export),
                                    checkpoint_dir=str(tmp_path / checkpoints)))


def test_training_zero_steps_trains_nothing(tmp_path):
    cfg = load_config(CONFIG_DIR / "train" / "k3-small.yml",
                      ["train_steps=0", "export_path=", "checkpoint_dir="])
    assert train.train(cfg).losses == []
