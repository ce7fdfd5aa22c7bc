"""Hugging Face safetensors -> k3text checkpoint (`k3text-convert`, tools/convert/hf_to_k3text.py).

    k3text-convert --hf-dir DIR --out OUT [--model-config YML] [--dry-run] [--force]
    k3text-convert --model-config YML --dry-run        # the inventory a model config expects

Three steps, each its own function:

1. `open_source`: read `config.json` (K3's `text_config` and `quantization_config` included) and
   every safetensors header, detect the layout (`names.detect_layout`), derive the model config,
   or check it against `--model-config` naming every key that disagrees.
2. `make_plan`: from the headers alone, map every tensor through the layout's name table to the
   region of the k3text parameter it fills (vision tensors dropped, gate+up and KDA q/k/v fused,
   kv_b_proj split into its k and v halves, experts stacked per layer, layers per scan group)
   and check names, shapes, dtypes, overlaps and coverage. `--dry-run` stops here and prints
   the inventory next to the one the model config expects (`expected_inventory`).
3. `convert`: stream the tensors in storage order, one at a time, into their regions of the
   stored arrays (`store`), so memory holds about one tensor plus the writes in flight, never
   the checkpoint; then write the model config and move the result into place.

Every user-caused problem ends as a `CheckpointError` / `ConfigError`; `main` prints it as one
line on stderr and exits non-zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from k3text import files
from k3text.checkpoint import hf, hf_config, names, store
from k3text.checkpoint.safetensors_io import DTYPES, CheckpointError, SafetensorsCheckpoint
from k3text.config import MODEL_KEYS, Config, ConfigError, config_from_dict, load_config

CONFIG_JSON = "config.json"
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_WEIGHT_DTYPES = {"BF16": "bfloat16", "F32": "float32"}


# --------------------------------------------------------------------------------------------
# 1. The source checkpoint and its model config.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
    directory: Path
    checkpoint: SafetensorsCheckpoint
    layout: str
    cfg: Config


def open_source(hf_dir: str | Path, model_config: str | Path | None = None) -> Source:
    """Headers, layout and model config of the HF checkpoint in `hf_dir` (no tensor data)."""
    directory = Path(hf_dir)
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise CheckpointError(f"{directory}: not a checkpoint directory (it {what})")
    config_json = _read_config_json(directory / CONFIG_JSON)
    checkpoint = SafetensorsCheckpoint(directory)
    layout = names.detect_layout(config_json, checkpoint.keys())
    try:
        keys = hf_config.model_keys(config_json)
    except (TypeError, AttributeError, ValueError, IndexError, KeyError) as e:
        # A section or value of the wrong JSON type ("text_config": null, a list where an
        # object belongs): the mapping's own error says which, the file says where.
        raise CheckpointError(f"{directory / CONFIG_JSON}: a field has the wrong type "
                              f"({type(e).__name__}: {e})") from None
    try:
        cfg = config_from_dict(keys, weight_dtype=_weight_dtype(checkpoint, layout))
    except ConfigError as e:
        raise CheckpointError(f"{directory / CONFIG_JSON}: {e}") from None
    if model_config is not None:
        cfg = _agree(cfg, Path(model_config), directory / CONFIG_JSON)
    return Source(directory, checkpoint, layout, cfg)


def _read_config_json(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; a Hugging Face checkpoint needs its "
                              f"config.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: top level is not a JSON object")
    return config


def _weight_dtype(checkpoint: SafetensorsCheckpoint, layout: str) -> str:
    """The checkpoint's weight dtype, read off its embedding table (k3text keeps it)."""
    name = names.global_tensor_names(layout, ("embed", "table"))[0]
    if name not in checkpoint:
        return "bfloat16"  # the plan reports the missing table
    dtype = _DTYPE_NAMES[checkpoint.info(name).dtype]
    if dtype not in _WEIGHT_DTYPES:
        raise CheckpointError(f"{checkpoint.info(name).file}: tensor {name!r} is {dtype}; "
                              f"k3text keeps weights as {' or '.join(_WEIGHT_DTYPES)}")
    return _WEIGHT_DTYPES[dtype]


def _agree(derived: Config, model_config: Path, config_json: Path) -> Config:
    """`derived` once every model key agrees with the `model_config` file (its label wins)."""
    given = load_config(model_config)
    differ = [f"{k}: {given[k]!r} vs {derived[k]!r}"
              for k in sorted(MODEL_KEYS - {"model_name"}) if given[k] != derived[k]]
    if differ:
        raise ConfigError(f"{model_config} disagrees with {config_json} on {len(differ)} model "
                          f"key(s) ({model_config.name} vs config.json): {'; '.join(differ)}")
    return derived.replace(model_name=given.model_name)


