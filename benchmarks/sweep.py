"""Config sweeps: real decode runs over a grid of config keys.

    python benchmarks/sweep.py SWEEP.yml [--out DIR] [--force] [--list] [key=value ...]

A sweep file (YAML, every key but `base` and `prompt_lengths` optional):

    name: cpu-k3-tiny                  # default: the file name without .yml
    base: configs/models/k3-tiny.yml   # config every point starts from (relative to the repo)
    fixed: {max_decode_steps: 32}      # config keys set at every point
    grid:                              # config keys swept; every combination is one config
      per_device_batch_size: [1, 8]
      moe_ep_mode: [local, all_to_all]
    prompt_lengths: [16, 64]           # prompt tokens; every config runs every length
    repeats: 3                         # timed repetitions per point, after one warm-up

`key=value` arguments after the file are config overrides for every point (like `fixed`; e.g.
`load_parameters_path=...`); a key swept in `grid` cannot also be given there. Every point runs
with `ignore_eos=true`, so it always decodes its whole step budget.

Each distinct config builds one Engine (mesh, weights, compiled programs) that then serves
every prompt length; consecutive configs that agree on the model keys, dtypes, mesh and weight
source (WEIGHT_KEYS) share the placed weights instead of loading them again. A point is one
(config, prompt length):

1. warm-up: one `Engine.decode_batch` -> `first_call_s` (at a config's first point this compiles
   prefill and the decode loop, or loads them from the persistent compilation cache);
2. `repeats` x `Engine.decode_batch` on fresh random prompts (median over repeats):
   `ttft_ms` = prefill_seconds (time to first token), `decode_tokens_per_s` =
   batch x (steps - 1) / decode_seconds and `loop_step_ms` = decode_seconds / (steps - 1), both
   from the on-device decode loop;
3. per-step latency: `Engine.step` in a timed Python loop, each step waited for
   (`block_until_ready`) -> `step_ms_p50` / `step_ms_p90` over repeats x (steps - 1) steps.
   That is the jit-per-step shape: dispatch + device time + host sync, per step;
4. memory: `compiled.memory_analysis()` of that decode step (`step_peak_mib` = arguments +
   outputs - aliased (donated) + temporaries; `step_temp_mib`) and the process RSS after the
   point (`rss_mib`: everything alive in the process, indicative only);
5. what ran: the MoE expert kernel `moe.routed_experts` picks for prefill chunks and decode
   steps (`gathered` = hit experts only, `grouped` = ragged_dot grouped matmul, `reference`;
   `moe.expert_implementation`), the expert-parallel
   combine (`-` none, `psum`, `a2a-padded`, `a2a-ragged`), and the collectives in the compiled
   decode step (static op counts; a scanned layer group's ops count once).

Outputs in --out (default benchmarks/results/NAME/): NAME.jsonl (line 1: machine and sweep;
then one object per point, FIELDS plus the grid keys), NAME.csv (same rows; `#` comment lines
carry the machine), NAME.png (decode tokens/s, TTFT and step p50 against the first grid key).
A point that fails at run time (e.g. out of memory) is recorded with its `error` and the sweep
goes on; the exit status is then 1. Configs, prompt lengths and the output files are validated
before anything runs: existing results are replaced only with --force. Ctrl-C writes the rows
measured so far (the header says `"interrupted": true`) and exits 130. Multi-device points run
on 8 fake CPU devices unless XLA_FLAGS already sets a count.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import benchlib

os.environ["XLA_FLAGS"] = benchlib.with_host_devices(os.environ.get("XLA_FLAGS", ""), 8)

import jax
import numpy as np
import yaml
from flax import nnx
from tqdm import tqdm

from k3text import files, sharding
from k3text.config import MESH_AXES, MODEL_KEYS, Config, ConfigError, load_config
from k3text.inference import sampling
from k3text.inference.engine import Engine, build_engine, enable_compilation_cache
from k3text.layers import moe, moe_dispatch
from k3text.layers.initializers import Init
from k3text.models.decoder import Decoder
from k3text.tools.tables import table

SCHEMA = {"name": str, "base": str, "fixed": dict, "grid": dict, "prompt_lengths": list,
          "repeats": int}
FORCED = {"ignore_eos": True}  # every point decodes its whole step budget

# Columns of every point, in order; the sweep's grid keys follow.
FIELDS = (
    "sweep", "point", "prompt_length", "batch", "decode_steps", "mesh", "devices",
    "moe_ep_mode", "moe_path_prefill", "moe_path_decode", "moe_transport",
    "expert_weight_format", "mla_cache_dtype", "prefill_chunk_size",
    "first_call_s", "ttft_ms", "decode_tokens_per_s", "loop_step_ms", "step_ms_p50",
    "step_ms_p90", "step_peak_mib", "step_temp_mib", "step_collectives", "rss_mib", "error",
)
PLOTTED = (("decode_tokens_per_s", "decode tokens/s (on-device loop)"),
           ("ttft_ms", "time to first token (ms)"),
           ("step_ms_p50", "Engine.step p50 (ms, Python loop)"))


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str
    base: str  # as written in the file
    fixed: dict[str, Any]
    grid: dict[str, list[Any]]
    prompt_lengths: tuple[int, ...]
    repeats: int

    @property
    def base_path(self) -> Path:
        base = Path(self.base)
        return base if base.is_absolute() else benchlib.ROOT / base

    def points(self) -> list[dict[str, Any]]:
        """Every combination of the grid values (first key slowest), in file order."""
        keys = list(self.grid)
        return [dict(zip(keys, values, strict=True))
                for values in itertools.product(*self.grid.values())]


def load_sweep(path: str | Path) -> Sweep:
    """Parse and check a sweep file's schema (not yet the configs it names)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"sweep file not found: {path}") from None
    except OSError as e:  # a directory, a file it may not read
        raise ConfigError(f"sweep file {path} cannot be read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a sweep file is a mapping of {sorted(SCHEMA)}")
    for key, value in raw.items():
        if key not in SCHEMA:
            raise ConfigError(f"{path}: unknown sweep key '{key}' (known: {sorted(SCHEMA)})")
        if not isinstance(value, SCHEMA[key]) or isinstance(value, bool):
            raise ConfigError(f"{path}: '{key}' must be a {SCHEMA[key].__name__}, got "
                              f"{value!r}")
    for key in ("base", "prompt_lengths"):
        if key not in raw:
            raise ConfigError(f"{path}: '{key}' is required")
    grid = raw.get("grid", {})
    for key, values in grid.items():
        if not isinstance(values, list) or not values or any(
                isinstance(v, dict | list) for v in values):
            raise ConfigError(f"{path}: grid.{key} must be a non-empty list of scalars")
    lengths = raw["prompt_lengths"]
    if not lengths or any(not isinstance(n, int) or isinstance(n, bool) or n < 1
                          for n in lengths):
        raise ConfigError(f"{path}: prompt_lengths must be positive integers, got {lengths}")
    fixed = raw.get("fixed", {})
    both = sorted(set(fixed) & set(grid))
    if both:
        raise ConfigError(f"{path}: {both} are both fixed and swept")
    repeats = raw.get("repeats", 3)
    if repeats < 1:
        raise ConfigError(f"{path}: repeats must be >= 1, got {repeats}")
    return Sweep(name=raw.get("name", path.stem), base=raw["base"], fixed=fixed, grid=grid,
                 prompt_lengths=tuple(lengths), repeats=repeats)


