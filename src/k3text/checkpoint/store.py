"""k3text checkpoints: an Orbax PyTree checkpoint written region by region, plus its model config.

On-disk layout of a checkpoint directory (what `load_parameters_path` names):

    OUT/
      model.yml           the model keys (`config.CHECKPOINT_MODEL_FILE`); `load_config` lets them
                          take precedence over the model an inference config names
      params/             an Orbax PyTree checkpoint (`PyTreeCheckpointHandler` format,
        _METADATA           use_ocdbt=false, use_zarr3=true) holding a flat tree: one entry per
        embed.table/        k3text parameter, named by its '.'-joined path, e.g.
          zarr.json         `groups.layers.0.mlp.experts.gate_up_packed` [groups, E, 2F, D/2] u8;
          c/0/0             scanned layer groups are stacked on a leading axis, exactly as the
        ...                 model holds them

Why this layout. A converted K3 is 1.45 TB and one stacked expert parameter alone is ~200 GB,
so no array can be built in host memory and handed to one Orbax save. Every parameter is instead
a zarr3 array created up front and filled region by region with tensorstore as the source
tensors stream in, in whatever order the source stores them:

- Chunks tile the write regions (a region is what one source tensor fills: one expert's gate or
  up half in one layer, one layer's projection), so every write covers whole chunks and nothing
  is ever read back and rewritten. Chunks are further halved down to `CHUNK_BYTES`, so a device
  restoring a slice reads little beyond it (experts are one chunk each per layer, so expert
  parallelism reads exactly the experts a device holds).
- No compression: BF16 weights and packed FP4 codes barely compress, and raw chunks keep both
  conversion and restore at disk speed. Each chunk carries a CRC32C (zarr3's `crc32c` codec),
  so a damaged chunk fails its read; checkpoints written before that are checked by chunk
  sizes and values instead (`restore`).
- Without OCDBT every chunk is an ordinary file, so concurrent region writes need no
  coordination and the tree metadata can be written once all arrays are complete.

Restore goes through Orbax (`ArrayRestoreArgs` with each parameter's target sharding): every
process reads only the chunks behind the slices its devices hold and the arrays come back
already placed. Writes go to a hidden temporary directory next to the target that is renamed
into place only when complete, so an interrupted run leaves nothing at the target.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
import yaml
from flax import nnx

from k3text import files, sharding
from k3text.checkpoint import hf
from k3text.checkpoint.safetensors_io import CheckpointError
from k3text.config import (
    CHECKPOINT_MODEL_FILE,
    MODEL_KEYS,
    Config,
    ConfigError,
    checkpoint_model_config,
    config_from_dict,
)
from k3text.layers.initializers import Init
from k3text.models.decoder import Decoder
from k3text.ops import mxfp4

PARAMS_DIR = "params"
CHUNK_BYTES = 64 << 20
# Bytes handed to tensorstore and not yet on disk; beyond this, writes wait for the oldest.
IN_FLIGHT_BYTES = 256 << 20
# Written chunks are not cached: each is touched once.
_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}})

Index = tuple[int | slice, ...]


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """One stored parameter array."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]