# --------------------------------------------------------------------------------------------
# 2. The plan: where every tensor goes, checked from the headers.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Placement:
    """One HF tensor's contribution to one k3text parameter."""

    param: str  # '.'-joined parameter path
    index: store.Index  # numpy-style index of the block inside the parameter
    slot: names.Slot


@dataclasses.dataclass
class Plan:
    source: Source
    placements: dict[str, list[Placement]]  # every text tensor, in storage order
    dropped: list[str]  # vision tensors
    arrays: dict[str, store.ArraySpec]
    problems: list[str]  # each names the tensor and its file; conversion needs none


@functools.lru_cache(maxsize=4096)
def _stand_in(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero-byte read-only array of any shape: reshaping it shows where a tensor would go.
    Cached: a K3 checkpoint has half a million tensors but few distinct shapes."""
    return np.broadcast_to(np.zeros((), dtype), shape)


def _castable(source: np.dtype, target: np.dtype) -> bool:
    """Same dtype, or a lossless widening between floating types (BF16 -> F32)."""
    return source == target or (jnp.issubdtype(source, jnp.floating)
                                and jnp.issubdtype(target, jnp.floating)
                                and np.can_cast(source, target, "safe"))


def make_plan(source: Source) -> Plan:
    cfg, checkpoint, layout = source.cfg, source.checkpoint, source.layout
    params = {hf.param_name(p): s for p, s in hf.abstract_params(cfg).items()}
    regions: dict[str, dict[tuple, str]] = {name: {} for name in params}
    rejected: set[str] = set()  # parameters a present tensor failed to fill
    plan = Plan(source, {}, [], {}, [])
    for name in checkpoint.keys():
        info = checkpoint.info(name)
        where = f"{info.file}: tensor {name!r}"
        try:
            slots = names.slots_for(cfg, name, layout)
        except names.UnknownTensorError as e:
            plan.problems.append(f"{info.file}: unexpected tensor: {e}")
            continue
        if slots is None:
            plan.dropped.append(name)
            continue
        plan.placements[name] = []
        for slot in slots:
            path, index = hf.destination(cfg, slot)
            param = hf.param_name(path)
            plan.placements[name].append(Placement(param, index, slot))
            problem = _check_block(source, slot, info, index, params.get(param), param)
            region = None if problem else store.box(index, params[param].shape)
            if region in regions.get(param, {}):
                problem = (f"fills the same part of k3text {param} as "
                           f"{regions[param][region]!r}")
            if problem:
                plan.problems.append(f"{where}: {problem}")
                rejected.add(param)
            else:
                regions[param][region] = name
    plan.problems += _coverage_problems(source, params, regions, rejected)
    for param, spec in params.items():
        dtype = np.dtype(spec.dtype)
        plan.arrays[param] = store.ArraySpec(
            spec.shape, dtype, store.chunk_shape(spec.shape, dtype.itemsize, regions[param]))
    return plan


def _check_block(source: Source, slot: names.Slot, info: Any, index: store.Index,
                 target: Any, param: str) -> str | None:
    """What is wrong with placing tensor `info` at `index` of parameter `target`, if anything."""
    cfg = source.cfg
    if target is None:
        return f"maps to k3text {param}, which this model config does not have"
    try:
        want = _stand_in(target.shape, np.dtype(target.dtype))[index].shape
    except IndexError as e:
        return f"lies outside k3text {param} {target.shape} ({e})"
    got = names.to_k3text(cfg, slot, _stand_in(info.shape, info.dtype)).shape
    if got != want:
        hf_shape = names.from_k3text(cfg, slot, _stand_in(want, np.dtype(target.dtype)),
                                     source.layout)
        part = " for the part filling it" if names.is_part(slot) else ""
        return (f"shape {list(info.shape)} does not fit k3text {param} (the model config "
                f"expects {list(hf_shape.shape)}{part})")
    if not _castable(info.dtype, np.dtype(target.dtype)):
        return (f"dtype {_DTYPE_NAMES[info.dtype]} does not fit k3text {param}, which is "
                f"{np.dtype(target.dtype).name}")
    return None


def _coverage_problems(source: Source, params: dict[str, Any],
                       regions: dict[str, dict[tuple, str]], rejected: set[str]) -> list[str]:
    """Parameters the checkpoint leaves (partly) unfilled, named by the tensors it lacks."""
    short = [p for p, spec in params.items()
             if sum(math.prod(b - a for a, b in r) for r in regions[p]) < math.prod(spec.shape)]
    if not short:
        return []
    expected: dict[str, list[str]] = {}
    for path, _, group in hf.tensor_groups(source.cfg, source.layout):
        expected.setdefault(hf.param_name(path), []).extend(group)
    problems = []
    for param in short:
        absent = [n for n in dict.fromkeys(expected[param]) if n not in source.checkpoint]
        problems += [f"{source.directory}: missing tensor {n!r} (k3text {param})" for n in absent]
        if not absent and param not in rejected:
            problems.append(f"{source.directory}: k3text {param} is only partly filled")
    return problems


# --------------------------------------------------------------------------------------------
# Inventory: what a checkpoint holds, counted as K3_MODEL.md §3.2 counts the real one.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Inventory:
    text: int  # text tensors
    vision: int  # tensors dropped with the vision tower
    non_expert: int
    non_expert_fused: int  # k3text per-layer tensors they fill (gate+up, q/k/v fused)
    expert: int  # routed-expert tensors
    expert_stacked: int  # per-layer expert stacks they fill
    arrays: int  # k3text parameter arrays (scan groups stacked)
    tensors_by_dtype: dict[str, int]
    bytes_by_dtype: dict[str, int]

    # Counts a checkpoint must share with its model config. Dtypes may legitimately differ
    # (a lossless widening is converted), so those are shown, and checked per tensor.
    COMPARED = ("text", "non_expert", "non_expert_fused", "expert", "expert_stacked", "arrays")

    def mismatches(self, expected: Inventory) -> list[str]:
        return [f"{_LABELS[k]}: checkpoint has {getattr(self, k):,}, the model config "
                f"expects {getattr(expected, k):,}"
                for k in self.COMPARED if getattr(self, k) != getattr(expected, k)]


_LABELS = {
    "text": "text tensors",
    "vision": "  vision tensors (dropped)",
    "non_expert": "non-expert tensors",
    "non_expert_fused": "  k3text tensors they fill",
    "expert": "expert tensors",
    "expert_stacked": "  stacked per MoE layer",
    "arrays": "k3text parameter arrays",
}


class _Tally:
    def __init__(self) -> None:
        self.counts = dict.fromkeys(("text", "non_expert", "expert"), 0)
        self.stacks: dict[bool, set] = {False: set(), True: set()}
        self.tensors: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def add(self, dtype: str, nbytes: int, slots: Iterable[names.Slot], params: Iterable[str],
            count: int = 1) -> None:
        slots = list(slots)
        expert = any("experts" in s.path for s in slots)
        self.counts["text"] += count
        self.counts["expert" if expert else "non_expert"] += count
        self.stacks[expert].update((p, s.layer) for p, s in zip(params, slots, strict=True))
        self.tensors[dtype] = self.tensors.get(dtype, 0) + count
        self.bytes[dtype] = self.bytes.get(dtype, 0) + nbytes * count

    def inventory(self, vision: int, arrays: int) -> Inventory:
        return Inventory(self.counts["text"], vision, self.counts["non_expert"],
                         len(self.stacks[False]), self.counts["expert"], len(self.stacks[True]),
                         arrays, dict(sorted(self.tensors.items())),
                         dict(sorted(self.bytes.items())))


def plan_inventory(plan: Plan) -> Inventory:
    """The inventory of the planned checkpoint (its headers)."""
    tally = _Tally()
    for name, placements in plan.placements.items():
        info = plan.source.checkpoint.info(name)
        tally.add(_DTYPE_NAMES[info.dtype], info.nbytes, [p.slot for p in placements],
                  [p.param for p in placements])
    touched = {p.param for placements in plan.placements.values() for p in placements}
    return tally.inventory(len(plan.dropped), len(touched))


def expected_inventory(cfg: Config, layout: str) -> Inventory:
    """The inventory a `layout` checkpoint of the model `cfg` describes must have.

    Computed from the reverse name table one parameter block at a time (the names filling one
    block share its shape), so the 497 K tensors of K3 take about a second."""
    params = hf.abstract_params(cfg)
    tally, seen = _Tally(), set()
    for path, _, group in hf.tensor_groups(cfg, layout):
        param = hf.param_name(path)
        fresh = [n for n in group if n not in seen]  # a fused tensor fills several blocks
        seen.update(fresh)
        slots = names.slots_for(cfg, group[0], layout)
        shape, dtype = _hf_shape(cfg, layout, params, slots)
        mine = [s for s in slots if hf.param_name(hf.destination(cfg, s)[0]) == param]
        tally.add(_DTYPE_NAMES[dtype], math.prod(shape) * dtype.itemsize, mine,
                  [param] * len(mine), count=len(fresh))
    return tally.inventory(0, len(params))


def _hf_shape(cfg: Config, layout: str, params: dict, slots: list[names.Slot],
              ) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of the HF tensor whose parts fill `slots` (parts stack on axis 0)."""
    parts = []
    for slot in slots:
        path, index = hf.destination(cfg, slot)
        spec = params[path]
        block = _stand_in(spec.shape, np.dtype(spec.dtype))[index]
        parts.append(names.from_k3text(cfg, slot, block, layout).shape)
    return (sum(p[0] for p in parts), *parts[0][1:]), np.dtype(spec.dtype)


def format_inventory(expected: Inventory, found: Inventory | None = None) -> str:
    """A table of the inventory a model config expects, beside the checkpoint's if given."""
    rows = [("", "checkpoint", "model config")] if found else [("", "model config")]
    marks = [""]
    for key, label in _LABELS.items():
        want = "-" if key == "vision" else f"{getattr(expected, key):,}"
        rows.append((label, f"{getattr(found, key):,}", want) if found else (label, want))
        differs = found and key in Inventory.COMPARED and \
            getattr(found, key) != getattr(expected, key)
        marks.append("  <- differs" if differs else "")
    dtypes = sorted(set(expected.tensors_by_dtype) | set(found.tensors_by_dtype if found else ()))
    for dtype in dtypes:
        tensors = [inv.tensors_by_dtype.get(dtype, 0) for inv in (found, expected) if inv]
        nbytes = [inv.bytes_by_dtype.get(dtype, 0) for inv in (found, expected) if inv]
        rows += [(f"{dtype} tensors", *(f"{n:,}" for n in tensors)),
                 (f"{dtype} bytes", *(_size(n) for n in nbytes))]
        marks += ["", ""]
    width = max(len(r[0]) for r in rows) + 2
    return "\n".join(r[0].ljust(width) + "".join(c.rjust(16) for c in r[1:]) + mark
                     for r, mark in zip(rows, marks, strict=True))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} B" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------
