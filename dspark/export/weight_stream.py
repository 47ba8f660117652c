"""Reading and writing a graph's initializers one at a time, so that rewriting a real-size graph holds one weight
in memory, not the model.

A graph is loaded as a skeleton (onnx.load without external data: every big initializer is a reference into a data
file). `StoredWeights` reads one initializer as a NumPy array (a memory map of its bytes when external), and
`DataSink` appends arrays to a new data file and returns initializers that point into it; `DataSink.adopt` moves an
existing external initializer into the new file by copying its bytes in chunks.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dspark.errors import DSparkError

ALIGN = 64  # byte alignment of every tensor in a data file written here (memory maps, SIMD loads)
INLINE_BYTES = 1024  # smaller tensors stay in the graph's proto (ONNX Runtime reads shape inputs only from there)
COPY_CHUNK = 64 << 20


def _external(init: onnx.TensorProto) -> dict[str, str] | None:
    if init.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return {kv.key: kv.value for kv in init.external_data}


def _dtype(init: onnx.TensorProto) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type))


class StoredWeights:
    """The initializers of a skeleton graph, read from the folder that holds its data files."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def data_file(self, init: onnx.TensorProto) -> Path:
        ext = _external(init)
        where = (self.folder / ext["location"]).resolve()
        if self.folder.resolve() not in where.parents:
            raise DSparkError(f"initializer {init.name}: its data file {ext['location']!r} is outside the bundle")
        return where

    def array(self, init: onnx.TensorProto) -> np.ndarray:
        """The initializer's value (a read-only memory map for external data: nothing is read until used)."""
        ext = _external(init)
        if ext is None:
            return numpy_helper.to_array(init)
        dtype, shape = _dtype(init), tuple(init.dims)
        count = int(np.prod(shape)) if shape else 1
        offset, length = int(ext.get("offset", 0)), int(ext.get("length", count * dtype.itemsize))
        path = self.data_file(init)
        if length != count * dtype.itemsize or offset + length > path.stat().st_size:
            raise DSparkError(f"initializer {init.name}: {length} bytes at {offset} of {path.name} do not hold "
                              f"{shape} {dtype}")
        if count == 0:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


class DataSink:
    """A new external data file being written: each array appended once, aligned, and referenced by name."""

    def __init__(self, folder: Path, location: str):
        self.folder, self.location = Path(folder), location
        self.path = self.folder / location
        self.path.unlink(missing_ok=True)  # (a hard link to an old bundle's file is unlinked, never written)
        self.file = open(self.path, "wb")
        self.size = 0

    def _reserve(self) -> int:
        pad = -self.size % ALIGN
        if pad:
            self.file.write(b"\0" * pad)
            self.size += pad
        return self.size

    def _point(self, init: onnx.TensorProto, offset: int, length: int) -> onnx.TensorProto:
        init.ClearField("raw_data")
        del init.external_data[:]
        init.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(offset)), ("length", str(length))):
            init.external_data.add(key=key, value=value)
        return init

    def add(self, array: np.ndarray, name: str) -> onnx.TensorProto:
        """An initializer holding `array`, its bytes in this file (in the proto when small)."""
        array = np.ascontiguousarray(array)
        if array.nbytes < INLINE_BYTES:
            return numpy_helper.from_array(array, name)
        offset = self._reserve()
        data = memoryview(array.reshape(-1).view(np.uint8)) if array.size else b""
        self.file.write(data)
        self.size += array.nbytes
        init = onnx.TensorProto(name=name, dims=list(array.shape),
                                data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
        return self._point(init, offset, array.nbytes)

    def adopt(self, init: onnx.TensorProto, stored: StoredWeights) -> None:
        """Point an initializer of the skeleton at this file, copying its external bytes (in place)."""
        ext = _external(init)
        if ext is None:
            return
        source, offset = stored.data_file(init), int(ext.get("offset", 0))
        length = int(ext.get("length", source.stat().st_size - offset))
        if length < INLINE_BYTES:
            init.CopyFrom(numpy_helper.from_array(np.array(stored.array(init)), init.name))
            return
        at = self._reserve()
        with open(source, "rb") as f:
            f.seek(offset)
            left = length
            while left:
                chunk = f.read(min(left, COPY_CHUNK))
                if not chunk:
                    raise DSparkError(f"initializer {init.name}: {source.name} ends before its {length} bytes")
                self.file.write(chunk)
                left -= len(chunk)
        self.size += length
        self._point(init, at, length)

    def close(self) -> None:
        self.file.close()