def point_config(sweep: Sweep, point: Mapping[str, Any], overrides: Sequence[str]) -> Config:
    """The config of one grid point: base <- fixed <- command line <- point <- FORCED."""
    given = {item.split("=", 1)[0].strip() for item in overrides}
    if swept := sorted(given & set(sweep.grid)):
        raise ConfigError(f"{swept} are swept in the grid; they cannot be overridden on the "
                          f"command line")
    if forced := sorted(set(FORCED) & (given | set(sweep.fixed) | set(sweep.grid))):
        raise ConfigError(f"{forced} are set by the sweep itself ({FORCED})")
    fixed = {k: v for k, v in sweep.fixed.items() if k not in given}
    return load_config(sweep.base_path, overrides, **fixed, **point, **FORCED)


def check_config(sweep: Sweep, cfg: Config, where: str) -> None:
    """Everything a point could fail on before it runs: devices, step budget, prompt lengths."""
    if cfg.num_devices > jax.device_count():
        raise ConfigError(f"{where}: the mesh needs {cfg.num_devices} devices, "
                          f"{jax.device_count()} are available")
    if cfg.max_decode_steps < 2:
        raise ConfigError(f"{where}: max_decode_steps must be >= 2 (the first token comes "
                          f"from prefill; the loop makes the rest)")
    for n in sweep.prompt_lengths:
        if n > cfg.max_prefill_predict_length:
            raise ConfigError(f"{where}: prompt length {n} exceeds max_prefill_predict_length="
                              f"{cfg.max_prefill_predict_length}")
        if n + cfg.max_decode_steps > cfg.max_target_length:
            raise ConfigError(f"{where}: prompt length {n} + max_decode_steps="
                              f"{cfg.max_decode_steps} exceeds max_target_length="
                              f"{cfg.max_target_length}")