# 3. Conversion.
# --------------------------------------------------------------------------------------------


def convert(hf_dir: str | Path, out: str | Path, model_config: str | Path | None = None,
            force: bool = False, progress: bool = True) -> Plan:
    """Convert the HF checkpoint in `hf_dir` into a k3text checkpoint at `out`."""
    source, target = Path(hf_dir).resolve(), Path(out).resolve()
    if target == source or target in source.parents:
        raise CheckpointError(f"--out {out} would replace the checkpoint being converted "
                              f"({hf_dir}); give another directory")
    plan = make_plan(open_source(hf_dir, model_config))
    if plan.problems:
        more = len(plan.problems) - 1
        raise CheckpointError(plan.problems[0] + (f" (and {more} more problem(s); --dry-run "
                                                  f"lists them)" if more else ""))
    staged = None
    try:
        with store.staged_directory(out, force, "--force") as (staging, staged):
            with store.Writer(store.create_arrays(staging, plan.arrays)) as writer:
                _stream(plan, writer, progress)
            store.write_tree_metadata(staging, plan.arrays)
            store.write_model_config(staging, plan.source.cfg)
            copy_tokenizer(Path(hf_dir), staging)
    except (KeyboardInterrupt, SystemExit) as e:
        code = 130 if isinstance(e, KeyboardInterrupt) else e.code
        raise Interrupted(Path(out), staged is not None and staged.completed,
                          code if isinstance(code, int) else 1) from None
    return plan


