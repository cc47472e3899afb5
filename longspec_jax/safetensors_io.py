"""Reading and writing ``*.safetensors`` (single file or sharded with an index) with numpy, bf16 included.

The format: 8-byte little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``, then
the raw bytes. Reading memory-maps the file, so tensors are loaded only when asked for.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterator

import ml_dtypes
import numpy as np

from longspec_jax.errors import WeightsError

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"


class SafetensorsFile:
    """One ``.safetensors`` file, validated on open; ``get(name)`` returns a read-only numpy view."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise WeightsError(f"{path}: truncated safetensors file (no header)")
                (header_len,) = struct.unpack("<Q", head)
                if header_len > min(_MAX_HEADER, size - 8):
                    raise WeightsError(f"{path}: truncated or corrupt safetensors file "
                                       f"(header of {header_len} bytes in a {size}-byte file)")
                header = json.loads(f.read(header_len))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(f"{path}: cannot read safetensors header: {e}") from None
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        data_len = size - self._data_start
        for name, info in header.items():
            if info.get("dtype") not in _DTYPES:
                raise WeightsError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
            begin, end = info["data_offsets"]
            expected = int(np.prod(info["shape"], dtype=np.int64)) * _DTYPES[info["dtype"]].itemsize
            if end - begin != expected:
                raise WeightsError(f"{path}: tensor {name!r} has {end - begin} bytes, expected {expected} "
                                   f"for shape {info['shape']} {info['dtype']}")
            if end > data_len:
                raise WeightsError(f"{path}: truncated safetensors file: tensor {name!r} ends at byte "
                                   f"{self._data_start + end} but the file has {size} bytes")
        self._header = header

    def keys(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self._header[name]
        dtype = _DTYPES[info["dtype"]]
        begin, _ = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if count == 0:
            return np.zeros(info["shape"], dtype)
        data = np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + begin, shape=(count,))
        return data.reshape(info["shape"])


class SafetensorsDir:
    """All tensors of a model directory: ``model.safetensors``, or shards listed by the index file."""

    def __init__(self, path: str):
        self.path = path
        index_path = os.path.join(path, INDEX_NAME)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise WeightsError(f"{index_path}: malformed index ({e})") from None
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