# --------------------------------------------------------------------------------------------
# What ran.
# --------------------------------------------------------------------------------------------


def moe_path(cfg: Config, ctx: sharding.MeshContext, tokens: int) -> str:
    """The expert kernel `moe.routed_experts` picks for `tokens` routed tokens (global)."""
    if not cfg.num_experts:
        return "-"
    return moe.expert_implementation(cfg, ctx, tokens)


def moe_transport(cfg: Config, ctx: sharding.MeshContext) -> str:
    if not cfg.num_experts or ctx.size("exp") == 1:
        return "-"
    if cfg.moe_ep_mode == "local":
        return "psum"
    return f"a2a-{moe_dispatch.transport(cfg)}"


def describe(cfg: Config, ctx: sharding.MeshContext) -> dict[str, Any]:
    batch = cfg.global_batch_size
    return {
        "batch": batch,
        "decode_steps": cfg.max_decode_steps,
        "mesh": " ".join(f"{a}={n}" for a, n in cfg.mesh_shape.items()),
        "devices": cfg.num_devices,
        "moe_ep_mode": cfg.moe_ep_mode,
        "moe_path_prefill": moe_path(cfg, ctx, batch * cfg.prefill_chunk_size),
        "moe_path_decode": moe_path(cfg, ctx, batch),
        "moe_transport": moe_transport(cfg, ctx),
        "expert_weight_format": cfg.expert_weight_format,
        "mla_cache_dtype": cfg.mla_cache_dtype,
        "prefill_chunk_size": cfg.prefill_chunk_size,
    }


# --------------------------------------------------------------------------------------------
# Measuring one point.
# --------------------------------------------------------------------------------------------


def random_prompts(cfg: Config, length: int, rng: np.random.Generator) -> list[list[int]]:
    return rng.integers(0, cfg.vocab_size, (cfg.global_batch_size, length)).tolist()


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        tree)


def step_memory(engine: Engine, ctx: sharding.MeshContext, args: Any) -> dict[str, Any]:
    """Compiler memory figures and collectives of the decode step `Engine.step` just ran.

    Lowering the engine's own jitted step with the avals and shardings it was called with (and
    under the same mesh) hits the compilation cache, so nothing is compiled twice.
    """
    with sharding.use_mesh(ctx.mesh, ctx.rules):
        compiled = engine._step.lower(*args).compile()
    stats = compiled.memory_analysis()
    memory = {"step_peak_mib": None, "step_temp_mib": None}
    if stats is not None:
        peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
        memory = {"step_peak_mib": peak / benchlib.MiB,
                  "step_temp_mib": stats.temp_size_in_bytes / benchlib.MiB}
    ops = benchlib.hlo_collectives(compiled.as_text())
    return {**memory, "step_collectives": benchlib.counts_text(ops)}


