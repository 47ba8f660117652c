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


def _span(init: onnx.TensorProto, ext: dict[str, str]) -> tuple[int, int]:
    """(offset, length) of an external initializer's bytes (length from its shape when the entry has none)."""
    length = ext.get("length")
    if length is None:
        length = int(np.prod(init.dims, dtype=np.int64)) * _dtype(init).itemsize
    return int(ext.get("offset", 0)), int(length)


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
        offset, length = _span(init, ext)
        path = self.data_file(init)
        if length != count * dtype.itemsize or offset + length > path.stat().st_size:
            raise DSparkError(f"initializer {init.name}: {length} bytes at {offset} of {path.name} do not hold "
                              f"{shape} {dtype}")
        if count == 0:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


class DataSink:
    """A new external data file being written: each array appended once, aligned, and referenced by name."""

    def __init__(self, folder: Path, location: str, path: Path | None = None):
        """Initializers will name `location` (in `folder`); the bytes go to `path` (default: that file), e.g. a
        temporary file that replaces it once complete."""
        self.folder, self.location = Path(folder), location
        self.path = path or self.folder / location
        self.path.unlink(missing_ok=True)  # (a hard link to an old bundle's file is unlinked, never written)
        self.file = open(self.path, "wb")
        self.size = 0

    def _reserve(self) -> int:
        pad = -self.size % ALIGN
        if pad:
            self.file.write(b"\0" * pad)
            self.size += pad
        return self.size

    def point(self, init: onnx.TensorProto, offset: int, length: int) -> onnx.TensorProto:
        """Make `init` a reference to `length` bytes at `offset` of this file (compact re-points graphs too)."""
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
        return self.point(init, offset, array.nbytes)

    def adopt(self, init: onnx.TensorProto, stored: StoredWeights) -> None:
        """Point an initializer of the skeleton at this file, copying its external bytes (in place)."""
        ext = _external(init)
        if ext is None:
            return
        source, (offset, length) = stored.data_file(init), _span(init, ext)
        if length < INLINE_BYTES:
            init.CopyFrom(numpy_helper.from_array(np.array(stored.array(init)), init.name))
            return
        with open(source, "rb") as f:
            self.point(init, self.copy(f, offset, length), length)

    def copy(self, f, offset: int, length: int) -> int:
        """Append `length` bytes of the open file f from `offset`, in chunks; returns where they now start."""
        at = self._reserve()
        f.seek(offset)
        left = length
        while left:
            chunk = f.read(min(left, COPY_CHUNK))
            if not chunk:
                raise DSparkError(f"{Path(f.name).name} ends before the {length} bytes at {offset} a graph reads")
            self.file.write(chunk)
            left -= len(chunk)
        self.size += length
        return at

    def close(self) -> None:
        self.file.close()



def compact(folder: Path, graphs: dict[str, Path], location: str, slack: int = 64 << 20) -> int:
    """Rewrite the shared data file `location` of a bundle folder with only the byte ranges its graphs still read
    (after quantizing, the shared file keeps every original weight the quantized graphs no longer read), and point
    the graphs (name -> .onnx path, rewritten when they read the file) at the new offsets. Files are replaced,
    never written in place (a hard link to another bundle's file stays as it was). Returns the bytes dropped; 0
    and nothing rewritten when under `slack` would be."""
    path = folder / location
    if not path.is_file():
        return 0
    skeletons = {g: onnx.load(str(p), load_external_data=False) for g, p in graphs.items()}
    readers: dict[str, list[onnx.TensorProto]] = {}
    ranges: set[tuple[int, int]] = set()
    for g, model in skeletons.items():
        for init in model.graph.initializer:
            ext = _external(init)
            if ext is not None and ext["location"] == location:
                readers.setdefault(g, []).append(init)
                ranges.add(_span(init, ext))
    size = path.stat().st_size
    if size - sum(length for _, length in ranges) < slack:
        return 0
    fresh = folder / f".{location}.compact"
    sink = DataSink(folder, location, fresh)
    try:
        with open(path, "rb") as f:
            moved = {r: sink.copy(f, *r) for r in sorted(ranges)}
    finally:
        sink.close()
    for g, inits in readers.items():
        for init in inits:
            span = _span(init, _external(init))
            sink.point(init, moved[span], span[1])
        graphs[g].unlink()  # (a hard link: replaced, not written)
        onnx.save(skeletons[g], str(graphs[g]))
    fresh.replace(path)
    return size - sink.size
