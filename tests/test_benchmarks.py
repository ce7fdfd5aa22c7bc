"""The benchmark sweep machinery on a tiny grid, and the serving load generator on the shipped
model, small: they run, and write the documented files and fields. Nothing timed is checked."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import benchlib
import sweep

from k3text import files
from k3text.config import ConfigError

ROOT = benchlib.ROOT
MACHINE_FIELDS = {"date", "cpu", "cores", "ram_gib", "backend", "devices", "jax", "jaxlib"}


def write_sweep(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_two_point_sweep_writes_jsonl_csv_and_png(tmp_path):
    # On two devices: a step's inputs must be placed on the whole mesh, not one device.
    spec = write_sweep(tmp_path / "tiny.yml", """
base: configs/models/kimi-linear-tiny.yml
fixed: {max_decode_steps: 2, ici_tensor_parallelism: 2}
grid: {per_device_batch_size: [1, 2]}
prompt_lengths: [5]
repeats: 1
""")
    out = tmp_path / "out"
    assert sweep.main([str(spec), "--out", str(out)]) == 0

    lines = (out / "tiny.jsonl").read_text().splitlines()
    header, points = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    assert MACHINE_FIELDS <= header["machine"].keys()
    assert header["sweep"]["grid"] == {"per_device_batch_size": [1, 2]}
    assert len(points) == 2
    for point, batch in zip(points, (1, 2), strict=True):
        assert set(sweep.FIELDS) | {"per_device_batch_size"} <= point.keys()
        assert point["error"] is None
        assert (point["batch"], point["decode_steps"], point["prompt_length"]) == (batch, 2, 5)
        assert point["moe_path_decode"] in ("gathered", "grouped")
        for field in ("ttft_ms", "decode_tokens_per_s", "step_ms_p50", "step_peak_mib"):
            assert point[field] > 0, field

    text = (out / "tiny.csv").read_text().splitlines()
    comments = [line for line in text if line.startswith("#")]
    assert any(line.startswith("# jaxlib:") for line in comments)
    rows = list(csv.DictReader(line for line in text if not line.startswith("#")))
    assert list(rows[0]) == sweep.columns(sweep.load_sweep(spec))
    assert [r["batch"] for r in rows] == ["1", "2"]

    assert (out / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    first = {p.name: p.read_bytes() for p in out.iterdir()}

    # An earlier run's results are replaced only with --force, checked before any point runs.
    measure = sweep.measure
    sweep.measure = lambda *args: pytest.fail("measured before checking the outputs")
    try:
        assert sweep.main([str(spec), "--out", str(out)]) == 2
        assert {p.name: p.read_bytes() for p in out.iterdir()} == first

        # Ctrl-C in the second point: the first point's row is written, marked interrupted.
        calls = []

        def interrupted_at_the_second(*args):
            calls.append(args)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return measure(*args)

        sweep.measure = interrupted_at_the_second
        assert sweep.main([str(spec), "--out", str(out), "--force"]) == 130
    finally:
        sweep.measure = measure
    lines = (out / "tiny.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["interrupted"] is True and len(lines) == 2
    assert json.loads(lines[1])["batch"] == 1


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs" / "sweeps").glob("*")))
def test_shipped_sweeps_parse(name):
    spec = sweep.load_sweep(ROOT / "configs" / "sweeps" / name)
    assert spec.base_path.is_file()
    if name.startswith("cpu-"):  # the CPU sweeps validate fully on the 8 test devices
        assert len(sweep.expand(spec, [])) == len(spec.points())


@pytest.mark.parametrize(("text", "message"), [
    ("base: x.yml\nprompt_lengths: [4]\nrepeat: 2\n", "unknown sweep key 'repeat'"),
    ("prompt_lengths: [4]\n", "'base' is required"),
    ("base: x.yml\nprompt_lengths: [0]\n", "prompt_lengths must be positive"),
    ("base: x.yml\nprompt_lengths: [4]\ngrid: {seed: []}\n", "grid.seed must be a non-empty"),
    ("base: x.yml\nprompt_lengths: [4]\nfixed: {seed: 1}\ngrid: {seed: [2]}\n",
     "both fixed and swept"),
])
def test_bad_sweep_files_are_rejected(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        sweep.load_sweep(write_sweep(tmp_path / "bad.yml", text))


def test_points_that_cannot_run_are_rejected_before_running(tmp_path):
    spec = sweep.load_sweep(write_sweep(tmp_path / "long.yml", """