def step_latencies(engine: Engine, ctx: sharding.MeshContext, prompts: list[list[int]],
                   repeats: int) -> tuple[list[float], dict[str, Any]]:
    """Seconds per `Engine.step` (each waited for), over `repeats` runs of steps - 1 steps
    after a fresh prefill; plus the step's memory figures."""
    cfg = engine.cfg
    # Replicated over the mesh, as the step takes it (`step_memory` lowers with its sharding).
    key = jax.device_put(jax.random.key(cfg.seed), ctx.sharding(()))

    def start():
        logits, state = engine.prefill(prompts, len(prompts))
        return sampling.sample(cfg, logits, key)[0], state

    # Warm-up: the first step takes the sampled prefill tokens, later ones the step's own
    # outputs; their shardings may differ, so both variants compile before timing starts.
    tokens, state = start()
    for _ in range(2):
        args = _abstract((engine._weights, tokens, state, key))
        tokens, _, _, state = engine.step(tokens, state, key)
    tokens.block_until_ready()
    memory = step_memory(engine, ctx, args)
    samples = []
    for _ in range(repeats):
        tokens, state = start()
        for _ in range(cfg.max_decode_steps - 1):
            t0 = time.perf_counter()
            tokens, _, _, state = engine.step(tokens, state, key)
            tokens.block_until_ready()
            samples.append(time.perf_counter() - t0)
    return samples, memory


def measure(engine: Engine, ctx: sharding.MeshContext, length: int, repeats: int,
            rng: np.random.Generator) -> dict[str, Any]:
    cfg = engine.cfg
    batch = cfg.global_batch_size
    t0 = time.perf_counter()
    engine.decode_batch(random_prompts(cfg, length, rng), batch=batch)
    first_call = time.perf_counter() - t0
    gens = [engine.decode_batch(random_prompts(cfg, length, rng), batch=batch)
            for _ in range(repeats)]
    steps, memory = step_latencies(engine, ctx, random_prompts(cfg, length, rng), repeats)
    return {
        "first_call_s": first_call,
        "ttft_ms": benchlib.median(g.prefill_seconds for g in gens) * 1e3,
        "decode_tokens_per_s": benchlib.median(
            benchlib.loop_tokens_per_s(batch, g.decode_steps, g.decode_seconds) for g in gens),
        "loop_step_ms": benchlib.median(g.decode_seconds / (g.decode_steps - 1)
                                        for g in gens) * 1e3,
        "step_ms_p50": benchlib.percentile(steps, 50) * 1e3,
        "step_ms_p90": benchlib.percentile(steps, 90) * 1e3,
        **memory,
        "rss_mib": benchlib.rss_mib(),
    }


# --------------------------------------------------------------------------------------------
# The sweep.
# --------------------------------------------------------------------------------------------


def expand(sweep: Sweep, overrides: Sequence[str]) -> list[tuple[dict[str, Any], Config]]:
    """(grid point, validated config) for every point, before anything runs."""
    configs = []
    for i, point in enumerate(sweep.points()):
        cfg = point_config(sweep, point, overrides)
        check_config(sweep, cfg, f"point {i} {point}")
        configs.append((point, cfg))
    return configs


# Keys that fix the placed parameters: configs agreeing on all of them share one set of weights.
WEIGHT_KEYS = sorted(MODEL_KEYS | {"weight_dtype", "dtype", "load_parameters_path", "init_seed",
                                   "logical_axis_rules", "scan_layers",
                                   *(f"{kind}_{axis}_parallelism"
                                                           for kind in ("ici", "dcn")
                                                           for axis in MESH_AXES)})