class Interrupted(Exception):
    """A conversion stopped by SIGINT or SIGTERM: whether `out` was already complete (the
    staging directory renamed into place) or left as it was (the staging copy removed)."""

    def __init__(self, out: Path, completed: bool, exit_code: int):
        super().__init__(str(out))
        self.out, self.completed, self.exit_code = out, completed, exit_code

    def message(self) -> str:
        if self.completed:
            return f"interrupted after {self.out} was complete: it is a whole checkpoint"
        return f"interrupted; nothing was written to {self.out} (no partial copy is left)"


TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")


def copy_tokenizer(hf_dir: Path, out: Path) -> None:
    """Ship the checkpoint's tokenizer with it, so decoding needs no tokenizer_path."""
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, out / name)


def _stream(plan: Plan, writer: store.Writer, progress: bool) -> None:
    """Read the text tensors in storage order, one at a time, into their regions."""
    cfg, checkpoint = plan.source.cfg, plan.source.checkpoint
    total = sum(checkpoint.info(name).nbytes for name in plan.placements)
    with files.progress_bar(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                            desc="converting", disable=not progress, dynamic_ncols=True) as bar:
        for i, (name, placements) in enumerate(plan.placements.items(), start=1):
            array = checkpoint.read(name)
            for p in placements:
                block = names.to_k3text(cfg, p.slot, array)
                writer.write(p.param, p.index, np.asarray(block, plan.arrays[p.param].dtype))
            bar.set_postfix_str(f"{i:,}/{len(plan.placements):,} tensors", refresh=False)
            bar.update(array.nbytes)


