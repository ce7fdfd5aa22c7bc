"""The converter's user errors, dry run and output safety.

Every broken checkpoint ends in one line on stderr naming the tensor and the file, a non-zero
exit and nothing at --out; `--dry-run` reads headers only and lists every problem; an existing
--out needs --force; an interrupted conversion leaves nothing behind.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from k3text.checkpoint import convert, safetensors_io, store, synthetic
from k3text.checkpoint.safetensors_io import INDEX_FILE, SafetensorsCheckpoint, save_file

from helpers import MODELS, ROOT

LAYER = "language_model.model.layers.1."
EXPERT = LAYER + "block_sparse_moe.experts.3.w1.weight_packed"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random k3-tiny in the released K3 layout, in 3 shards."""
    path = tmp_path_factory.mktemp("src") / "hf"
    assert synthetic.main(["--model-config", str(MODELS / "k3-tiny.yml"), "--out", str(path),
                           "--shards", "3"]) == 0
    return path


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


@pytest.mark.parametrize("breakage", [_truncate, _corrupt_header, _missing_shard, _wrong_shape,
                                      _wrong_dtype, _unexpected_key, _missing_tensor,
                                      _no_config_json], ids=lambda f: f.__name__[1:])
def test_broken_checkpoint_is_one_line_naming_tensor_and_file(hf_dir, tmp_path, capsys,
                                                               breakage):
    culprit, message = breakage(hf_dir)
    rc, _, err = run(capsys, "--hf-dir", hf_dir, "--out", tmp_path / "out")
    assert rc == 1
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
    assert rc == 1 and "5 problem(s)" in err[-1]  # the 3, and 2 inventory counts
    problems = out.split("problem(s):")[1]
    for message in (wrong_shape, unexpected, missing):
        assert message in problems
    assert "expert tensors" in out and "<- differs" in out


def test_existing_out_needs_force(source, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_text("old")
    rc, _, err = run(capsys, "--hf-dir", source, "--out", out)
    assert rc == 1 and "already exists" in err[-1] and (out / "stale").exists()
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
    if interrupt == "ctrl-c":
        rc, _, err = run(capsys, "--hf-dir", source, "--out", tmp_path / "out")
        assert rc == 130 and err[-1].startswith("interrupted; nothing was written")
    else:
        with pytest.raises(SystemExit) as exit_:
            run(capsys, "--hf-dir", source, "--out", tmp_path / "out")
        assert exit_.value.code == 128 + signal.SIGTERM
    assert len(written) == 40
    assert list(tmp_path.iterdir()) == []


def test_command_line_tool(source, tmp_path):
    script = ROOT / "tools" / "convert" / "hf_to_k3text.py"
    done = subprocess.run([sys.executable, str(script), "--hf-dir", str(source), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "tensors" in done.stderr  # the progress bar
    assert (tmp_path / "out" / "model.yml").is_file()