@dataclasses.dataclass
class Weights:
    """The placed parameters of the last config built, kept for the next one that shares them
    (on TPU a config switch would otherwise reload the whole checkpoint)."""

    key: tuple
    params: Any
    ctx: sharding.MeshContext


def engine_for(cfg: Config, weights: Weights | None) -> tuple[Engine, Weights]:
    """`build_engine(cfg)`, or an Engine over `weights` when they fit `cfg`. The model is
    rebuilt from `cfg` (shapes only) so every module sees this config's inference keys."""
    key = tuple(repr(cfg[k]) for k in WEIGHT_KEYS)
    if weights is not None and weights.key == key:
        graphdef = nnx.graphdef(Decoder(cfg, Init(abstract=True)))
        return Engine(cfg, nnx.merge(graphdef, weights.params), weights.ctx), weights
    engine, ctx = build_engine(cfg)
    return engine, Weights(key, engine.params, ctx)


def run_sweep(sweep: Sweep, overrides: Sequence[str] = (),
              rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Run every point; one row per (config, prompt length), appended to `rows` as each is
    measured (so a caller interrupted midway keeps what was measured)."""
    configs = expand(sweep, overrides)
    rng = np.random.default_rng(0)
    rows = [] if rows is None else rows
    bar = tqdm(total=len(configs) * len(sweep.prompt_lengths), desc=sweep.name, unit="point",
               file=sys.stderr, disable=jax.process_index() != 0)
    enable_compilation_cache(configs[0][1])
    weights = None
    for point, cfg in configs:
        label = " ".join(f"{k}={v}" for k, v in point.items())
        engine = None
        build_error = None
        try:
            engine, weights = engine_for(cfg, weights)
        except jax.errors.JaxRuntimeError as e:
            build_error = f"build: {str(e).splitlines()[0]}"
        for length in sweep.prompt_lengths:
            bar.set_postfix_str(f"{label} prompt={length}")
            row = {"sweep": sweep.name, "point": len(rows), "prompt_length": length, **point,
                   "error": build_error}
            if engine is not None:
                row.update(describe(cfg, weights.ctx))
                try:
                    row.update(measure(engine, weights.ctx, length, sweep.repeats, rng))
                except jax.errors.JaxRuntimeError as e:
                    row["error"] = str(e).splitlines()[0]
            rows.append(row)
            bar.update()
        # Drop this config's compiled programs before the next one builds.
        del engine
        gc.collect()
        jax.clear_caches()
    bar.close()
    return rows


def columns(sweep: Sweep) -> list[str]:
    return [*FIELDS, *(k for k in sweep.grid if k not in FIELDS)]


def header(sweep: Sweep, overrides: Sequence[str]) -> dict[str, Any]:
    described = {**dataclasses.asdict(sweep), "prompt_lengths": list(sweep.prompt_lengths),
                 "overrides": list(overrides), "forced": FORCED}
    return {"machine": benchlib.machine(), "sweep": described}


def plot(sweep: Sweep, rows: Sequence[Mapping[str, Any]], path: Path,
         machine: Mapping[str, Any]) -> None:
    """Each PLOTTED metric against the first grid key (categorical positions), one line per
    combination of the other grid keys and the prompt length."""
    plt = benchlib.pyplot()
    values = {**sweep.grid, "prompt_length": list(sweep.prompt_lengths)}
    x_key = next(iter(values))
    xs = values[x_key]
    series_keys = [k for k in values if k != x_key]

    def series_of(row: Mapping[str, Any]) -> tuple:
        return tuple(values[k].index(row[k]) for k in series_keys)

    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(5 * len(PLOTTED), 4.2))
    for ax, (metric, label) in zip(axes, PLOTTED, strict=True):
        for series, members in itertools.groupby(sorted(rows, key=series_of), key=series_of):
            done = [r for r in members if r.get(metric) is not None]
            ax.plot([xs.index(r[x_key]) for r in done], [r[metric] for r in done], marker="o",
                    label=" ".join(f"{k}={values[k][i]}" for k, i in zip(series_keys, series,
                                                                          strict=True)))
        ax.set_xticks(range(len(xs)), [str(x) for x in xs])
        ax.set_xlabel(x_key)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"sweep {sweep.name} (base {sweep.base})")
    benchlib.save_figure(fig, path, machine)
    plt.close(fig)


def output_paths(sweep: Sweep, out: Path) -> dict[str, Path]:
    return {ext: out / f"{sweep.name}.{ext}" for ext in ("jsonl", "csv", "png")}


def write_outputs(sweep: Sweep, rows: list[dict[str, Any]], out: Path,
                  overrides: Sequence[str] = (), interrupted: bool = False) -> dict[str, Path]:
    head = header(sweep, overrides)
    if interrupted:
        head["interrupted"] = True  # the rows are the points measured before Ctrl-C
    paths = output_paths(sweep, out)
    benchlib.write_jsonl(paths["jsonl"], head, rows)
    benchlib.write_csv(paths["csv"], head["machine"], columns(sweep), rows)
    plot(sweep, rows, paths["png"], head["machine"])
    return paths


def summary(sweep: Sweep, rows: Sequence[Mapping[str, Any]]) -> str:
    def cell(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    keys = [*sweep.grid, "prompt_length"]
    return table(
        ["point", "TTFT ms", "tok/s", "loop ms/step", "step p50", "p90", "peak MiB", "MoE decode",
         "combine"],
        [[" ".join(f"{k}={r[k]}" for k in keys), cell(r.get("ttft_ms"), ".1f"),
          cell(r.get("decode_tokens_per_s"), ".1f"), cell(r.get("loop_step_ms"), ".2f"),
          cell(r.get("step_ms_p50"), ".2f"), cell(r.get("step_ms_p90"), ".2f"),
          cell(r.get("step_peak_mib"), ".1f"), r.get("moe_path_decode", "-"),
          r.get("moe_transport", "-")] for r in rows],
        title=f"sweep {sweep.name}: median over {sweep.repeats} repeats; step = Engine.step "
              f"in a Python loop")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help="sweep YAML file")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--out", type=Path, help="output directory "
                        "(default benchmarks/results/NAME/)")
    parser.add_argument("--list", action="store_true",
                        help="validate and print the points, run nothing")
    parser.add_argument("--force", action="store_true",
                        help="replace the results files of an earlier run in --out")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    rows: list[dict[str, Any]] = []
    interrupted = False
    try:
        sweep = load_sweep(args.sweep)
        out = args.out or benchlib.RESULTS / sweep.name
        sharding.maybe_initialize_distributed(point_config(sweep, sweep.points()[0],
                                                           args.overrides))
        if args.list:
            for i, (point, cfg) in enumerate(expand(sweep, args.overrides)):
                print(f"{i}: {point} batch={cfg.global_batch_size} mesh={cfg.mesh_shape} "
                      f"prompt_lengths={list(sweep.prompt_lengths)}")
            return 0
        if jax.process_index() == 0:  # before an hour of points, not after
            benchlib.check_outputs(output_paths(sweep, out).values(), args.force)
        try:
            run_sweep(sweep, args.overrides, rows)
        except KeyboardInterrupt:
            interrupted = True
            print(f"interrupted: writing the {len(rows)} rows measured", file=sys.stderr)
        if jax.process_index() == 0 and rows:
            paths = write_outputs(sweep, rows, out, args.overrides, interrupted)
            print(summary(sweep, rows))
            print("wrote " + ", ".join(str(p) for p in paths.values()))
    except (ValueError, OSError) as e:  # ConfigError; ValueError: distributed init
        print(f"error: {e}", file=sys.stderr)
        return files.exit_status(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if interrupted:
        return 130
    failed = [r for r in rows if r["error"]]
    for r in failed:
        print(f"point {r['point']} failed: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
