"""Safetensors checkpoints through the `safetensors` library, with the errors a user can act on.

The library parses headers and reads and writes tensors. This layer adds what it lacks: sharded
checkpoints (`model.safetensors.index.json`), one tensor in memory at a time (a Kimi checkpoint
is larger than host RAM), atomic writes, and one-line `CheckpointError`s naming the file and the
tensor: the library's own messages seldom name either, so when it refuses a file the header is
examined here to say which tensor is at fault and how.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from k3text.files import write_atomically

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# The safetensors dtypes numpy can hold (with ml_dtypes), by their header names.
DTYPES: dict[str, np.dtype] = {name: np.dtype(t) for name, t in {
    "BOOL": np.bool_, "U8": "u1", "I8": "i1", "U16": "<u2", "I16": "<i2", "U32": "<u4",
    "I32": "<i4", "U64": "<u8", "I64": "<i8", "F16": "<f2", "BF16": ml_dtypes.bfloat16,
    "F32": "<f4", "F64": "<f8", "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu}.items()}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# The library's numpy reader looks float8 types up as attributes of numpy, which has none
# (ml_dtypes registers them by name only), so these few are read at the header's offset here.
_NOT_FROM_LIBRARY = {DTYPES[name] for name in ("F8_E4M3", "F8_E5M2", "F8_E8M0")}


class CheckpointError(ValueError):
    """A malformed checkpoint; the message names the file and, where one is to blame, the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie: `offset` is absolute within `file`. `source` is the library's
    handle on the file (one open file per shard), kept so that the tensor is read from the file
    whose header was checked."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int
    source: Any = field(default=None, compare=False, repr=False)


def _error(path: Path, message: str, tensor: str | None = None) -> CheckpointError:
    where = f"{path}: tensor {tensor!r}" if tensor is not None else str(path)
    return CheckpointError(f"{where}: {message}")


@contextlib.contextmanager
def _library(path: Path, tensor: str | None = None) -> Iterator[None]:
    """Any failure of the library (its SafetensorError, OSError, even a Rust panic: pyo3's
    PanicException, a BaseException) as one CheckpointError line; Ctrl-C, SIGTERM and exits
    (the other BaseExceptions) pass through."""
    try:
        yield
    except CheckpointError:
        raise
    except BaseException as e:
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise
        text = " ".join(str(e).split()) or type(e).__name__
        raise _error(path, f"not a readable safetensors file ({text})", tensor) from None


