"""The converter's user errors, dry run and output safety.

Every broken checkpoint ends in one line on stderr naming the tensor and the file, a non-zero
exit and nothing at --out; `--dry-run` reads headers only and lists every problem; an existing
--out needs --force; an interrupted conversion leaves nothing behind.
"""

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

from k3text import files
from k3text.checkpoint import convert, safetensors_io, store, synthetic
from k3text.checkpoint.safetensors_io import INDEX_FILE, SafetensorsCheckpoint, save_file

from helpers import MODELS, ROOT

LAYER = "language_model.model.layers.1."
EXPERT = LAYER + "block_sparse_moe.experts.3.w1.weight_packed"


def released_layout(tmp_path_factory, model: str):
    """A random `model` in the released K3 layout, in 3 shards."""
    path = tmp_path_factory.mktemp(model) / "hf"
    assert synthetic.main(["--model-config", str(MODELS / f"{model}.yml"), "--out", str(path),
                           "--shards", "3"]) == 0
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return released_layout(tmp_path_factory, "k3-tiny")


@pytest.fixture
def hf_dir(source, tmp_path):
    """A private copy of the source checkpoint to break."""
    return shutil.copytree(source, tmp_path / "hf")


def run(capsys, *args):
    rc = convert.main([*map(str, args), "--no-progress"])
    out, err = capsys.readouterr()
    return rc, out, err.strip().splitlines()


def rewrite_shard(hf_dir, tensor, change):
    """Rewrite the shard holding `tensor` with `change(dict of its tensors)` applied, keeping
    the index in step."""
    checkpoint = SafetensorsCheckpoint(hf_dir)
    shard = checkpoint.info(tensor).file
    tensors = {n: checkpoint.read(n) for n in checkpoint.keys()
               if checkpoint.info(n).file == shard}
    change(tensors)
    save_file(tensors, shard)
    index = json.loads((hf_dir / INDEX_FILE).read_text())
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if n in checkpoint
                           and (checkpoint.info(n).file != shard or n in tensors)}
    index["weight_map"].update({n: shard.name for n in tensors})
    (hf_dir / INDEX_FILE).write_text(json.dumps(index))
    return shard


def shard_of(hf_dir, tensor):
    return SafetensorsCheckpoint(hf_dir).info(tensor).file


def _truncate(hf_dir):
    shard = shard_of(hf_dir, EXPERT)
    os.truncate(shard, shard.stat().st_size - 100)
    return shard, "truncated"


def _corrupt_header(hf_dir):
    shard = shard_of(hf_dir, EXPERT)
    with open(shard, "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xfe garbage")
    return shard, "not valid UTF-8 JSON"


def _missing_shard(hf_dir):
    shard = shard_of(hf_dir, EXPERT)
    shard.unlink()
    return shard, "shard file is missing"


def _wrong_shape(hf_dir):
    name = LAYER + "self_attn.q_proj.weight"
    shard = rewrite_shard(hf_dir, name, lambda t: t.update({name: t[name][:-1]}))
    return shard, f"{name!r}: shape [63, 64] does not fit k3text lead.1.mixer.qkv_proj " \
                  "(the model config expects [64, 64])"


def _wrong_dtype(hf_dir):
    shard = rewrite_shard(hf_dir, EXPERT, lambda t: t.update(
        {EXPERT: t[EXPERT].astype(ml_dtypes.bfloat16)}))
    return shard, f"{EXPERT!r}: dtype BF16 does not fit k3text " \
                  f"lead.1.mlp.experts.gate_up_packed, which is uint8"


def _unexpected_key(hf_dir):
    name = LAYER + "self_attn.rotary_emb.inv_freq"
    shard = rewrite_shard(hf_dir, EXPERT, lambda t: t.update({name: np.ones(4, np.float32)}))
    return shard, f"no k3 name rule for tensor '{name}'"


def _missing_tensor(hf_dir):
    rewrite_shard(hf_dir, EXPERT, lambda t: t.pop(EXPERT))
    return hf_dir, f"missing tensor {EXPERT!r} (k3text lead.1.mlp.experts.gate_up_packed)"


def _no_config_json(hf_dir):
    (hf_dir / "config.json").unlink()
    return hf_dir / "config.json", "missing"


