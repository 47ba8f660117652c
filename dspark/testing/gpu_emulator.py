"""An in-process stand-in for the CUDA runtime and TensorRT engines, to test the GPU backend's data flow on CPU.

What it checks is ours, not TensorRT's: that dspark.trt.backend.TrtBackend binds the right addresses and shapes,
keeps the caches and hand-offs on the "device", appends K/V and features at the right offsets, stays inside its
allocations (every device access is bounds-checked), stays inside the engines' optimization profiles (an
out-of-profile shape is refused, as TensorRT refuses it), and replays captured CUDA graphs with fresh contents at
fixed addresses.
"Device" memory is host memory; each engine runs its ONNX graph with ONNX Runtime on the bound buffers. Streams
run in issue order, so it cannot find missing synchronization: that needs the real device (bench/device_check.sh).
"""
from __future__ import annotations

import bisect
import ctypes
import weakref
from pathlib import Path

import numpy as np
import onnxruntime as ort

from dspark.bundle import GRAPHS, Manifest
from dspark.ops.scatter_rows.reference import scatter_rows
from dspark.trt.backend import TrtBackend
from dspark.trt.profiles import graph_profiles

ORT_TYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(bool)": np.bool_,
             "tensor(int32)": np.int32, "tensor(float16)": np.float16}


class EmulatedCuda:
    """The interface of dspark.trt.cuda.CudaRuntime over host memory, with every device access bounds-checked."""

    def __init__(self):
        self.device: dict[int, np.ndarray] = {}  # base pointer -> backing bytes
        self.bases: list[int] = []
        self.host: dict[int, np.ndarray] = {}
        self.graphs: dict[int, object] = {}
        self.counts = {"copy": 0, "scatter": 0, "capture": 0, "replay": 0, "malloc": 0, "free": 0}
        self.streams: set[int] = set()
        self.events: set[int] = set()
        self._next = 1

    def _id(self) -> int:
        self._next += 1
        return self._next

    def _check(self, ptr: int, nbytes: int) -> None:
        """A range that starts inside a device allocation must end inside it."""
        i = bisect.bisect_right(self.bases, ptr) - 1
        if i >= 0:
            base = self.bases[i]
            size = self.device[base].nbytes
            if base <= ptr < base + size and ptr + nbytes > base + size:
                raise AssertionError(f"device access [{ptr:#x}, +{nbytes}) overruns its allocation of {size} bytes")

    def view(self, ptr: int, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape))
        self._check(ptr, n * dtype.itemsize)
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * max(n * dtype.itemsize, 1)).from_address(ptr))
        return raw[:n * dtype.itemsize].view(dtype).reshape(shape)

    def malloc(self, nbytes: int) -> int:
        block = np.full(max(nbytes, 1), 0xAB, dtype=np.uint8)  # garbage, as fresh device memory would hold
        ptr = block.ctypes.data
        self.device[ptr] = block
        bisect.insort(self.bases, ptr)
        self.counts["malloc"] += 1
        return ptr

    def free(self, ptr: int) -> None:
        del self.device[ptr]
        self.bases.remove(ptr)
        self.counts["free"] += 1

    def host_alloc(self, nbytes: int):
        block = np.zeros(max(nbytes, 1), dtype=np.uint8)
        self.host[block.ctypes.data] = block
        return block.ctypes.data, block

    def host_free(self, ptr: int) -> None:
        del self.host[ptr]

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(dst, nbytes)
        self._check(src, nbytes)
        ctypes.memmove(dst, src, nbytes)
        self.counts["copy"] += 1

    def memset(self, ptr: int, nbytes: int, stream: int) -> None:
        self._check(ptr, nbytes)
        ctypes.memset(ptr, 0, nbytes)

    def stream(self) -> int:
        self.streams.add(self._id())
        return self._next

    def event(self) -> int:
        self.events.add(self._id())
        return self._next

    def destroy_stream(self, stream: int) -> None:
        self.streams.remove(stream)

    def destroy_event(self, event: int) -> None:
        self.events.remove(event)

    def live(self) -> dict[str, int]:
        """What has not been freed or destroyed yet."""
        return {"device": len(self.device), "pinned": len(self.host), "streams": len(self.streams),
                "events": len(self.events), "graphs": len(self.graphs)}

    def record(self, event: int, stream: int) -> None:
        pass

    def wait(self, stream: int, event: int) -> None:
        pass

    def sync_event(self, event: int) -> None:
        pass

    def sync_stream(self, stream: int) -> None:
        pass

    def capture(self, stream: int, launch) -> int:
        graph = self._id()
        # a real graph holds no reference to the objects that captured it
        self.graphs[graph] = weakref.WeakMethod(launch) if hasattr(launch, "__self__") else (lambda: launch)
        self.counts["capture"] += 1
        return graph

    def replay(self, graph: int, stream: int) -> None:
        self.graphs[graph]()()
        self.counts["replay"] += 1

    def destroy_graph(self, graph: int) -> None:
        del self.graphs[graph]

    def scatter_rows(self, src, dst, planes, src_batch, heads, src_rows, dst_batch, dst_rows, width, index,
                     n_entries, max_count, stream) -> None:
        table = self.view(index, (4, n_entries), np.int64)
        source = self.view(src, (planes, src_batch, heads, src_rows, width), np.float32)
        destination = self.view(dst, (planes, dst_batch, heads, dst_rows, width), np.float32)
        assert max_count == table[3].max()
        scatter_rows(source, destination, *table)
        self.counts["scatter"] += 1


