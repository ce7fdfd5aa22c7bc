"""Tests for the streaming safetensors reader and writer."""

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from k3text.checkpoint.safetensors_io import (
    INDEX_FILE,
    CheckpointError,
    SafetensorsCheckpoint,
    read_header,
    read_tensor,
    save_file,
    save_sharded,
)


def _sample_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "bf16": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        "f32": rng.standard_normal((4, 2)).astype(np.float32),
        "f16": rng.standard_normal(7).astype(np.float16),
        "f64": rng.standard_normal((2, 2, 2)),
        "u8": rng.integers(0, 256, 9, dtype=np.uint8),
        "i32": rng.integers(-(2**31), 2**31, (2, 3), dtype=np.int32),
        "i64": rng.integers(-(2**62), 2**62, 5, dtype=np.int64),
        "bool": rng.random((3, 3)) > 0.5,
        "fp8": rng.standard_normal(6).astype(ml_dtypes.float8_e4m3fn),
        "scalar": np.array(1.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=ml_dtypes.bfloat16),
    }


def _raw_file(path: Path, header: dict, data: bytes = b"") -> Path:
    """A safetensors file with an arbitrary, possibly invalid, header."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_round_trip_every_dtype(tmp_path):
    tensors = _sample_tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    checkpoint = SafetensorsCheckpoint(tmp_path)

    assert sorted(checkpoint.keys()) == sorted(tensors)
    for name, expected in tensors.items():
        got = checkpoint.read(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        np.testing.assert_array_equal(got, expected)
    assert len(checkpoint) == len(tensors) and "bf16" in checkpoint and "nope" not in checkpoint
    assert checkpoint.total_bytes() == sum(t.nbytes for t in tensors.values())
    assert checkpoint.bytes_by_dtype()["BF16"] == tensors["bf16"].nbytes


def test_writes_non_contiguous_and_big_endian_arrays(tmp_path):
    base = np.arange(12, dtype=">i4").reshape(3, 4)
    save_file({"t": base.T}, tmp_path / "x.safetensors")
    info = read_header(tmp_path / "x.safetensors")["t"]
    np.testing.assert_array_equal(read_tensor(info), base.T)


def test_output_is_deterministic_and_aligned(tmp_path):
    tensors = _sample_tensors()
    save_file(tensors, tmp_path / "a.safetensors")
    save_file(dict(reversed(tensors.items())), tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()

    raw = (tmp_path / "a.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert header_len % 8 == 0
    for info in read_header(tmp_path / "a.safetensors").values():
        assert info.offset % info.dtype.itemsize == 0, info.name
    assert not list(tmp_path.glob(".*.tmp")), "temporary file left behind"


def test_reads_files_written_by_reference_implementation(tmp_path):
    torch.manual_seed(0)
    reference = {
        "w_bf16": torch.randn(4, 6, dtype=torch.bfloat16),
        "w_fp8": torch.randn(8).to(torch.float8_e4m3fn),
        "b_f32": torch.randn(3),
        "ids": torch.arange(5, dtype=torch.int64),
    }
    safetensors.torch.save_file(reference, tmp_path / "model.safetensors")

    checkpoint = SafetensorsCheckpoint(tmp_path)
    assert checkpoint.read("w_bf16").dtype == ml_dtypes.bfloat16
    for name, tensor in reference.items():
        got = checkpoint.read(name)
        assert got.shape == tuple(tensor.shape), name
        if tensor.is_floating_point():
            np.testing.assert_array_equal(got.astype(np.float32), tensor.float().numpy())
        else:
            np.testing.assert_array_equal(got, tensor.numpy())


def test_reference_implementation_reads_our_files(tmp_path):
    tensors = _sample_tensors()
    save_file(tensors, tmp_path / "ours.safetensors", metadata={"format": "pt"})

    loaded = safetensors.torch.load_file(tmp_path / "ours.safetensors")
    assert loaded["bf16"].dtype == torch.bfloat16
    for name, expected in tensors.items():
        if expected.dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
            got = loaded[name].float().numpy()
            np.testing.assert_array_equal(got, expected.astype(np.float32))
        else:
            np.testing.assert_array_equal(loaded[name].numpy(), expected)
    with safetensors.safe_open(tmp_path / "ours.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_sharded_checkpoint(tmp_path):
    shards = [
        {"a": np.ones((2, 2), np.float32), "b": np.zeros(3, ml_dtypes.bfloat16)},
        {"c": np.arange(4, dtype=np.int32)},
    ]
    index = save_sharded(shards, tmp_path)

    weight_map = json.loads(index.read_text())["weight_map"]
    assert weight_map == {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
    }
    checkpoint = SafetensorsCheckpoint(tmp_path)
    assert checkpoint.info("c").file == tmp_path / "model-00002-of-00002.safetensors"
    np.testing.assert_array_equal(checkpoint.read("c"), np.arange(4))
    assert checkpoint.total_bytes() == json.loads(index.read_text())["metadata"]["total_size"]
    # Storage order: shard by shard, front to back within each.
    assert [checkpoint.info(n).file.name for n in checkpoint.keys()] == sorted(weight_map.values())
    with pytest.raises(KeyError, match="'zzz'"):
        checkpoint.info("zzz")


def test_unindexed_shards_are_all_read(tmp_path):
    save_file({"a": np.ones(2, np.float32)}, tmp_path / "part1.safetensors")
    save_file({"b": np.ones(3, np.float32)}, tmp_path / "part2.safetensors")
    assert SafetensorsCheckpoint(tmp_path).keys() == ["a", "b"]

    save_file({"a": np.ones(2, np.float32)}, tmp_path / "part3.safetensors")
    with pytest.raises(CheckpointError, match=r"part3\.safetensors: tensor 'a': also present in"):
        SafetensorsCheckpoint(tmp_path)


def test_header_is_read_without_touching_data(tmp_path):
    # 8 GiB of declared data in a sparse file: reading the header must not read any of it.
    big = 2**30
    path = _raw_file(
        tmp_path / "big.safetensors",
        {"small": _entry("F32", [2], 0, 8), "huge": _entry("F64", [big], 8, 8 + 8 * big)},
        np.array([1.0, 2.0], np.float32).tobytes(),
    )
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size + 8 * big)

    infos = read_header(path)
    assert infos["huge"].nbytes == 8 * big
    np.testing.assert_array_equal(read_tensor(infos["small"]), [1.0, 2.0])


def test_truncated_file_names_only_the_lost_tensors(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({name: np.ones(4, np.float32) for name in "abc"}, path)
    os.truncate(path, path.stat().st_size - 20)  # loses all 16 bytes of "c" and 4 of "b"

    with pytest.raises(CheckpointError) as caught:
        read_header(path)
    message = str(caught.value)
    assert str(path) in message and "tensor 'b'" in message
    assert "'b', 'c'" in message and "'a'" not in message


def test_file_truncated_after_opening(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}, path)
    checkpoint = SafetensorsCheckpoint(tmp_path)
    os.truncate(path, path.stat().st_size - 4)

    np.testing.assert_array_equal(checkpoint.read("a"), np.ones(4))
    with pytest.raises(CheckpointError, match=r"safetensors: tensor 'b': file ends after 12 of"):
        checkpoint.read("b")


@pytest.mark.parametrize(
    ("contents", "match"),
    [
        (b"\x01\x00", "only 2 bytes"),
        (struct.pack("<Q", 1000) + b"{}", "header length 1000 runs past the end"),
        (struct.pack("<Q", 9) + b'{"a": 1,,', "header is not valid UTF-8 JSON"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "header is not valid UTF-8 JSON"),
        (struct.pack("<Q", 2) + b"[]", "header is a JSON list, not an object"),
    ],
)
def test_corrupt_header(tmp_path, contents, match):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(contents)
    with pytest.raises(CheckpointError, match=match) as caught:
        read_header(path)
    assert str(caught.value).startswith(f"{path}: ")


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ({"w": _entry("F4", [2], 0, 1)}, "tensor 'w': unknown dtype 'F4'"),
        ({"w": _entry("F32", [2, 2], 0, 12)}, r"tensor 'w': data_offsets \[0, 12\] span 12 bytes"),
        ({"w": _entry("F32", [-1], 0, 0)}, r"tensor 'w': shape \[-1\] is not"),
        ({"w": _entry("F32", [1], 8, 4)}, "tensor 'w': data_offsets"),
        ({"w": {"dtype": "F32", "shape": [1]}}, "tensor 'w': data_offsets None"),
        ({"v": _entry("F32", [2], 0, 8), "w": _entry("F32", [1], 4, 8)}, "'w': data overlaps.*'v'"),
        ({"__metadata__": {"k": 1}}, "__metadata__ must map strings to strings"),
    ],
)
def test_invalid_tensor_entry(tmp_path, entries, match):
    path = _raw_file(tmp_path / "bad.safetensors", entries, bytes(16))
    with pytest.raises(CheckpointError, match=match) as caught:
        read_header(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_missing_shard(tmp_path):
    save_sharded([{"a": np.ones(1, np.float32)}, {"b": np.ones(1, np.float32)}], tmp_path)
    missing = tmp_path / "model-00002-of-00002.safetensors"
    missing.unlink()
    with pytest.raises(CheckpointError, match="shard file is missing") as caught:
        SafetensorsCheckpoint(tmp_path)
    assert str(missing) in str(caught.value) and "'b'" in str(caught.value)


def test_index_names_tensor_absent_from_its_shard(tmp_path):
    index = save_sharded([{"a": np.ones(1, np.float32)}], tmp_path)
    contents = json.loads(index.read_text())
    contents["weight_map"]["ghost"] = "model-00001-of-00001.safetensors"
    index.write_text(json.dumps(contents))
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE} places it in this shard") as caught:
        SafetensorsCheckpoint(tmp_path)
    assert "model-00001-of-00001.safetensors: tensor 'ghost'" in str(caught.value)


def test_corrupt_index(tmp_path):
    (tmp_path / INDEX_FILE).write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE}: index is not valid UTF-8 JSON"):
        SafetensorsCheckpoint(tmp_path)


def test_directory_without_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        SafetensorsCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        SafetensorsCheckpoint(tmp_path / "absent")


def test_save_rejects_unsupported_dtype(tmp_path):
    with pytest.raises(ValueError, match="tensor 'c': safetensors has no dtype for complex64"):
        save_file({"c": np.zeros(2, np.complex64)}, tmp_path / "x.safetensors")
    assert not list(tmp_path.iterdir()), "a failed save must leave no file behind"


@pytest.mark.parametrize(
    ("entries", "data", "match"),
    [
        # Refused by the library alone (the checks that explain a refusal find nothing).
        ({"v": _entry("F32", [1], 0, 4), "w": _entry("F32", [1], 8, 12)}, bytes(12),
         "invalid offset for tensor `w`"),
        ({"v": _entry("F32", [1], 0, 4)}, bytes(12), "file not fully covered"),
        # Accepted by the library, but numpy has no such dtype.
        ({"w": _entry("C64", [1], 0, 8)}, bytes(8), "tensor 'w': unknown dtype 'C64'"),
        ({"w": _entry("F4", [2], 0, 1)}, bytes(1), "tensor 'w': unknown dtype 'F4'"),
    ],
)
def test_what_only_the_library_checks_is_one_line_naming_the_file(tmp_path, entries, data,
                                                                   match):
    path = _raw_file(tmp_path / "bad.safetensors", entries, data)
    with pytest.raises(CheckpointError, match=match) as caught:
        read_header(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message


def test_any_library_failure_becomes_one_line_naming_the_file(tmp_path, monkeypatch):
    """A Rust panic reaches Python as pyo3's PanicException, a BaseException: caught too."""
    path = tmp_path / "model.safetensors"
    save_file({"a": np.ones(2, np.float32)}, path)

    class PanicException(BaseException):
        pass

    def panics(*args, **kwargs):
        raise PanicException("called `Option::unwrap()` on a `None` value\nnote: backtrace")

    monkeypatch.setattr(safetensors, "safe_open", panics)
    with pytest.raises(CheckpointError) as caught:
        read_header(path)
    assert str(caught.value) == (f"{path}: not a readable safetensors file (called "
                                 "`Option::unwrap()` on a `None` value note: backtrace)")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors, "safe_open", interrupted)
    with pytest.raises(KeyboardInterrupt):
        read_header(path)


def test_float8_tensors_and_their_truncation(tmp_path):
    """The library cannot hand float8 to numpy; they are read here, with the same checks."""
    path = tmp_path / "model.safetensors"
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal((3, 4)).astype(dtype) for name, dtype in
               [("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2),
                ("e8m0", ml_dtypes.float8_e8m0fnu)]}
    tensors["scalar"] = np.array(2.0, ml_dtypes.float8_e4m3fn)
    save_file(tensors, path)
    checkpoint = SafetensorsCheckpoint(tmp_path)
    for name, expected in tensors.items():
        got = checkpoint.read(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        np.testing.assert_array_equal(got.astype(np.float32), expected.astype(np.float32))
    last = max(checkpoint.keys(), key=lambda n: checkpoint.info(n).offset)
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(CheckpointError, match=f"tensor '{last}': file ends after 11 of the "
                                              "tensor's 12 bytes"):
        checkpoint.read(last)