def _config_json_edit(change):
    def breakage(hf_dir):
        path = hf_dir / "config.json"
        config = json.loads(path.read_text())
        message = change(config.get("text_config", config))
        path.write_text(json.dumps(config))
        return path, message
    breakage.__name__ = change.__name__
    return breakage


@_config_json_edit
def _null_quantization_groups(config):
    config["quantization_config"] = {"config_groups": []}  # a list where an object belongs
    return "a field has the wrong type"


@_config_json_edit
def _string_width(config):
    config["hidden_size"] = "64"
    return "hidden_size"


@pytest.mark.parametrize("breakage", [_truncate, _corrupt_header, _missing_shard, _wrong_shape,
                                      _wrong_dtype, _unexpected_key, _missing_tensor,
                                      _no_config_json, _null_quantization_groups,
                                      _string_width], ids=lambda f: f.__name__[1:])
def test_broken_checkpoint_is_one_line_naming_tensor_and_file(hf_dir, tmp_path, capsys,
                                                               breakage):
    culprit, message = breakage(hf_dir)
    rc, _, err = run(capsys, "--hf-dir", hf_dir, "--out", tmp_path / "out")
    assert rc == 2
    [line] = err
    assert line.startswith("error: ") and str(culprit) in line and message in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no output, no leftovers


def test_dry_run_reads_only_headers_and_prints_the_inventory(source, capsys, monkeypatch):
    def no_data(info):
        raise AssertionError(f"dry run read the data of {info.name}")

    monkeypatch.setattr(safetensors_io, "read_tensor", no_data)
    rc, out, _ = run(capsys, "--hf-dir", source, "--dry-run")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"{source}: k3 layout, 1,494 tensors")
    row = {line[:32].strip(): line[32:].split() for line in lines[2:]}
    assert row["text tensors"] == ["1,492", "1,492"]
    assert row["vision tensors (dropped)"] == ["2", "-"]
    assert row["k3text tensors they fill"] == ["295", "295"]
    assert row["stacked per MoE layer"] == ["48", "48"]
    assert lines[-1] == "ok: the checkpoint matches the model config"


def test_dry_run_lists_every_problem(hf_dir, capsys):
    _, wrong_shape = _wrong_shape(hf_dir)
    _, unexpected = _unexpected_key(hf_dir)
    _, missing = _missing_tensor(hf_dir)
    rc, out, err = run(capsys, "--hf-dir", hf_dir, "--dry-run")
    assert rc == 2 and "5 problem(s)" in err[-1]  # the 3, and 2 inventory counts
    problems = out.split("problem(s):")[1]
    for message in (wrong_shape, unexpected, missing):
        assert message in problems
    assert "expert tensors" in out and "<- differs" in out


