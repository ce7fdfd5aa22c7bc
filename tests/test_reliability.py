"""Bad outputs are refused before any work, exports are never replaced unasked, results files are
always valid JSON, and signals end a command with one line and the conventional exit status."""

import json
import math
import signal
import subprocess
import sys
import time

import pytest

from k3text import decode, files, train
from k3text.config import CONFIG_DIR, ConfigError, load_config

from helpers import ROOT

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
