"""What every benchmark job shares: fake host devices, the machine description, timing
statistics, and results files (JSON lines, CSV, PNG) that carry that description.

Nothing here imports jax at module level: the job scripts import this module, set XLA_FLAGS,
and only then import jax (XLA reads its flags once, when the backend starts).
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from k3text import files

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
MiB = 2**20
_COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|all-to-all|ragged-all-to-all|"
                         r"collective-permute|reduce-scatter)(?:-start)?\(")


def stack() -> str:
    """The jax and jaxlib wheels this process runs, for every table's title (CPU figures move
    with the wheel). Imports jax: call it after XLA_FLAGS is set."""
    import jax
    import jaxlib

    return f"jax {jax.__version__} / jaxlib {jaxlib.__version__}"


def with_host_devices(flags: str, count: int) -> str:
    """XLA_FLAGS asking for `count` host (CPU) devices, unless `flags` already sets a count."""
    if HOST_DEVICES_FLAG in flags:
        return flags
    return f"{flags} {HOST_DEVICES_FLAG}={count}".strip()


# --------------------------------------------------------------------------------------------
# The machine.
# --------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) * 1024 / 2**30, 1)
    except OSError:
        pass
    return None


def _commit() -> str:
    """The repository commit the numbers came from ("+" when the tree had local changes)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    return f"{commit}+" if commit and git("status", "--porcelain", "--untracked-files=no") \
        else commit


def machine(**extra: Any) -> dict[str, Any]:
    """Where and with what the numbers were measured (written into every results file)."""
    import flax
    import jax
    import jaxlib

    devices = jax.devices()
    backend = jax.default_backend()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": _ram_gib(),
        "backend": backend,
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "fake_cpu_devices": backend == "cpu" and len(devices) > 1,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),  # e.g. jemalloc (README: serving)
        "commit": _commit(),
        "core_round_trip_ns": core_round_trip_ns(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        **extra,
    }


def machine_line(m: Mapping[str, Any]) -> str:
    """One line for plot footers and printed reports."""
    fake = " (fake CPU devices)" if m["fake_cpu_devices"] else ""
    preload = f" | preloaded {Path(m['ld_preload']).name}" if m.get("ld_preload") else ""
    trip = m.get("core_round_trip_ns")
    trip = f" | core round trip {round_trip_text(trip)}" if trip is not None else ""
    return (f"{m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB{trip} | {m['backend']} x "
            f"{m['devices']}{fake} | jax {m['jax']} / jaxlib {m['jaxlib']}{preload} | "
            f"{m['date']}")


def round_trip_text(ns: float | None) -> str:
    """A `core_round_trip_ns` figure as printed."""
    return "-" if ns is None else f"{ns:.0f} ns"


# The echoing side of `core_round_trip_ns`, run as its own interpreter (a fork of a process
# that has started XLA's threads is unsafe): pinned to one CPU, it answers each odd byte the
# other side writes into the shared page with the next even one.
_ECHO = """
import mmap, os, sys
path, rounds, cpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.sched_setaffinity(0, {cpu})
with open(path, "r+b") as f:
    buf = mmap.mmap(f.fileno(), 64)
buf[1] = 1
for i in range(rounds):
    want = (2 * i + 1) & 255
    while buf[0] != want:
        pass
    buf[0] = (want + 1) & 255
buf.close()
"""