def test_existing_out_needs_force(source, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_text("old")
    rc, _, err = run(capsys, "--hf-dir", source, "--out", out)
    assert rc == 2 and "already exists" in err[-1] and (out / "stale").exists()
    # --force replaces a checkpoint only, never a mistyped directory of something else.
    rc, _, err = run(capsys, "--hf-dir", source, "--out", out, "--force")
    assert rc == 2 and err == [f"error: {out} is neither empty nor a checkpoint (it has no "
                               f"params/_METADATA, model.yml, config.json); --force replaces "
                               f"only a checkpoint: remove it yourself, or give another path"]
    assert sorted(p.name for p in out.iterdir()) == ["stale"]
    (out / "model.yml").write_text("an older checkpoint's")
    rc, _, _ = run(capsys, "--hf-dir", source, "--out", out, "--force")
    assert rc == 0 and not (out / "stale").exists()
    assert (out / "model.yml").is_file() and (out / store.PARAMS_DIR / "_METADATA").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("interrupt", ["ctrl-c", "sigterm"])
def test_interrupted_conversion_leaves_nothing(source, tmp_path, capsys, monkeypatch,
                                               interrupt):
    written = []
    write = store.Writer.write

    def interrupted(self, *args):
        if len(written) == 40:
            if interrupt == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)
        written.append(args[0])
        write(self, *args)

    monkeypatch.setattr(store.Writer, "write", interrupted)
    rc, _, err = run(capsys, "--hf-dir", source, "--out", tmp_path / "out")
    assert rc == (130 if interrupt == "ctrl-c" else 128 + signal.SIGTERM)
    assert err[-1].startswith("interrupted; nothing was written")
    assert len(written) == 40
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def small_source(tmp_path_factory):
    """k3-small: a conversion long enough to interrupt at several moments."""
    return released_layout(tmp_path_factory, "k3-small")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_real_signal_at_any_moment_leaves_a_whole_output_or_none(small_source, tmp_path,
                                                                    signum):
    """The converter process, signalled at several moments from the start of its streaming to
    its end: it exits 128 + signal (or 0 if it finished first) without a traceback, no
    staging copy is left, and what it says matches what is on disk."""
    outcomes = set()
    for delay in (0.0, 0.1, 0.25, 0.5, 1.0, 2.0):
        out, log = tmp_path / f"out-{delay}", tmp_path / f"err-{delay}.txt"
        with log.open("w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "k3text.checkpoint.convert",
                                     "--hf-dir", str(small_source), "--out", str(out)],
                                    stdout=subprocess.PIPE, stderr=err, text=True)
            deadline = time.monotonic() + 120
            while proc.poll() is None and not log.read_text() and time.monotonic() < deadline:
                time.sleep(0.01)  # the progress bar: streaming has started
            time.sleep(delay)
            proc.send_signal(signum)
            stdout, _ = proc.communicate(timeout=120)
        message = log.read_text().strip().splitlines()[-1]
        assert "Traceback" not in log.read_text()
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
        if stdout.startswith(f"wrote {out}"):
            # Finished and said so; a signal landing during interpreter shutdown may still
            # set the exit status.
            assert proc.returncode in (0, 128 + signum, -signum)
            outcomes.add("finished")
        else:
            assert proc.returncode == 128 + signum, message
            assert message.startswith("interrupted")
            outcomes.add("complete" if "complete" in message else "nothing")
            assert out.exists() == ("complete" in message), message
        if out.exists():
            assert store.stored_arrays(out) and (out / "model.yml").is_file()
    assert "nothing" in outcomes


@pytest.mark.parametrize("module", ["checkpoint.convert", "checkpoint.synthetic", "decode"])
def test_a_signal_during_interpreter_shutdown_prints_nothing_after_the_last_line(tmp_path,
                                                                                 module):
    """A signal that lands once the command has said how it ended, in an exit handler (jax
    clears its caches at exit, for long enough to be hit): no traceback follows the last
    line. The process under test signals itself from the first exit handler to run."""
    small = str(MODELS / "k3-small.yml")
    args, status = {
        "checkpoint.convert": (["--model-config", small, "--dry-run"], 0),
        "checkpoint.synthetic": (["--model-config", small, "--out", str(tmp_path / "hf"),
                                  "--shards", "1"], 0),
        "decode": ([str(tmp_path / "missing.yml")], 2)}[module]
    script = ("import atexit, os, signal, sys\n"
              f"import k3text.{module} as command\n"
              "atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\n"
              "sys.exit(command.main(sys.argv[1:]))\n")
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr
    assert (done.stdout if status == 0 else done.stderr).strip()  # how it ended


def test_command_line_tool(source, tmp_path):
    script = ROOT / "tools" / "convert" / "hf_to_k3text.py"
    done = subprocess.run([sys.executable, str(script), "--hf-dir", str(source), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "tensors" in done.stderr  # the progress bar
    assert (tmp_path / "out" / "model.yml").is_file()


def test_a_signal_inside_a_gc_callback_is_delivered_again_after_it():
    """A Ctrl-C landing inside a garbage-collector callback (jax registers one) would be printed
    as an ignored exception with a traceback and lost: the handler returns there instead, and
    the signal arrives again once the callback is done; anywhere else it raises as before."""

    def raising(signum, frame):
        raise KeyboardInterrupt

    handler = files.gc_safe(raising)
    outcome, seen = [], []

    def callback(phase, info):
        if phase == "start" and not outcome:
            try:
                handler(signal.SIGUSR1, sys._getframe())
                outcome.append("returned")
            except KeyboardInterrupt:
                outcome.append("raised")

    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    gc.callbacks.append(callback)
    try:
        gc.collect()
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        gc.callbacks.remove(callback)
        signal.signal(signal.SIGUSR1, previous)
    assert outcome == ["returned"] and seen == [signal.SIGUSR1]
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, sys._getframe())
