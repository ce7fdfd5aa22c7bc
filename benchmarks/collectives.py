"""Collective latency: the fixed cost of one small all_to_all / psum call (report §12.1 ⑩).

    python benchmarks/collectives.py [--quick] [--runs N] [--out DIR] [--force]

Method, on a 1-D mesh over every device (8 fake devices on CPU unless XLA_FLAGS sets a count):

- payload: bytes each device contributes to one call (64 B .. 16 KiB, float32; rounded up so
  all_to_all splits it evenly over the devices);
- one jitted program makes N calls (N up to 1000, unrolled):
  chained      x <- op(x), N times: each call needs the previous result, as one layer's
               dispatch needs the previous layer's combine;
  independent  op(x_i) for N separate inputs: nothing orders the calls, so XLA may overlap
               (or combine) them;
- baseline: the same program with op = identity (same arguments, outputs, dispatch, sync);
- per call = (program time - median baseline time) / N, p50 and p90 over the timed runs;
- the compiled HLO is read back: `hlo_ops` is how many ops of the measured kind the program
  really holds (XLA combines independent all-reduces, so N psums may run as a few).

Programs hold pure collectives (no elementwise work, so no per-call fusions to compile, and no
LAPACK custom calls, which can deadlock XLA:CPU's multi-device rendezvous). Chained psum stays
N all-reduces (checked by `hlo_ops`). Inputs are zeros, so chained sums never overflow.

On CPU the devices are threads of one process: the numbers measure XLA:CPU's in-process
rendezvous (thread hand-offs on however many cores there are), not an interconnect. The output
says so. Outputs in --out (default benchmarks/results/collectives/): collectives.jsonl (line 1
the machine, then one object per cell), collectives.csv, collectives.png.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import benchlib

os.environ["XLA_FLAGS"] = benchlib.with_host_devices(os.environ.get("XLA_FLAGS", ""), 8)

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from k3text.tools.tables import table

# A mesh of this benchmark's own, outside the model's logical axes.
AXIS = "devices"
OPS: dict[str, tuple[Callable[[jax.Array], jax.Array], str]] = {
    "all_to_all": (lambda x: jax.lax.all_to_all(x, AXIS, 0, 0, tiled=True), "all-to-all"),
    "psum": (lambda x: jax.lax.psum(x, AXIS), "all-reduce"),
}
MODES = ("chained", "independent")
PAYLOADS = (64, 256, 1024, 4096, 16384)
CALLS = (1, 10, 100, 1000)
QUICK_PAYLOADS = (64, 1024, 16384)
QUICK_CALLS = (1, 10, 100)
FIELDS = ("op", "mode", "payload_bytes", "bytes_per_device", "calls", "devices",
          "per_call_us_p50", "per_call_us_p90", "program_ms_p50", "baseline_ms_p50",
          "hlo_ops", "hlo", "compile_s")
CPU_WARNING = ("FAKE CPU DEVICES: these numbers measure XLA:CPU's in-process rendezvous between "
               "device threads, not an interconnect. Do not compare them with TPU figures.")


def program(op: Callable[[jax.Array], jax.Array], mode: str, calls: int
            ) -> Callable[[Any], Any]:
    """The per-device body: `calls` applications of `op`, chained or on separate inputs."""
    if mode == "chained":
        def chained(x):
            for _ in range(calls):
                x = op(x)
            return x

        return chained
    return lambda xs: [op(x) for x in xs]


def compile_program(mesh: Mesh, body: Callable, args: Any) -> tuple[Any, float]:
    spec = jax.tree.map(lambda _: PartitionSpec(AXIS), args)
    jitted = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=spec,
                                   check_vma=False))
    t0 = time.perf_counter()
    compiled = jitted.lower(args).compile()
    return compiled, time.perf_counter() - t0


def timings(compiled: Any, args: Any, runs: int) -> list[float]:
    jax.block_until_ready(compiled(args))  # first run: allocation, thread start-up
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(args))
        samples.append(time.perf_counter() - t0)
    return samples


def measure(mesh: Mesh, op_name: str, mode: str, payload: int, calls: int,
            runs: int) -> dict[str, Any]:
    n = mesh.size
    elems = -(-payload // 4 // n) * n  # per device, a multiple of n for all_to_all's split
    x = jax.device_put(jnp.zeros(n * elems, jnp.float32),
                       NamedSharding(mesh, PartitionSpec(AXIS)))
    args = x if mode == "chained" else [x] * calls
    op, hlo_name = OPS[op_name]
    compiled, compile_s = compile_program(mesh, program(op, mode, calls), args)
    baseline, _ = compile_program(mesh, program(lambda v: v, mode, calls), args)
    base = benchlib.median(timings(baseline, args, runs))
    times = timings(compiled, args, runs)
    per_call = [(t - base) / calls for t in times]
    ops = benchlib.hlo_collectives(compiled.as_text())
    return {
        "op": op_name, "mode": mode, "payload_bytes": payload, "bytes_per_device": elems * 4,
        "calls": calls, "devices": n,
        "per_call_us_p50": benchlib.percentile(per_call, 50) * 1e6,
        "per_call_us_p90": benchlib.percentile(per_call, 90) * 1e6,
        "program_ms_p50": benchlib.median(times) * 1e3,
        "baseline_ms_p50": base * 1e3,
        "hlo_ops": ops.get(hlo_name, 0), "hlo": benchlib.counts_text(ops),
        "compile_s": compile_s,
    }


def plot(rows: Sequence[Mapping[str, Any]], path: Path, machine: Mapping[str, Any]) -> None:
    """Per-call p50 against payload (at the largest N) and against N (at 1 KiB or the
    nearest payload measured)."""
    plt = benchlib.pyplot()
    most = max(r["calls"] for r in rows)
    payloads = sorted({r["payload_bytes"] for r in rows})
    mid = min(payloads, key=lambda p: abs(p - 1024))
    fig, (by_payload, by_calls) = plt.subplots(1, 2, figsize=(11, 4.2))
    for op, mode in itertools.product(OPS, MODES):
        mine = [r for r in rows if r["op"] == op and r["mode"] == mode]
        at_most = sorted((r for r in mine if r["calls"] == most), key=lambda r: r["payload_bytes"])
        at_mid = sorted((r for r in mine if r["payload_bytes"] == mid), key=lambda r: r["calls"])
        by_payload.plot([r["payload_bytes"] for r in at_most],
                        [r["per_call_us_p50"] for r in at_most], marker="o", label=f"{op} {mode}")
        by_calls.plot([r["calls"] for r in at_mid], [r["per_call_us_p50"] for r in at_mid],
                      marker="o", label=f"{op} {mode}")
    by_payload.set(xscale="log", xlabel="payload per device (bytes)", ylabel="µs per call (p50)",
                   title=f"N = {most} calls")
    by_calls.set(xscale="log", xlabel="calls N in one program", ylabel="µs per call (p50)",
                 title=f"payload {mid} B")
    for ax in (by_payload, by_calls):
        ax.grid(alpha=0.3)
    by_payload.legend(fontsize=8)
    fake = " - FAKE CPU DEVICES (in-process rendezvous, not an interconnect)" \
        if machine["fake_cpu_devices"] else ""
    fig.suptitle(f"collective latency on {machine['devices']} x {machine['device_kind']}{fake}",
                 fontsize=10)
    benchlib.save_figure(fig, path, machine)
    plt.close(fig)


def report(rows: Sequence[Mapping[str, Any]]) -> str:
    return table(
        ["op / mode / payload", "N", "µs/call p50", "p90", "program ms", "baseline ms",
         "hlo ops"],
        [[f"{r['op']} {r['mode']} {r['payload_bytes']} B", str(r["calls"]),
          f"{r['per_call_us_p50']:.2f}", f"{r['per_call_us_p90']:.2f}",
          f"{r['program_ms_p50']:.3f}", f"{r['baseline_ms_p50']:.3f}", str(r["hlo_ops"])]
         for r in rows],
        title="per-call cost = (program - baseline) / N")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"payloads {QUICK_PAYLOADS}, N up to {max(QUICK_CALLS)}, 5 runs")
    parser.add_argument("--runs", type=int, help="timed runs per program (default 20; 5 quick)")
    parser.add_argument("--out", type=Path, default=benchlib.RESULTS / "collectives")
    parser.add_argument("--force", action="store_true",
                        help="replace the results files of an earlier run in --out")
    args = parser.parse_args(argv)
    if args.runs is not None and args.runs < 1:
        parser.error(f"argument --runs: expected an integer >= 1, got {args.runs}")
    return benchlib.run_checked(lambda: run(args))


def run(args: argparse.Namespace) -> int:
    benchlib.check_outputs([args.out / f"collectives.{ext}" for ext in ("jsonl", "csv", "png")],
                           args.force)
    payloads, calls = (QUICK_PAYLOADS, QUICK_CALLS) if args.quick else (PAYLOADS, CALLS)
    runs = args.runs or (5 if args.quick else 20)
    machine = benchlib.machine()
    warning = CPU_WARNING if machine["backend"] == "cpu" else ""
    if warning:
        print(f"\n*** {warning} ***\n", file=sys.stderr)
    mesh = Mesh(np.asarray(jax.devices()), (AXIS,))
    cells = list(itertools.product(OPS, MODES, payloads, calls))
    rows = [measure(mesh, *cell, runs) for cell in tqdm(cells, desc="collectives", unit="cell",
                                                        file=sys.stderr)]
    header = {"machine": machine, "warning": warning, "runs": runs,
              "method": "per call = (program - identity baseline) / N, N unrolled calls"}
    benchlib.write_jsonl(args.out / "collectives.jsonl", header, rows)
    benchlib.write_csv(args.out / "collectives.csv", {**machine, "warning": warning}, FIELDS,
                       rows)
    plot(rows, args.out / "collectives.png", machine)
    print(report(rows))
    if warning:
        print(f"\n*** {warning} ***")
    print(f"wrote {args.out}/collectives.{{jsonl,csv,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