def core_round_trip_ns(rounds: int = 20_000, timeout_s: float = 10.0) -> float | None:
    """Nanoseconds for one write to travel from this process's first CPU to its second and an
    answer back (two Python processes, each pinned, spinning on a shared byte); None with fewer
    than two CPUs or no CPU pinning.

    A measure of how far apart the host placed this machine's two cores, which it changes while
    a benchmark runs: where they share a cache the round trip is short, and XLA:CPU's programs
    that hand small buffers between its threads (the chunked KDA form, the server's steps) run
    at their best; where they do not it grows (about 300 against 400-700 ns on the machine
    benchmarks/README.md describes) and those programs slow by up to 2.4x. Benchmarks record it
    beside their timings so a slow run can be told from a slow machine."""
    import mmap
    import tempfile

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None
    if len(cpus) < 2:
        return None
    shm = Path("/dev/shm")
    fd, path = tempfile.mkstemp(prefix="k3text-round-trip-", dir=shm if shm.is_dir() else None)
    os.ftruncate(fd, 64)
    buf = mmap.mmap(fd, 64)
    os.close(fd)
    saved = os.sched_getaffinity(0)
    echo = None
    try:
        echo = subprocess.Popen([sys.executable, "-c", _ECHO, path, str(rounds), str(cpus[1])])
        os.sched_setaffinity(0, {cpus[0]})
        deadline = time.monotonic() + timeout_s
        while buf[1] != 1:  # the echo is up
            if echo.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("core_round_trip_ns: the echoing process did not start")
            time.sleep(0.001)
        start = 0.0
        for i in range(rounds):
            if i == rounds // 2:  # time the second half, both sides long since spinning
                start = time.perf_counter()
            want = (2 * i + 1) & 255
            buf[0] = want
            answer = (want + 1) & 255
            spins = 0
            while buf[0] != answer:
                spins += 1
                if spins & 0xFFFFF == 0 and (echo.poll() is not None
                                             or time.monotonic() > deadline):
                    raise RuntimeError("core_round_trip_ns: the echoing process stopped answering")
        return (time.perf_counter() - start) / (rounds - rounds // 2) * 1e9
    finally:
        os.sched_setaffinity(0, saved)
        if echo is not None:
            if echo.poll() is None:
                echo.kill()
            echo.wait()
        buf.close()
        os.unlink(path)


def rss_mib() -> float | None:
    """Resident set size of this process now (MiB), from /proc; None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def hlo_collectives(hlo: str) -> dict[str, int]:
    """Collective ops in compiled HLO text, by kind (static counts: an op inside a loop body
    counts once). Async pairs count by their -start half."""
    counts: dict[str, int] = {}
    for op in _COLLECTIVE.findall(hlo):
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items()))


def counts_text(counts: Mapping[str, int]) -> str:
    return " ".join(f"{op}:{n}" for op, n in counts.items()) or "-"


# --------------------------------------------------------------------------------------------
# Timing.
# --------------------------------------------------------------------------------------------


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(samples: Iterable[float]) -> float:
    return statistics.median(samples)


def loop_tokens_per_s(batch: int, decode_steps: int, decode_seconds: float) -> float:
    """Tokens/s of an on-device decode loop (`Engine.generate`): the first token of each
    sequence comes from the prefill logits, so the loop's model steps are decode_steps - 1."""
    return batch * (decode_steps - 1) / decode_seconds


def rounded(value: Any, digits: int = 4) -> Any:
    """Floats to `digits` significant digits for the results files (timings are not more
    precise than that on a shared machine); everything else unchanged."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    return value


# --------------------------------------------------------------------------------------------
# Results files.
# --------------------------------------------------------------------------------------------


# The results files `check_outputs` found absent: one that appears at such a path while the
# job runs (another run's) is kept, and these results are written beside it.
_ABSENT: set[Path] = set()


def check_outputs(paths: Iterable[Path], force: bool) -> None:
    """Before any work (a run can take an hour): every results file can be written where asked,
    and one that exists (an earlier run's, perhaps the committed one) is replaced only with
    --force. Raises `files.OutputError`."""
    for path in paths:
        files.check_output_file(path, "--out")
        if path.exists() and not force:
            raise files.OutputError(f"{path} already exists (an earlier run's results); use "
                                    f"--force to replace it, or give another --out")
        (_ABSENT.discard if path.exists() else _ABSENT.add)(Path(path).absolute())


def run_checked(work: Callable[[], int]) -> int:
    """A benchmark's `work()` (its exit status) with the commands' conventions: a bad input or
    a failed write (a full disk) is one `error:` line and exit 2 or 1, Ctrl-C one line and
    130; results files are written whole or not at all (`files.write_atomically`)."""
    try:
        return work()
    except (ValueError, OSError) as e:  # ConfigError and OutputError included
        print(f"error: {e}", file=sys.stderr)
        return files.exit_status(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _atomic_write(path: Path, write: Callable[[Any], None], binary: bool = False) -> None:
    """A failed run never leaves a half-written results file (`k3text.files`), nor replaces one
    that appeared since `check_outputs` found none."""
    files.write_atomically(path, write, binary=binary,
                           replace=Path(path).absolute() not in _ABSENT)


def write_jsonl(path: Path, header: Mapping[str, Any], rows: Iterable[Mapping[str, Any]]
                ) -> None:
    """Line 1: `header` (the machine, what ran); then one JSON object per row."""

    def write(f):
        f.write(json.dumps(header) + "\n")
        for row in rows:
            f.write(json.dumps({k: rounded(v) for k, v in row.items()}) + "\n")

    _atomic_write(path, write)


def write_csv(path: Path, header: Mapping[str, Any], fields: Sequence[str],
              rows: Iterable[Mapping[str, Any]]) -> None:
    """`# key: value` comment lines for `header`, then a CSV table with columns `fields`
    (read it with `pandas.read_csv(path, comment="#")`)."""

    def write(f):
        for key, value in header.items():
            if not isinstance(value, Mapping):
                f.write(f"# {key}: {value}\n")
        table = csv.DictWriter(f, fields, extrasaction="ignore")
        table.writeheader()
        for row in rows:
            table.writerow({k: rounded(v) for k, v in row.items()})

    _atomic_write(path, write)


def save_figure(fig: Any, path: Path, m: Mapping[str, Any]) -> None:
    """Save a matplotlib figure with the machine line as its footer."""
    fig.text(0.5, -0.02, machine_line(m), ha="center", va="top", fontsize=7, color="0.4")
    _atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"),
                  binary=True)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