# --------------------------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k3text-convert",
        description="Convert a Hugging Face safetensors checkpoint (Kimi Linear, Kimi K3) into "
                    "a k3text checkpoint for load_parameters_path.")
    parser.add_argument("--hf-dir", type=Path, help="checkpoint directory (config.json, "
                        "safetensors shards and index)")
    parser.add_argument("--out", type=Path, help="output directory (must not exist)")
    parser.add_argument("--model-config", type=Path, help="k3text model config the checkpoint "
                        "must agree with (with --dry-run and no --hf-dir: print what it expects)")
    parser.add_argument("--dry-run", action="store_true",
                        help="read headers only; print and check the inventory")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _dry_run(args: argparse.Namespace) -> int:
    if args.hf_dir is None:
        cfg = load_config(args.model_config)
        layout = names.default_layout(cfg)
        print(f"{cfg.model_name or args.model_config}: a {layout}-layout checkpoint holds")
        print(format_inventory(expected_inventory(cfg, layout)))
        return 0
    source = open_source(args.hf_dir, args.model_config)
    plan = make_plan(source)
    found = plan_inventory(plan)
    expected = expected_inventory(source.cfg, source.layout)
    problems = plan.problems + found.mismatches(expected)
    print(f"{source.directory}: {source.layout} layout, {len(source.checkpoint):,} tensors, "
          f"model {source.cfg.model_name!r} ({source.cfg.num_hidden_layers} layers, experts "
          f"{source.cfg.expert_weight_format})")
    print(format_inventory(expected, found))
    if problems:
        print(f"\n{len(problems)} problem(s):")
        print("\n".join(f"  {p}" for p in problems))
        print(f"error: the checkpoint does not match the model config ({len(problems)} "
              f"problem(s), listed above)", file=sys.stderr)
        return 2
    print("\nok: the checkpoint matches the model config")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.dry_run and args.hf_dir is None and args.model_config is None:
        parser.error("--dry-run needs --hf-dir or --model-config")
    if not args.dry_run and (args.hf_dir is None or args.out is None):
        parser.error("--hf-dir and --out are required (or --dry-run)")
    status = _convert_main(args)
    files.quiet_from_here()  # the command has said how it ended: nothing may print after it
    return status


def _convert_main(args: argparse.Namespace) -> int:
    """`main` once its flags are parsed: the exit status, with the one line that explains it."""
    try:  # a signal unwinds like Ctrl-C, so partial output is removed
        with files.unwinding_signals():
            if args.dry_run:
                return _dry_run(args)
            plan = convert(args.hf_dir, args.out, args.model_config, args.force,
                           progress=not args.no_progress)
            with files.uninterrupted():  # the output is complete: say so whatever arrives now
                inv = plan_inventory(plan)
                print(f"wrote {args.out}: {inv.arrays:,} parameter arrays from {inv.text:,} "
                      f"tensors ({plan.source.layout} layout, {inv.vision} vision tensors "
                      f"dropped)")
            return 0
    except (ValueError, OSError) as e:  # CheckpointError, ConfigError, OutputError included
        print(f"error: {e}", file=sys.stderr)
        return files.exit_status(e)
    except Interrupted as e:
        print(e.message(), file=sys.stderr)
        return e.exit_code
    except (KeyboardInterrupt, SystemExit) as e:  # before any output existed (or a dry run)
        print("interrupted; nothing was written", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else (e.code or 1)


if __name__ == "__main__":
    sys.exit(main())
