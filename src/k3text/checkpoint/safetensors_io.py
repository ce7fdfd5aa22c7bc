"""A streaming reader and writer for the safetensors format.

A Kimi checkpoint is larger than host RAM, so nothing here holds more than one tensor: headers
are read on their own and tensors one at a time, each with a single seek and read. numpy has no
bfloat16 or float8, so those dtypes come from ml_dtypes.

File layout: an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name to
{"dtype", "shape", "data_offsets": [begin, end]} (plus an optional "__metadata__" of strings),
then the data buffer that the offsets index into.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

from k3text.files import write_atomically

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# The reference implementation refuses larger headers; a bigger length means a corrupt file.
_MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class CheckpointError(ValueError):
    """A malformed checkpoint; the message names the file and, where one is to blame, the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie: `offset` is absolute within `file`."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int


def _error(path: Path, message: str, tensor: str | None = None) -> CheckpointError:
    where = f"{path}: tensor {tensor!r}" if tensor is not None else str(path)
    return CheckpointError(f"{where}: {message}")


def read_header(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Read and validate the header of one safetensors file, without reading tensor data.

    A truncated file is caught by comparing each tensor's extent with the file size, so the error
    names exactly the tensors whose bytes are missing.
    """
    path = Path(path)
    with path.open("rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        header, data_start = _read_header_json(f, path, file_size)
    infos = {name: _tensor_info(path, name, entry, data_start) for name, entry in header.items()}
    _check_within_file(path, infos, file_size)
    _check_no_overlap(path, infos)
    return infos


def _read_header_json(f: BinaryIO, path: Path, file_size: int) -> tuple[dict[str, Any], int]:
    """Returns the header's tensor entries (metadata removed) and where the data buffer starts."""
    if file_size < 8:
        raise _error(path, f"only {file_size} bytes, too short to hold the 8-byte header length")
    (length,) = struct.unpack("<Q", f.read(8))
    if length > file_size - 8:
        raise _error(path, f"header length {length} runs past the end of the {file_size}-byte file")
    if length > _MAX_HEADER_BYTES:
        raise _error(path, f"header length {length} exceeds the {_MAX_HEADER_BYTES}-byte limit")
    try:
        header = json.loads(f.read(length).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _error(path, f"header is not valid UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise _error(path, f"header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _error(path, "__metadata__ must map strings to strings")
    return header, 8 + length


def _is_int_list(value: object) -> bool:
    # JSON true/false arrive as bool, which is a subclass of int.
    return isinstance(value, list) and all(type(v) is int for v in value)


def _tensor_info(path: Path, name: str, entry: object, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise _error(path, "header entry is not a JSON object", name)
    dtype_name, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise _error(path, f"unknown dtype {dtype_name!r} (supported: {', '.join(DTYPES)})", name)
    if not _is_int_list(shape) or any(d < 0 for d in shape):
        raise _error(path, f"shape {shape!r} is not a list of non-negative integers", name)
    if not (_is_int_list(offsets) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1]):
        raise _error(path, f"data_offsets {offsets!r} is not [begin, end] with begin <= end", name)
    dtype = DTYPES[dtype_name]
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise _error(
            path,
            f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, "
            f"but {dtype_name} of shape {shape} needs {nbytes}",
            name,
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + offsets[0], nbytes)


def _check_within_file(path: Path, infos: Mapping[str, TensorInfo], file_size: int) -> None:
    missing = sorted(
        (info for info in infos.values() if info.offset + info.nbytes > file_size),
        key=lambda info: info.offset,
    )
    if missing:
        first = missing[0]
        raise _error(
            path,
            f"data ends at byte {first.offset + first.nbytes} but the file has only {file_size} "
            f"bytes; the file is truncated, losing {len(missing)} of {len(infos)} tensors: "
            + ", ".join(repr(info.name) for info in missing),
            first.name,
        )


def _check_no_overlap(path: Path, infos: Mapping[str, TensorInfo]) -> None:
    # Empty tensors occupy no bytes, so they may share an offset with anything.
    spans = sorted((info for info in infos.values() if info.nbytes), key=lambda info: info.offset)
    for before, after in pairwise(spans):
        if after.offset < before.offset + before.nbytes:
            raise _error(path, f"data overlaps that of tensor {before.name!r}", after.name)


def read_tensor(info: TensorInfo) -> np.ndarray:
    """Read one tensor into a fresh array; the file may have changed since its header was read."""
    buffer = np.empty(info.nbytes, dtype=np.uint8)
    with info.file.open("rb", buffering=0) as f:
        f.seek(info.offset)
        got = _read_into(f, memoryview(buffer))
    if got != info.nbytes:
        raise _error(
            info.file,
            f"file ends after {got} of the tensor's {info.nbytes} bytes (truncated since its "
            "header was read)",
            info.name,
        )
    return buffer.view(info.dtype).reshape(info.shape)


def _read_into(f: BinaryIO, view: memoryview) -> int:
    """Fill `view` from `f` and return the bytes read, fewer only at end of file.

    One read() returns at most about 2 GiB on Linux, less than an embedding table can hold.
    """
    filled = 0
    while filled < len(view):
        n = f.readinto(view[filled:])
        if not n:
            break
        filled += n
    return filled


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

    Output is deterministic. Tensors are ordered widest dtype first, then by name, as the reference
    writer does: every tensor then starts at a multiple of its itemsize (the header is padded to 8
    bytes), so readers can map it in place.
    """
    arrays = {name: np.asarray(array) for name, array in tensors.items()}
    order = sorted(arrays, key=lambda name: (-arrays[name].dtype.itemsize, name))
    header = _build_header(arrays, order, metadata)

    def write(f: BinaryIO) -> None:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for name in order:  # Converting one tensor at a time keeps at most one copy alive.
            f.write(_little_endian(arrays[name]).reshape(-1).view(np.uint8))

    write_atomically(path, write, binary=True)


def _dtype_name(tensor: str, dtype: np.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype.newbyteorder("<")]
    except KeyError:
        raise ValueError(f"tensor {tensor!r}: safetensors has no dtype for {dtype}") from None


def _little_endian(array: np.ndarray) -> np.ndarray:
    """`array` as C-contiguous little-endian data, copied only when it is not that already."""
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))


def _build_header(
    arrays: Mapping[str, np.ndarray], order: list[str], metadata: Mapping[str, str] | None
) -> bytes:
    if metadata and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("safetensors metadata must map strings to strings")
    if "__metadata__" in arrays:
        raise ValueError("'__metadata__' is reserved and cannot name a tensor")
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        array = arrays[name]
        header[name] = {
            "dtype": _dtype_name(name, array.dtype),
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


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