def read_header(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Open one safetensors file and describe its tensors, without reading tensor data."""
    path = Path(path)
    try:
        # pread, not the default mmap: reading a mapped file that was truncated since it was
        # opened kills the process (SIGBUS); pread fails, and read_tensor says what happened.
        with _library(path):
            source = safetensors.safe_open(path, framework="np", backend="pread")
    except CheckpointError as refused:
        raise _diagnose(path) or refused from None
    with _library(path), path.open("rb") as f:
        data_start = 8 + struct.unpack("<Q", f.read(8))[0]
        slices = {name: source.get_slice(name) for name in source.offset_keys()}
        specs = {name: (s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}
    for name, (dtype, _) in specs.items():  # the library knows a few dtypes numpy does not
        if dtype not in DTYPES:
            raise _error(path, f"unknown dtype {dtype!r} (supported: {', '.join(DTYPES)})", name)
    sizes = [math.prod(shape) * DTYPES[dtype].itemsize for dtype, shape in specs.values()]
    # The library has checked that the tensors lie back to back in offset order from the start
    # of the data buffer (and that the file holds it all), so their offsets are running sums.
    offsets = list(accumulate(sizes, initial=data_start))[:-1]
    return {name: TensorInfo(name, DTYPES[dtype], shape, path, offset, nbytes, source)
            for (name, (dtype, shape)), offset, nbytes in zip(specs.items(), offsets, sizes,
                                                               strict=True)}


def _diagnose(path: Path) -> CheckpointError | None:
    """What is wrong with a file the library refused, naming the tensor at fault; None where
    these checks find nothing (the library's own message then stands)."""
    try:
        file_size = path.stat().st_size
        with path.open("rb") as f:
            if file_size < 8:
                return _error(path, f"only {file_size} bytes, too short to hold the 8-byte "
                                    "header length")
            (length,) = struct.unpack("<Q", f.read(8))
            if length > file_size - 8:
                return _error(path, f"header length {length} runs past the end of the "
                                    f"{file_size}-byte file")
            if length > 100 << 20:  # the library's limit; its "header too large" says it
                return None
            raw = f.read(length)
    except OSError:
        return None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return _error(path, f"header is not valid UTF-8 JSON ({e})")
    if not isinstance(header, dict):
        return _error(path, f"header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        return _error(path, "__metadata__ must map strings to strings")
    spans = []  # (begin, end, name), absolute
    for name, entry in header.items():
        if problem := _entry_problem(entry):
            return _error(path, problem, name)
        begin, end = entry["data_offsets"]
        spans.append((8 + length + begin, 8 + length + end, name))
    spans.sort()
    if lost := [span for span in spans if span[1] > file_size]:
        return _error(path, f"data ends at byte {lost[0][1]} but the file has only {file_size} "
                            f"bytes; the file is truncated, losing {len(lost)} of {len(spans)} "
                            f"tensors: " + ", ".join(repr(name) for *_, name in lost), lost[0][2])
    filled = [span for span in spans if span[1] > span[0]]  # empty tensors may share an offset
    for (_, before_end, before), (after_begin, _, after) in pairwise(filled):
        if after_begin < before_end:
            return _error(path, f"data overlaps that of tensor {before!r}", after)
    return None


def _entry_problem(entry: object) -> str | None:
    def int_list(value: object) -> bool:  # JSON true/false arrive as bool, a subclass of int
        return isinstance(value, list) and all(type(v) is int for v in value)

    if not isinstance(entry, dict):
        return "header entry is not a JSON object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        return f"unknown dtype {dtype!r} (supported: {', '.join(DTYPES)})"
    if not int_list(shape) or any(d < 0 for d in shape):
        return f"shape {shape!r} is not a list of non-negative integers"
    if not (int_list(offsets) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1]):
        return f"data_offsets {offsets!r} is not [begin, end] with begin <= end"
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        return (f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but {dtype} of "
                f"shape {shape} needs {nbytes}")
    return None


def read_tensor(info: TensorInfo) -> np.ndarray:
    """Read one tensor into a fresh array; the file may have changed since its header was read."""
    try:
        if info.dtype in _NOT_FROM_LIBRARY:
            array = np.fromfile(info.file, info.dtype, math.prod(info.shape), offset=info.offset)
            if array.nbytes != info.nbytes:
                raise EOFError
            return array.reshape(info.shape)
        with _library(info.file, info.name):
            return info.source.get_tensor(info.name)
    except (CheckpointError, OSError, EOFError) as e:
        # The library does not say the file is shorter than it was: check, to say so.
        with contextlib.suppress(OSError):
            if (got := info.file.stat().st_size - info.offset) < info.nbytes:
                raise _error(info.file, f"file ends after {max(got, 0)} of the tensor's "
                                        f"{info.nbytes} bytes (truncated since its header was "
                                        "read)", info.name) from None
        if isinstance(e, CheckpointError):
            raise
        raise _error(info.file, f"cannot be read ({e})", info.name) from None


class SafetensorsCheckpoint:
    """The tensors of a Hugging Face checkpoint directory, read one at a time.

    Shards come from `model.safetensors.index.json` when present, else `model.safetensors`, else
    every `*.safetensors` file. All shard headers are read and cross-checked on opening, so a
    broken checkpoint fails before a long conversion starts.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        infos = _load_infos(self.directory)
        # Storage order, so reading keys() in turn streams through each shard front to back.
        self._infos = dict(sorted(infos.items(), key=lambda kv: (kv[1].file, kv[1].offset)))

    def keys(self) -> list[str]:
        """Tensor names in storage order: by shard file, then by position within it."""
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in the checkpoint at {self.directory}") from None

    def read(self, name: str) -> np.ndarray:
        return read_tensor(self.info(name))

    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self._infos.values())

    def bytes_by_dtype(self) -> dict[str, int]:
        """Bytes per safetensors dtype name, e.g. {"BF16": ..., "F8_E4M3": ...}."""
        totals: Counter[str] = Counter()
        for info in self._infos.values():
            totals[_DTYPE_NAMES[info.dtype]] += info.nbytes
        return dict(totals)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)


def _load_infos(directory: Path) -> dict[str, TensorInfo]:
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    if (directory / INDEX_FILE).is_file():
        return _infos_from_index(directory / INDEX_FILE)
    if (directory / SINGLE_FILE).is_file():
        return read_header(directory / SINGLE_FILE)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors")
    return _infos_from_files(files)


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        contents = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _error(index, f"index is not valid UTF-8 JSON ({e})") from e
    weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise _error(index, '"weight_map" must map tensor names to shard file names')
    return weight_map


def _infos_from_index(index: Path) -> dict[str, TensorInfo]:
    names_by_shard: dict[str, list[str]] = {}
    for name, shard in _read_weight_map(index).items():
        names_by_shard.setdefault(shard, []).append(name)
    infos: dict[str, TensorInfo] = {}
    for shard, names in names_by_shard.items():
        path = index.parent / shard
        if not path.is_file():
            raise CheckpointError(
                f"{path}: shard file is missing; {index.name} maps {len(names)} tensor(s) to it, "
                f"e.g. {names[0]!r}"
            )
        header = read_header(path)
        for name in names:
            if name not in header:
                raise _error(path, f"{index.name} places it in this shard, but it is absent", name)
            infos[name] = header[name]
    return infos


def _infos_from_files(files: Iterable[Path]) -> dict[str, TensorInfo]:
    infos: dict[str, TensorInfo] = {}
    for path in files:
        for name, info in read_header(path).items():
            if name in infos:
                raise _error(path, f"also present in {infos[name].file}", name)
            infos[name] = info
    return infos


def save_file(
    tensors: Mapping[str, np.ndarray],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `tensors` as one safetensors file, atomically.

    The library writes them widest dtype first, then by name, with the header padded to 8 bytes:
    the output is deterministic and every tensor starts at a multiple of its itemsize. The file
    is serialized in memory, so this is for files of a few GiB at most.
    """
    if metadata and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("safetensors metadata must map strings to strings")
    if "__metadata__" in tensors:  # the library would write it, making the header ambiguous
        raise ValueError("'__metadata__' is reserved and cannot name a tensor")
    arrays = {}
    for name, tensor in tensors.items():
        # C-contiguous and little-endian: the library writes the buffer as it lies in memory.
        array = np.asarray(tensor)
        array = np.asarray(array, dtype=array.dtype.newbyteorder("<"), order="C")
        if array.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: safetensors has no dtype for {array.dtype}")
        arrays[name] = array
    data = safetensors.numpy.save(arrays, metadata=dict(metadata) if metadata else None)
    write_atomically(path, lambda f: f.write(data), binary=True)


def save_sharded(
    tensors_by_shard: list[Mapping[str, np.ndarray]],
    directory: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write one `model-0000i-of-0000N.safetensors` per mapping plus the index; returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total_size = 0
    for i, tensors in enumerate(tensors_by_shard, start=1):
        shard = f"model-{i:05d}-of-{len(tensors_by_shard):05d}.safetensors"
        for name, array in tensors.items():
            if name in weight_map:
                raise ValueError(f"tensor {name!r} is in both {weight_map[name]} and {shard}")
            weight_map[name] = shard
            total_size += np.asarray(array).nbytes
        save_file(tensors, directory / shard, metadata)
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    index_bytes = (json.dumps(index, indent=2) + "\n").encode("utf-8")
    write_atomically(directory / INDEX_FILE, lambda f: f.write(index_bytes), binary=True)
    return directory / INDEX_FILE