def box(index: Index, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The [start, stop) range per dimension that a numpy-style `index` selects in `shape`.

    Raises IndexError for an integer index outside its dimension."""
    ranges = []
    for d, n in enumerate(shape):
        i = index[d] if d < len(index) else slice(None)
        if isinstance(i, slice):
            start, stop, _ = i.indices(n)
        elif 0 <= i < n:
            start, stop = i, i + 1
        else:
            raise IndexError(f"index {i} is outside dimension {d} of size {n}")
        ranges.append((start, stop))
    return tuple(ranges)


def chunk_shape(shape: tuple[int, ...], itemsize: int,
                regions: Iterable[tuple[tuple[int, int], ...]]) -> tuple[int, ...]:
    """The largest chunk shape whose grid tiles every write region (so no write touches part of
    a chunk), then halved along its longest even dimension down to CHUNK_BYTES."""
    chunk = list(shape)
    for region in regions:
        for d, (start, stop) in enumerate(region):
            chunk[d] = math.gcd(chunk[d], start, stop)
    while math.prod(chunk) * itemsize > CHUNK_BYTES:
        d = max(range(len(chunk)), key=lambda d: chunk[d] if chunk[d] % 2 == 0 else 0)
        if chunk[d] % 2:
            break
        chunk[d] //= 2
    return tuple(max(c, 1) for c in chunk)


# --------------------------------------------------------------------------------------------
# Writing.
# --------------------------------------------------------------------------------------------


def _zarr_spec(path: Path, spec: ArraySpec | None = None) -> dict[str, Any]:
    tspec: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
    if spec is not None:
        tspec["metadata"] = {
            "shape": list(spec.shape),
            "data_type": np.dtype(spec.dtype).name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(spec.chunks)}},
            # A CRC32C per chunk: a damaged chunk fails its read, naming its file.
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                       {"name": "crc32c"}],
        }
        # All-zero chunks are stored too (as Orbax does), so a restore never meets a gap.
        tspec["store_data_equal_to_fill_value"] = True
    return tspec


def create_arrays(directory: Path, specs: Mapping[str, ArraySpec]) -> dict[str, ts.TensorStore]:
    """Create one empty zarr3 array per parameter under `directory`/params, open for writing."""
    params = directory / PARAMS_DIR
    params.mkdir(parents=True)
    opening = {name: ts.open(_zarr_spec(params / name, spec), create=True, context=_CONTEXT)
               for name, spec in specs.items()}
    return {name: future.result() for name, future in opening.items()}


class Writer(contextlib.AbstractContextManager):
    """Region writes into the arrays of `create_arrays`, at most IN_FLIGHT_BYTES outstanding.

    Leaving the `with` block waits for every write: normally raising the first failure; after
    an exception, silently, so the caller can delete the directory without a late write
    recreating part of it."""

    def __init__(self, arrays: Mapping[str, ts.TensorStore]):
        self.arrays = arrays
        self._pending: deque[tuple[Any, int]] = deque()
        self._bytes = 0

    def write(self, name: str, index: Index, block: np.ndarray) -> None:
        self._pending.append((self.arrays[name][index].write(block), block.nbytes))
        self._bytes += block.nbytes
        while self._bytes > IN_FLIGHT_BYTES and len(self._pending) > 1:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        future, nbytes = self._pending.popleft()
        self._bytes -= nbytes
        future.result()

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        try:
            while self._pending and kind is None:
                self._wait_oldest()
        finally:  # after a failure or an interrupt: let in-flight writes land, undisturbed
            with files.uninterrupted():
                while self._pending:
                    with contextlib.suppress(Exception):
                        self._wait_oldest()


def write_tree_metadata(directory: Path, names: Iterable[str]) -> None:
    """Orbax's metadata for the flat tree of `names`, written once every array is complete:
    `_METADATA` (the tree: one numpy array per parameter, zarr3, no OCDBT) and
    `_CHECKPOINT_METADATA` (which handler wrote it)."""
    params = directory / PARAMS_DIR
    entries = {  # key_type 2: a dict key
        str((name,)): {"key_metadata": [{"key": name, "key_type": 2}],
                       "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False}}
        for name in names
    }
    tree = {"tree_metadata": entries, "use_ocdbt": False, "use_zarr3": True,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}
    (params / "_METADATA").write_text(json.dumps(tree))
    handler = ocp.PyTreeCheckpointHandler
    now = time.time_ns()
    step = {"item_handlers": f"{handler.__module__}.{handler.__qualname__}", "metrics": {},
            "performance_metrics": {}, "init_timestamp_nsecs": now,
            "commit_timestamp_nsecs": now, "custom_metadata": {}}
    (params / "_CHECKPOINT_METADATA").write_text(json.dumps(step))


def write_model_config(directory: Path, cfg: Config) -> None:
    (directory / CHECKPOINT_MODEL_FILE).write_text(
        yaml.safe_dump(cfg.model_dict(), sort_keys=False))


def check_replaceable(out: str | os.PathLike, how_to_replace: str = "force=True") -> None:
    """An existing `out` may be replaced (when asked) only if it is an empty directory or a
    checkpoint (k3text's, or a Hugging Face one as `synthetic` writes): a mistyped path must
    not cost a directory of something else."""
    path = Path(out).resolve()
    if not path.is_dir() or not any(path.iterdir()):
        return
    markers = (f"{PARAMS_DIR}/_METADATA", CHECKPOINT_MODEL_FILE, "config.json")
    if not any((path / marker).is_file() for marker in markers):
        raise CheckpointError(f"{out} is neither empty nor a checkpoint (it has no "
                              f"{', '.join(markers)}); {how_to_replace} replaces only a "
                              f"checkpoint: remove it yourself, or give another path")


@contextlib.contextmanager
def staged_directory(out: str | os.PathLike, force: bool = False,
                     how_to_replace: str = "force=True",
                     ) -> Iterator[tuple[Path, files.Staged]]:
    """`files.staged_directory` for a checkpoint: an existing `out` is a CheckpointError unless
    `force` (which `how_to_replace` names to the user), and even then unless it is an empty
    directory or a checkpoint (`check_replaceable`)."""
    if force:
        check_replaceable(out, how_to_replace)
    try:
        staged = files.staged_directory(out, replace=force, how_to_replace=how_to_replace)
        with staged as pair:
            yield pair
    except files.OutputError as e:
        raise CheckpointError(str(e)) from None


# --------------------------------------------------------------------------------------------
# Reading.
# --------------------------------------------------------------------------------------------


def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler())


def stored_arrays(path: str | os.PathLike) -> dict[str, jax.ShapeDtypeStruct]:
    """{parameter name: shape and dtype} of the checkpoint at `path` (metadata only)."""
    params = Path(path) / PARAMS_DIR
    if not (params / "_METADATA").is_file():
        raise CheckpointError(f"{path}: not a k3text checkpoint (no {PARAMS_DIR}/_METADATA)")
    # The handler itself: the Checkpointer around it turns a damaged file into None and a
    # log line of its own.
    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = handler.metadata(params).tree
        return {name: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype) for name, m in tree.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSON errors included
        raise CheckpointError(f"{params / '_METADATA'}: damaged, the parameter tree cannot be "
                              f"read ({type(e).__name__}: {e})") from None
    finally:
        handler.close()


def check_stored_files(path: str | os.PathLike, names: Iterable[str]) -> None:
    """Before anything is read: each named array of the checkpoint at `path` has readable zarr
    metadata and every chunk file at the size that metadata implies. Unchecked, a missing
    chunk reads as zeros (zarr's fill value) and a missing metadata file ends in a long
    traceback. Arrays in a layout this check does not know are left to the reader."""
    params = Path(path) / PARAMS_DIR
    for name in names:
        meta_file = params / name / "zarr.json"
        if not (params / name).is_dir():
            continue  # not stored at all: `restore` names what the checkpoint lacks
        try:
            meta = json.loads(meta_file.read_text())
            shape = tuple(meta["shape"])
            chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
            itemsize = np.dtype(meta["data_type"]).itemsize
            codecs = [c["name"] for c in meta["codecs"]]
            encoding = meta.get("chunk_key_encoding", {})
        except FileNotFoundError:
            raise CheckpointError(f"{path}: parameter {name} is damaged: {meta_file} is "
                                  f"missing") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: parameter {name} is damaged: {meta_file} is not "
                                  f"valid zarr metadata ({type(e).__name__}: {e})") from None
        if (encoding.get("name", "default") != "default"
                or encoding.get("configuration", {}).get("separator", "/") != "/"
                or not codecs or codecs[0] != "bytes" or set(codecs) - {"bytes", "crc32c"}):
            continue
        size = math.prod(chunks) * itemsize + 4 * ("crc32c" in codecs)
        for index in itertools.product(*(range(-(-n // c)) for n, c in zip(shape, chunks,
                                                                           strict=True))):
            chunk = params / name / "/".join(["c", *map(str, index)])
            try:
                found = chunk.stat().st_size
            except FileNotFoundError:
                raise CheckpointError(f"{path}: parameter {name} is damaged: chunk {chunk} "
                                      f"is missing") from None
            if found != size:
                raise CheckpointError(f"{path}: parameter {name} is damaged: chunk {chunk} "
                                      f"has {found:,} bytes, its metadata implies {size:,}")


def check_values(path: str | os.PathLike, arrays: Mapping[str, jax.Array]) -> None:
    """After a restore: floating parameters hold only finite numbers and MXFP4 scales no NaN
    code (E8M0 255), the content check a checkpoint written without checksums allows."""
    floating = {n: a for n, a in arrays.items() if _floating(a.dtype)}
    scales = {n: a for n, a in arrays.items() if n.endswith("_scale") and a.dtype == jnp.uint8}
    bad = jax.jit(lambda f, s: ({n: ~jnp.all(jnp.isfinite(a)) for n, a in f.items()}
                                | {n: jnp.any(a == mxfp4.E8M0_NAN) for n, a in s.items()})
                  )(floating, scales)
    damaged = sorted(n for n, flag in jax.device_get(bad).items() if flag)
    if damaged:
        what = "non-finite values" if damaged[0] in floating else "NaN scale codes"
        raise CheckpointError(f"{path}: parameter {damaged[0]} holds {what} (the checkpoint is "
                              f"damaged: {Path(path) / PARAMS_DIR / damaged[0]})"
                              + (f"; {len(damaged) - 1} more damaged" if len(damaged) > 1
                                 else ""))


def restore(path: str | os.PathLike,
            targets: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """Restore the named parameters straight into their `targets` shardings (and dtypes).

    Every process reads only the slices its devices hold. Names and shapes must match the
    stored arrays exactly (Orbax would silently pad or truncate); dtypes may differ between
    floating types (cast while reading). The files are checked before reading
    (`check_stored_files`), chunk checksums while reading, the values after
    (`check_values`): a damaged checkpoint is one CheckpointError naming the array and file."""
    if not (Path(path) / PARAMS_DIR / "_METADATA").is_file():
        raise CheckpointError(f"{path}: not a k3text checkpoint (no {PARAMS_DIR}/_METADATA)")
    check_stored_files(path, targets)
    stored = stored_arrays(path)
    missing = sorted(targets.keys() - stored.keys())
    if missing:
        raise CheckpointError(
            f"{path}: checkpoint lacks {len(missing)} parameter(s) the model has, e.g. "
            f"{missing[:3]} (it was written for another model)")
    for name, target in targets.items():
        have = stored[name]
        if have.shape != target.shape:
            raise CheckpointError(f"{path}: parameter {name} is stored with shape {have.shape}, "
                                  f"the model config needs {target.shape}")
        if have.dtype != target.dtype and not (_floating(have.dtype) and
                                               _floating(target.dtype)):
            raise CheckpointError(f"{path}: parameter {name} is stored as {have.dtype}, the "
                                  f"model config needs {target.dtype}")
    restore_args = {name: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape,
                                               dtype=t.dtype)
                    for name, t in targets.items()}
    item = {name: stored[name] for name in targets}
    try:
        with stderr_kept_for_success():
            arrays = _checkpointer().restore(
                Path(path) / PARAMS_DIR,
                args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
    except Exception as e:  # Orbax wraps tensorstore's errors in its own
        cause = root_cause(e)
        if not any(code in cause for code in ("DATA_LOSS", "NOT_FOUND", "Error reading")):
            raise  # not the files' fault (memory, a bug): the whole story is worth keeping
        raise CheckpointError(f"{path}: the checkpoint is damaged: {cause}") from None
    check_values(path, arrays)
    return arrays


@contextlib.contextmanager
def stderr_kept_for_success() -> Iterator[None]:
    """Hold what is written to sys.stderr during the block; pass it on if the block succeeds.
    When one read fails, Orbax's other reads fail in its threads as its event loop closes and
    print tracebacks of their own; the CheckpointError raised instead says what happened."""
    real, held = sys.stderr, io.StringIO()
    sys.stderr = held
    succeeded = False
    try:
        yield
        succeeded = True
    finally:
        if not succeeded:  # let the other reads finish failing into `held` (bounded wait)
            deadline, size = time.monotonic() + 5.0, -1
            while size != len(held.getvalue()) and time.monotonic() < deadline:
                size = len(held.getvalue())
                time.sleep(0.25)
        sys.stderr = real
        if succeeded and held.getvalue():
            real.write(held.getvalue())


def root_cause(error: BaseException) -> str:
    """The first line of the innermost error in a chain (tensorstore's, naming the file),
    without the driver spec tensorstore appends."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    text = str(error).strip()
    return text.splitlines()[0].split(" [tensorstore_spec=")[0] if text else type(error).__name__


def _floating(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


# --------------------------------------------------------------------------------------------
# Models.
# --------------------------------------------------------------------------------------------


def load_model(cfg: Config, ctx: sharding.MeshContext, path: str | os.PathLike) -> Decoder:
    """The Decoder `cfg` describes with its parameters restored from the checkpoint at `path`,
    each placed in its logical-axis sharding on `ctx.mesh`."""
    _check_model_keys(cfg, Path(path))
    graphdef, state = nnx.split(Decoder(cfg, Init(abstract=True)))
    flat = nnx.to_flat_state(state)
    shardings = dict(nnx.to_flat_state(sharding.state_shardings(state, ctx)))
    targets = {}
    for p, var in flat:
        value = var.get_value()
        targets[hf.param_name(p)] = jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                         sharding=shardings[p])
    arrays = restore(path, targets)
    return nnx.merge(graphdef, nnx.from_flat_state(
        [(p, var.replace(arrays[hf.param_name(p)])) for p, var in flat]))


def _check_model_keys(cfg: Config, path: Path) -> None:
    """The checkpoint's model keys must be the config's (`load_config` makes them so)."""
    stored = checkpoint_model_config(path)
    if stored is None:
        return
    ckpt = config_from_dict(stored)
    differ = [f"{k} = {ckpt[k]!r} (config: {cfg[k]!r})"
              for k in sorted(MODEL_KEYS - {"model_name"}) if ckpt[k] != cfg[k]]
    if differ:
        raise ConfigError(f"checkpoint {path} was written for another model: {'; '.join(differ)}")


def save_model(cfg: Config, model_or_params: nnx.Module | nnx.State | Mapping[Any, Any],
               out_dir: str | os.PathLike, *, force: bool = False) -> None:
    """Write a model (a Decoder, its state, or flat {path: array} parameters) as a k3text
    checkpoint of the model `cfg` describes, in `cfg`'s dtypes.

    Routed experts are written in `cfg`'s `expert_weight_format`: unquantised experts are
    quantised with `mxfp4.quantize_mxfp4` for `mxfp4`, packed ones dequantised (exactly, to
    float32, then `cfg`'s weight dtype) for `bf16`. Runs in one process (arrays are gathered to
    it).
    """
    if jax.process_count() > 1:
        raise CheckpointError("save_model writes from a single process; gather the model first")
    values = _flat_values(model_or_params)
    expected = {hf.param_name(p): s for p, s in hf.abstract_params(cfg).items()}
    values = (_quantize_experts(values) if cfg.expert_weight_format == "mxfp4"
              else _dequantize_experts(values))
    missing = sorted(expected.keys() - values.keys())
    extra = sorted(values.keys() - expected.keys())
    if missing or extra:
        raise CheckpointError(f"model does not match the config: missing {missing[:3]}, "
                              f"unexpected {extra[:3]}")
    specs = {}
    for name, s in expected.items():
        if values[name].shape != s.shape:
            raise CheckpointError(f"parameter {name} has shape {values[name].shape}, the config "
                                  f"needs {s.shape}")
        whole = tuple((0, n) for n in s.shape)
        specs[name] = ArraySpec(s.shape, np.dtype(s.dtype),
                                chunk_shape(s.shape, np.dtype(s.dtype).itemsize, [whole]))
    with staged_directory(out_dir, force) as (staging, _):
        with Writer(create_arrays(staging, specs)) as writer:
            for name, spec in specs.items():
                writer.write(name, (), np.asarray(values[name]).astype(spec.dtype, copy=False))
        write_tree_metadata(staging, specs)
        write_model_config(staging, cfg)


def _flat_values(model: nnx.Module | nnx.State | Mapping[Any, Any]) -> dict[str, Any]:
    if isinstance(model, nnx.Module):
        model = nnx.state(model)
    if isinstance(model, nnx.State):
        return {hf.param_name(p): v.get_value() for p, v in nnx.to_flat_state(model)}
    return {k if isinstance(k, str) else hf.param_name(k): v for k, v in model.items()}


def _quantize_experts(values: Mapping[str, Any]) -> dict[str, Any]:
    """Replace unquantised routed experts ([..., out, in]) by their MXFP4 packed + scale pair."""
    out = {}
    for name, value in values.items():
        if name.endswith((".experts.gate_up", ".experts.down")):
            packed, scale = mxfp4.quantize_mxfp4(np.asarray(value, np.float32))
            out[f"{name}_packed"], out[f"{name}_scale"] = packed, scale
        else:
            out[name] = value
    return out


def _dequantize_experts(values: Mapping[str, Any]) -> dict[str, Any]:
    """Replace MXFP4 routed experts (packed + scale pairs) by their exact float32 values."""
    out = {}
    for name, value in values.items():
        if name.endswith((".experts.gate_up_packed", ".experts.down_packed")):
            base = name.removesuffix("_packed")
            out[base] = np.asarray(mxfp4.dequantize_mxfp4(value, values[f"{base}_scale"]))
        elif not name.endswith((".experts.gate_up_scale", ".experts.down_scale")):
            out[name] = value
    return out
