"""Reading and writing a graph's initializers one at a time, so that rewriting a real-size graph holds one weight
in memory, not the model.

A graph is loaded as a skeleton (load_skeleton: every big initializer stays an onnx_ir ExternalTensor, a reference
into a data file). `StoredWeights` reads one initializer as a NumPy array (a memory map of its bytes when external),
and `DataSink` appends arrays to a new data file and returns tensors that point into it; `DataSink.adopt` moves an
existing external initializer into the new file by copying its bytes in chunks.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir

from dspark.errors import DSparkError
from dspark.integrity import read_onnx

ALIGN = 64  # byte alignment of every tensor in a data file written here (memory maps, SIMD loads)
INLINE_BYTES = 1024  # smaller tensors stay in the graph's proto (ONNX Runtime reads shape inputs only from there)
COPY_CHUNK = 64 << 20


def load_skeleton(path: Path) -> ir.Model:
    """A graph without its external weights (they stay where they are: ExternalTensors, read only when asked for);
    one line if it is not ONNX.

    An initializer the file gives no value info keeps none. ir.load gives every initializer its tensor's type and
    shape, so a graph written back would describe each in its value_info, and a graph rewritten here would not be
    the file it was before but for the rewrite. Which ones the file describes is only in its proto: it is read with
    onnx (as ir.load itself does) and deserialized by onnx_ir."""
    proto = read_onnx(path)
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as e:  # a protobuf that parses but is no model onnx_ir can hold
        raise DSparkError(f"cannot read {path}: {str(e).splitlines()[0][:200]}") from None
    ir.external_data.set_base_dir(model.graph, Path(path).parent)
    described = {v.name for v in proto.graph.value_info}
    for value in model.graph.initializers.values():
        if value.name not in described and not value.is_graph_input():
            value.type, value.shape = None, None
    return model


def _span(tensor: ir.ExternalTensor) -> tuple[int, int]:
    """(offset, length) of an external tensor's bytes (length from its shape when the entry has none)."""
    length = tensor.length
    if length is None:
        length = int(np.prod(tensor.shape.numpy(), dtype=np.int64)) * tensor.dtype.itemsize
    return int(tensor.offset or 0), int(length)


class StoredWeights:
    """The initializers of a skeleton graph, read from the folder that holds its data files."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def data_file(self, value: ir.Value) -> Path:
        where = (self.folder / value.const_value.location).resolve()
        if self.folder.resolve() not in where.parents:
            raise DSparkError(f"initializer {value.name}: its data file {value.const_value.location!r} is outside "
                              f"the bundle")
        return where

    def array(self, value: ir.Value) -> np.ndarray:
        """The initializer's value (a read-only memory map for external data: nothing is read until used)."""
        tensor = value.const_value
        if not isinstance(tensor, ir.ExternalTensor):
            return tensor.numpy()
        dtype, shape = tensor.dtype.numpy(), tuple(tensor.shape.numpy())
        count = int(np.prod(shape)) if shape else 1
        offset, length = _span(tensor)
        path = self.data_file(value)
        if length != count * dtype.itemsize or offset + length > path.stat().st_size:
            raise DSparkError(f"initializer {value.name}: {length} bytes at {offset} of {path.name} do not hold "
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

    def point(self, value: ir.Value, offset: int, length: int) -> None:
        """Make the initializer `value` a reference to `length` bytes at `offset` of this file (compact re-points
        graphs too)."""
        value.const_value = self._tensor(value.name, value.const_value.dtype, value.const_value.shape.numpy(),
                                         offset, length)

    def _tensor(self, name: str, dtype: ir.DataType, shape, offset: int, length: int) -> ir.ExternalTensor:
        return ir.ExternalTensor(self.location, offset, length, dtype, shape=ir.Shape(list(shape)), name=name,
                                 base_dir=self.folder)

    def add(self, array: np.ndarray, name: str) -> ir.TensorProtocol:
        """A tensor holding `array`, its bytes in this file (in the proto when small)."""
        array = np.ascontiguousarray(array)
        if array.nbytes < INLINE_BYTES:
            return ir.tensor(array, name=name)
        offset = self._reserve()
        data = memoryview(array.reshape(-1).view(np.uint8)) if array.size else b""
        self.file.write(data)
        self.size += array.nbytes
        return self._tensor(name, ir.DataType.from_numpy(array.dtype), array.shape, offset, array.nbytes)

    def adopt(self, value: ir.Value, stored: StoredWeights) -> None:
        """Point an initializer of the skeleton at this file, copying its external bytes."""
        if not isinstance(value.const_value, ir.ExternalTensor):
            return
        source, (offset, length) = stored.data_file(value), _span(value.const_value)
        if length < INLINE_BYTES:
            value.const_value = ir.tensor(np.array(stored.array(value)), name=value.name)
            return
        with open(source, "rb") as f:
            self.point(value, self.copy(f, offset, length), length)

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
    skeletons = {g: load_skeleton(p) for g, p in graphs.items()}
    readers: dict[str, list[ir.Value]] = {}
    ranges: set[tuple[int, int]] = set()
    for g, model in skeletons.items():
        for value in model.graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor) and tensor.location == location:
                readers.setdefault(g, []).append(value)
                ranges.add(_span(tensor))
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
    for g, values in readers.items():
        for value in values:
            span = _span(value.const_value)
            sink.point(value, moved[span], span[1])
        graphs[g].unlink()  # (a hard link: replaced, not written)
        ir.save(skeletons[g], graphs[g])
    fresh.replace(path)
    return size - sink.size