class EmulatedContext:
    """A TensorRT execution context: profile limits enforced, the engine run on the bound addresses."""

    def __init__(self, engine: "EmulatedEngine"):
        self.engine = engine
        self.profile = 0
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.runs = 0
        self.binds = 0

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        self.profile = index
        self.shapes = {}
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        lo, _, hi = self.engine.profiles[self.profile].shapes[name]
        if len(shape) != len(lo) or any(not low <= dim <= high for low, dim, high in zip(lo, shape, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addresses[name] = ptr
        self.binds += 1
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        axes = {}
        for tensor in self.engine.spec.inputs:
            for dim, size in zip(tensor.shape, self.shapes[tensor.name]):
                if isinstance(dim, str):
                    axes[dim] = size
        spec = next(tensor for tensor in self.engine.spec.outputs if tensor.name == name)
        return tuple(dim if isinstance(dim, int) else axes[dim] for dim in spec.shape)

    def execute_async_v3(self, stream: int) -> bool:
        engine = self.engine
        feeds = {name: engine.read(self.addresses[name], self.shapes[name], engine.dtypes[name])
                 for name in engine.input_names}
        outputs = engine.session.run(None, feeds)
        for name, value in zip(engine.output_names, outputs):
            assert tuple(value.shape) == self.get_tensor_shape(name), name
            engine.write(self.addresses[name], np.ascontiguousarray(value, dtype=engine.dtypes[name]))
        self.runs += 1
        return True


class EmulatedEngine:
    """A TensorRT engine "built" with the given profiles: its ONNX graph on ONNX Runtime, reading and writing the
    emulated device memory."""

    def __init__(self, cuda: EmulatedCuda, folder: Path, manifest: Manifest, name: str, profiles):
        self.cuda, self.spec, self.profiles = cuda, manifest.graphs[name], profiles
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(Path(folder) / self.spec.file), options,
                                            providers=["CPUExecutionProvider"])
        self.input_names = [tensor.name for tensor in self.session.get_inputs()]
        self.output_names = [tensor.name for tensor in self.session.get_outputs()]
        self.dtypes = {tensor.name: np.dtype(ORT_TYPES[tensor.type])
                       for tensor in self.session.get_inputs() + self.session.get_outputs()}
        self.num_profiles = len(profiles)
        self.contexts: list[EmulatedContext] = []

    def read(self, ptr: int, shape, dtype) -> np.ndarray:
        return self.cuda.view(ptr, shape, dtype).copy()

    def write(self, ptr: int, value: np.ndarray) -> None:
        self.cuda.view(ptr, value.shape, value.dtype)[...] = value

    def io(self):
        return [(name, True, self.dtypes[name]) for name in self.input_names] + \
               [(name, False, self.dtypes[name]) for name in self.output_names]

    def context(self) -> EmulatedContext:
        self.contexts.append(EmulatedContext(self))
        return self.contexts[-1]


def emulated_backend(folder: Path, max_batch: int = 4, max_context: int = 96,
                     cuda_graphs: bool = False) -> tuple[TrtBackend, Manifest]:
    """A TrtBackend over emulated engines "built" with these profile limits; returns (backend, manifest)."""
    manifest = _engine_manifest(folder, max_batch, max_context)
    cuda = EmulatedCuda()
    profiles = graph_profiles(manifest, max_batch, max_context)
    engines = {name: EmulatedEngine(cuda, folder, manifest, name, profiles[name]) for name in GRAPHS}
    return TrtBackend(Path(folder), manifest, engines=engines, cuda=cuda, cuda_graphs=cuda_graphs), manifest


def _engine_manifest(folder: Path, max_batch: int, max_context: int) -> Manifest:
    """The bundle's manifest with the `tensorrt` section a build with these limits would record."""
    manifest = Manifest.read(Path(folder))
    manifest.tensorrt = {"max_batch": max_batch, "max_context": max_context}
    return manifest


class DeviceOrtEngine(EmulatedEngine):
    """For bench/device_check.sh: the same ONNX Runtime engine over REAL device memory (synchronous copies), so the
    TensorRT backend's cuda-python calls and kernels run on the GPU while the graphs run on the CPU."""

    def read(self, ptr: int, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        self.cuda.copy(out.ctypes.data, ptr, out.nbytes, self.stream)
        self.cuda.sync_stream(self.stream)
        return out

    def write(self, ptr: int, value: np.ndarray) -> None:
        self.cuda.copy(ptr, value.ctypes.data, value.nbytes, self.stream)
        self.cuda.sync_stream(self.stream)


def device_ort_backend(cuda, folder: Path, max_batch: int = 4, max_context: int = 96) -> tuple[TrtBackend, Manifest]:
    """A TrtBackend on the real device (cuda: dspark.trt.cuda.CudaRuntime) with ONNX Runtime engines."""
    manifest = _engine_manifest(folder, max_batch, max_context)
    profiles = graph_profiles(manifest, max_batch, max_context)
    engines = {name: DeviceOrtEngine(cuda, folder, manifest, name, profiles[name]) for name in GRAPHS}
    backend = TrtBackend(Path(folder), manifest, engines=engines, cuda=cuda)
    for engine in engines.values():
        engine.stream = backend.device.compute
    return backend, manifest
