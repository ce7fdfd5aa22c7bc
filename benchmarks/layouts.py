"""Pinned activation layouts vs the partitioner's own, on the 8-device CPU configs, in one
process.

    python benchmarks/layouts.py [--quick] [--out DIR] [--force]

For each config (configs/inference/cpu8-local.yml, cpu8-all-to-all.yml: the shipped k3-small
on tensor 2 x expert 4), two engines over the same checkpoint: one as the model runs
(`sharding.constrain_features` / `gather_features` pin the residual stream whole and gather
activations, never weights), one traced inside `sharding.unpinned_activations()`, the layout
before the pins (the partitioner then gathers a LatentMoE projection weight in every MoE
layer). Measured interleaved (one call of each per round after a warm-up call each):
`Engine.decode_batch` on the built-in prompt set (batch 20), decode tokens/s from the on-device
loop, plus each decode step's collectives read from its compiled HLO
(`k3text.tools.collectives`: per step, bytes, parameter moves) and whether both produce the
same tokens.

On CPU the 8 devices are threads of one process: collective costs are XLA:CPU's in-process
rendezvous, not an interconnect, so the step times say little about a TPU; the collective
counts and bytes are the partitioner's and carry over. Outputs in --out (default
benchmarks/results/layouts/): layouts.jsonl (line 1 the machine), layouts.csv.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchlib

os.environ["XLA_FLAGS"] = benchlib.with_host_devices(os.environ.get("XLA_FLAGS", ""), 8)

import jax

from k3text import decode, sharding
from k3text.config import CONFIG_DIR, load_config
from k3text.inference.engine import build_engine
from k3text.tokenizer import load_tokenizer, tokenizer_file
from k3text.tools import collectives, compile_check
from k3text.tools.tables import table

CONFIGS = ("cpu8-local.yml", "cpu8-all-to-all.yml")
LAYOUTS = {"pinned": contextlib.nullcontext, "partitioner's own": sharding.unpinned_activations}
FIELDS = ("config", "layout", "tokens_per_s", "ms_per_step", "vs_pinned", "collectives",
          "collective_mb", "parameter_collectives", "same_tokens")


def decode_step_report(cfg: Any, ctx: sharding.MeshContext, layout: str,
                       ) -> collectives.Report:
    with sharding.use_mesh(ctx.mesh, ctx.rules), LAYOUTS[layout]():
        fn, args = compile_check.programs(compile_check.abstract_inputs(cfg, ctx))["decode step"]
        compiled, partitioned = collectives.partitioned_hlo(fn.lower(*args))
    return collectives.read(compiled.as_text(), partitioned_module=partitioned)


def measure(config: str, repeats: int) -> list[dict[str, Any]]:
    cfg = load_config(CONFIG_DIR / "inference" / config)
    tokenizer = load_tokenizer(cfg.tokenizer_type, tokenizer_file(cfg))
    prompts = [list(r.prompt_ids) for r in decode.collect_requests(cfg, tokenizer)]
    engines = {layout: build_engine(cfg) for layout in LAYOUTS}

    def run(layout: str):
        engine, _ = engines[layout]
        with LAYOUTS[layout]():  # the first call traces: the layout is fixed there
            return engine.decode_batch(prompts)

    # Warm-up call of each, then rounds of one call each, as benchmarks/baselines.py does.
    for layout in LAYOUTS:
        run(layout)
    out: dict[str, list[Any]] = {layout: [] for layout in LAYOUTS}
    for _ in range(repeats):
        for layout in LAYOUTS:
            out[layout].append(run(layout))
    rows = []
    for layout, gens in out.items():
        report = decode_step_report(cfg, engines[layout][1], layout)
        seconds = benchlib.median(g.decode_seconds / (g.decode_steps - 1) for g in gens)
        rows.append({"config": config, "layout": layout,
                     "tokens_per_s": cfg.global_batch_size / seconds,
                     "ms_per_step": seconds * 1e3, "collectives": report.count,
                     "collective_mb": report.partitioned_bytes / 1e6,
                     "parameter_collectives": sum(c.per_call
                                                  for c in report.moving_parameters()),
                     "same_tokens": gens[0].output_ids == out["pinned"][0].output_ids})
    for row in rows:
        row["vs_pinned"] = rows[0]["ms_per_step"] / row["ms_per_step"]
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--out", type=Path, default=benchlib.RESULTS / "layouts")
    parser.add_argument("--force", action="store_true",
                        help="replace the results files of an earlier run in --out")
    args = parser.parse_args(argv)
    return benchlib.run_checked(lambda: run(args))


def run(args: argparse.Namespace) -> int:
    benchlib.check_outputs([args.out / "layouts.jsonl", args.out / "layouts.csv"], args.force)
    machine = benchlib.machine(devices=jax.device_count())
    print(benchlib.machine_line(machine))
    repeats = 3 if args.quick else 7
    rows = [row for config in CONFIGS for row in measure(config, repeats)]
    print(table(["config", "layout", "tokens/s", "ms/step", "speed vs pinned", "collectives",
                 "MB/step", "weight moves", "same tokens"],
                [[r["config"], r["layout"], f"{r['tokens_per_s']:.1f}",
                  f"{r['ms_per_step']:.2f}", f"{r['vs_pinned']:.2f}x", str(r["collectives"]),
                  f"{r['collective_mb']:.3f}", str(r["parameter_collectives"]),
                  str(r["same_tokens"])] for r in rows],
                title=f"decode step, k3-small on 8 CPU devices, batch 20, median of {repeats} "
                      f"interleaved runs; collectives per step from the compiled HLO, MB at "
                      f"the partitioner's dtypes"))
    benchlib.write_jsonl(args.out / "layouts.jsonl", machine, rows)
    benchlib.write_csv(args.out / "layouts.csv", machine, FIELDS, rows)
    print(f"wrote layouts.jsonl/.csv in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
