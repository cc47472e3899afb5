"""Reading and writing ``*.safetensors`` (single file or sharded with an index) with numpy, bf16 included.

The format: 8-byte little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``, then
the raw bytes. Reading memory-maps the file, so tensors are loaded only when asked for. A header is validated
on open, against the file's size before anything else is read: a corrupt or hostile file fails there with a
:class:`WeightsError` naming the file and the field, and no read is larger than the file.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import struct
from typing import Iterator, NamedTuple

import ml_dtypes
import numpy as np

from longspec_jax.config import is_int, read_json_object
from longspec_jax.errors import WeightsError

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the official reader's limit
_MAX_NDIM = 32  # numpy's limit (1.x)
INDEX_NAME = "model.safetensors.index.json"


class _Entry(NamedTuple):
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


def _read_header(path: str) -> tuple[dict, int, int]:
    """``(header, start of the data section, file size)``. The header length is checked against the file size
    before the header is read."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{path}: truncated safetensors file ({size} bytes, no 8-byte header length)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(_MAX_HEADER, size - 8):
                raise WeightsError(f"{path}: truncated or corrupt safetensors file "
                                   f"(header of {header_len} bytes in a {size}-byte file)")
            raw = f.read(header_len)
    except OSError as e:
        raise WeightsError(f"{path}: cannot read safetensors file: {e}") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise WeightsError(f"{path}: safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: safetensors header is a JSON {type(header).__name__}, not an object")
    return header, 8 + header_len, size


def _parse_entry(path: str, name: str, info) -> _Entry:
    """One tensor's header entry, checked: known dtype, a shape numpy can hold, ``0 <= begin <= end`` and a span
    of exactly ``prod(shape) * itemsize`` bytes."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise WeightsError(f"{where}: header entry is a JSON {type(info).__name__}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise WeightsError(f"{where}: unsupported dtype {reprlib.repr(dtype)}; supported: {', '.join(_DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > _MAX_NDIM
            or not all(is_int(d) and d >= 0 for d in shape)):
        raise WeightsError(f"{where}: shape {reprlib.repr(shape)} is not a list of at most {_MAX_NDIM} "
                           f"non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)):
        raise WeightsError(f"{where}: data_offsets {reprlib.repr(offsets)} is not a [begin, end] pair of integers")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise WeightsError(f"{where}: data_offsets [{begin}, {end}] are negative or reversed")
    itemsize = _DTYPES[dtype].itemsize
    if math.prod(max(d, 1) for d in shape) * itemsize >= 2 ** 63:  # Python ints: no overflow
        raise WeightsError(f"{where}: shape {reprlib.repr(shape)} {dtype} is too large for an array")
    expected = math.prod(shape) * itemsize
    if end - begin != expected:
        raise WeightsError(f"{where}: data_offsets span {end - begin} bytes, but shape {shape} {dtype} needs "
                           f"{expected}")
    return _Entry(_DTYPES[dtype], tuple(shape), begin, end)


def _check_spans(path: str, entries: dict[str, _Entry], data_start: int, size: int) -> None:
    """Every tensor lies inside the file, and no two tensors share a byte."""
    previous_name, previous_end = None, 0  # the tensor that ends last so far
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if data_start + entry.end > size:
            raise WeightsError(f"{path}: truncated safetensors file: tensor {name!r} ends at byte "
                               f"{data_start + entry.end} but the file has {size} bytes")
        if entry.begin < previous_end:
            raise WeightsError(f"{path}: tensors {previous_name!r} and {name!r} overlap: {name!r} starts at "
                               f"data offset {entry.begin}, before {previous_name!r} ends at {previous_end}")
        if entry.end > previous_end:
            previous_name, previous_end = name, entry.end


class SafetensorsFile:
    """One ``.safetensors`` file, validated on open; ``get(name)`` returns a read-only numpy view."""

    def __init__(self, path: str):
        self.path = path
        header, self._data_start, size = _read_header(path)
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not isinstance(metadata, dict):
            raise WeightsError(f"{path}: __metadata__ is a JSON {type(metadata).__name__}, not an object")
        self._entries = {name: _parse_entry(path, name, info) for name, info in header.items()}
        _check_spans(path, self._entries, self._data_start, size)

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def get(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        if entry.begin == entry.end:
            return np.zeros(entry.shape, entry.dtype)
        data = np.memmap(self.path, dtype=entry.dtype, mode="r", offset=self._data_start + entry.begin,
                         shape=(math.prod(entry.shape),))
        return data.reshape(entry.shape)


def _read_index(index_path: str) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's index: tensor name -> shard file name in the same folder."""
    index = read_json_object(index_path, WeightsError)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsError(f"{index_path}: malformed index: weight_map must be a non-empty object of "
                           f"tensor name -> shard file, got {reprlib.repr(weight_map)}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise WeightsError(f"{index_path}: malformed index: weight_map[{name!r}] = {reprlib.repr(shard)} "
                               f"is not a file name in the checkpoint's folder")
    return weight_map


class SafetensorsDir:
    """All tensors of a model directory: ``model.safetensors``, or shards listed by the index file."""

    def __init__(self, path: str):
        self.path = path
        index_path = os.path.join(path, INDEX_NAME)
        if os.path.isfile(index_path):
            weight_map = _read_index(index_path)
            shard_names = sorted(set(weight_map.values()))
        else:
            shard_names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            if not shard_names:
                raise WeightsError(f"no *.safetensors weights found in {path}")
            weight_map = None
        self._files: dict[str, SafetensorsFile] = {}
        for shard in shard_names:
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise WeightsError(f"{path}: shard {shard} named in {INDEX_NAME} is missing")
            self._files[shard] = SafetensorsFile(shard_path)
        self._where: dict[str, SafetensorsFile] = {}
        for shard, file in self._files.items():
            for name in file.keys():
                if name in self._where:
                    raise WeightsError(f"{path}: tensor {name!r} is stored in both "
                                       f"{os.path.basename(self._where[name].path)} and {shard}")
                self._where[name] = file
        if weight_map is not None:
            for name, shard in weight_map.items():
                if self._where.get(name) is not self._files[shard]:
                    raise WeightsError(f"{path}: tensor {name!r} is listed in {shard} but not stored there")

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def get(self, name: str) -> np.ndarray:
        return self._where[name].get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    """Writes ``tensors`` (numpy arrays, bf16 via ml_dtypes) as one safetensors file, keys sorted."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    arrays = {}
    for name in sorted(tensors):
        array = np.asarray(tensors[name], order="C")  # ascontiguousarray would make 0-d arrays 1-d
        if array.dtype not in _NAMES:
            raise WeightsError(f"cannot save tensor {name!r} of dtype {array.dtype} as safetensors")
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays[name] = array
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for array in arrays.values():
            f.write(array.tobytes())