base: configs/models/kimi-linear-tiny.yml
fixed: {max_target_length: 64, max_prefill_predict_length: 64, max_decode_steps: 8}
prompt_lengths: [60]
"""))
    with pytest.raises(ConfigError, match="exceeds max_target_length"):
        sweep.expand(spec, [])
    with pytest.raises(ConfigError, match="set by the sweep itself"):
        sweep.expand(spec, ["ignore_eos=false"])


def test_host_device_flag_respects_an_existing_count():
    flag = benchlib.HOST_DEVICES_FLAG
    assert benchlib.with_host_devices("", 8) == f"{flag}=8"
    assert benchlib.with_host_devices("--xla_foo=1", 8) == f"--xla_foo=1 {flag}=8"
    assert benchlib.with_host_devices(f"{flag}=4", 8) == f"{flag}=4"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to measure between")
def test_core_round_trip_is_measured_and_leaves_nothing_behind():
    shm = Path("/dev/shm")
    before = set(shm.glob("k3text-round-trip-*")) if shm.is_dir() else set()
    affinity = os.sched_getaffinity(0)
    ns = benchlib.core_round_trip_ns(rounds=2000)
    assert 1 < ns < 1e6  # a spin through shared memory: nanoseconds to microseconds
    assert os.sched_getaffinity(0) == affinity  # the caller's pinning is restored
    if shm.is_dir():
        assert set(shm.glob("k3text-round-trip-*")) == before
    line = benchlib.machine_line({"cpu": "x", "cores": 2, "ram_gib": 1, "backend": "cpu",
                                  "devices": 1, "fake_cpu_devices": False, "jax": "j",
                                  "jaxlib": "l", "date": "d", "core_round_trip_ns": ns})
    assert f"core round trip {ns:.0f} ns" in line


def _serve_load_interrupted(args: list[str], log: Path, marker: str,
                            ) -> tuple[subprocess.Popen, str, list[str]]:
    """Run `benchmarks/serve_load.py ARGS` (stderr to `log`) until `marker` appears in its
    stderr, then Ctrl-C it: (the ended process, its stdout, the pids of its child processes
    just before the signal)."""
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"),
             f"compilation_cache_dir={os.environ['K3TEXT_TEST_XLA_CACHE']}", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            deadline = time.monotonic() + 600
            while marker not in log.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()
                time.sleep(0.5)
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            proc.send_signal(signal.SIGINT)
            stdout, _ = proc.communicate(timeout=180)
        finally:
            proc.kill()
    return proc, stdout, children


def test_benchmarks_end_bad_input_and_failures_in_one_line(tmp_path, monkeypatch, capsys):
    """`benchlib.run_checked` (collectives, layouts): a bad input exits 2, the machine's failure
    1, Ctrl-C 130, each one line; serve_load refuses a config without a tokenizer before any
    work, and options --shared-prefix would ignore."""
    import errno

    import serve_load

    def failing(error):
        def work():
            raise error
        return work

    for error, status in ((ConfigError("bad key"), 2), (OSError(errno.ENOSPC, "disk full"), 1),
                          (KeyboardInterrupt(), 130)):
        assert benchlib.run_checked(failing(error)) == status
        assert capsys.readouterr().err.count("\n") == 1
    # A results file that appears while the job runs (another run's) is kept; these results
    # go beside it, and the error names where.
    path = tmp_path / "results.jsonl"
    benchlib.check_outputs([path], force=False)
    path.write_text("another run's\n")
    with pytest.raises(files.OutputError, match="results.jsonl"):
        benchlib.write_jsonl(path, {"machine": {}}, [{"x": 1}])
    assert path.read_text() == "another run's\n"
    assert [p.name for p in tmp_path.iterdir() if p != path]
    benchlib.check_outputs([path], force=True)  # with --force it is replaced
    benchlib.write_jsonl(path, {"machine": {}}, [{"x": 1}])
    assert path.read_text().count("\n") == 2
    tiny = str(ROOT / "configs" / "models" / "k3-tiny.yml")
    monkeypatch.setattr(sys, "argv", ["serve_load.py", tiny, "--out", str(tmp_path)])
    assert serve_load.main() == 2
    assert "serve_load needs a config with a tokenizer" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["serve_load.py", "--shared-prefix", "--rates", "4"])
    with pytest.raises(SystemExit) as exit_:
        serve_load.main()
    assert exit_.value.code == 2
    assert "--shared-prefix does not take --rates" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_load_prints_the_targets_and_keeps_whole_rounds_on_ctrl_c(tmp_path):
    """`benchmarks/serve_load.py` end to end, small (8 requests, one Poisson rate, two
    interleaved rounds of saturation and the offline baselines), with Ctrl-C once the first
    round is out: the Poisson row and the whole first round are written (nothing of the
    second), marked interrupted, with the targets' ratios printed for it; it exits 130, and
    the server it started is gone."""
    out, log = tmp_path / "out", tmp_path / "stderr.txt"
    proc, stdout, children = _serve_load_interrupted(
        # Whole chunks only: each prefill bucket is two more programs to compile (about 40 s
        # of this test's time), and the command's bookkeeping does not depend on them.
        ["prefill_buckets=[]", "--requests", "8", "--rates", "8", "--rounds", "2",
         "--out", str(out)], log, "round 1:")
    assert children, "no server process"
    assert proc.returncode == 130, log.read_text()[-3000:]
    assert "interrupted: writing the 4 rows measured" in log.read_text()
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]
    head, *rows = [json.loads(line) for line in (out / "serve_load.jsonl").read_text()
                   .splitlines()]
    assert head["interrupted"] is True and head["rounds"] == 1 and MACHINE_FIELDS <= set(head)
    assert [r["mode"] for r in rows] == ["poisson", "fixed concurrency", "offline steady state",
                                         "offline static batches"]
    assert [r.get("round") for r in rows[1:]] == [1, 1, 1]
    assert all(r["output_tokens_per_s"] > 0 for r in rows)
    table = [line for line in (out / "serve_load.csv").read_text().splitlines()
             if not line.startswith("#")]
    assert [r["mode"] for r in csv.DictReader(table)] == [r["mode"] for r in rows]
    assert (out / "serve_load.png").stat().st_size > 0
    for target in ("saturation vs offline steady-state decode", "ceiling for this workload",
                   "TPOT p50, all slots busy", "continuous vs static batching"):
        assert target in stdout, stdout
    # The server's threads' CPU time from /proc: busy cores, part of it the host's.
    saturated = rows[1]
    assert 0.1 < saturated["server_cores"] <= os.cpu_count() + 0.5, saturated
    assert 0 < saturated["host_cpu_share"] < 1, saturated
    assert "cores busy" in stdout, stdout
    assert 0 < saturated["client_cores"] <= os.cpu_count() + 0.5, saturated
    assert "the load generator kept" in stdout, stdout
    # The cores' round trip before each run of the round, and its range printed.
    if len(os.sched_getaffinity(0)) > 1:
        assert all(0 < r["core_round_trip_ns"] < 1e6 for r in rows[1:]), rows
        assert "the cores' round trip before each run" in stdout, stdout


def test_serve_load_shared_prefix_keeps_the_cache_off_rows_on_ctrl_c(tmp_path, monkeypatch,
                                                                    capsys):
    """`serve_load.py --shared-prefix` cut short by Ctrl-C while the cache-on server runs (its
    servers and load replaced by stand-ins, so only the run's own bookkeeping is under test):
    the cache-off rows measured are written, marked interrupted, no cache-on comparison is
    printed, every server started is stopped, and the command exits 130."""
    import serve_load

    started, stopped = [], []

    class Server:
        def __init__(self, config, overrides):
            self.cached = "enable_prefix_caching=True" in overrides
            self.url = f"http://server-{len(started)}"
            started.append(self)

        def stop(self):
            stopped.append(self)

    def answered(n):
        return [{"ttft": 0.5, "tpot": 0.01, "tokens": 9, "end": 1.0, "ids": [5] * 9,
                 "arrivals": []}] * n

    async def closed_loop(url, model, requests, concurrency, slots):
        if started[-1].cached and len(requests) > 1:  # the cache-on run's measured load
            raise KeyboardInterrupt
        return serve_load._summary("fixed concurrency", answered(len(requests)), 2.0)

    async def conversations(url, model, system, talks):
        return serve_load._summary("multi-turn", answered(4 * len(talks)), 3.0)

    monkeypatch.setattr(serve_load, "ServerProcess", Server)
    monkeypatch.setattr(serve_load, "closed_loop", closed_loop)
    monkeypatch.setattr(serve_load, "conversations", conversations)
    monkeypatch.setattr(serve_load, "cache_counts", lambda url: np.zeros(2))
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["serve_load.py", "--shared-prefix", "--requests", "4",
                                      "--out", str(out)])
    assert serve_load.main() == 130
    stdout, stderr = capsys.readouterr()
    assert "interrupted: writing the 2 rows measured" in stderr
    assert [s.cached for s in started] == [False, True] and stopped == started
    head, *rows = [json.loads(line) for line in (out / "prefix_cache.jsonl").read_text()
                   .splitlines()]
    assert head["interrupted"] is True and MACHINE_FIELDS <= set(head)
    assert [(r["prefix_cache"], r["requests"]) for r in rows] == [(False, 4), (False, 4)]
    table = [line for line in (out / "prefix_cache.csv").read_text().splitlines()
             if not line.startswith("#")]
    assert [r["workload"] for r in csv.DictReader(table)] == [r["workload"] for r in rows]
    assert "x lower" not in stdout and "2,048-token system prompt + question" in stdout
