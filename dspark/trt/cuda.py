"""The few CUDA runtime calls the GPU backend makes, through cuda-python (cuda.bindings.runtime), plus the
project's kernels (libdspark_kernels.so) through ctypes.

Everything the TensorRT backend does on the device goes through this one small object, so the data flow of that
backend can also be exercised against an in-process stand-in of the same interface (dspark.testing.gpu_emulator).
Pointers and stream/event handles are plain ints.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from dspark.errors import DSparkError
from dspark.lazy import LazyModule

# imported at first use, so CPU-only installs never load it
cudart = LazyModule("cuda.bindings.runtime", "the GPU backend needs cuda-python: pip install cuda-python")


def check(result):
    """cuda-python calls return (error, *values): raise on an error, return the value(s)."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise DSparkError(f"CUDA call failed: {err}")
    return rest[0] if len(rest) == 1 else (rest if rest else None)


class CudaRuntime:
    """cuda-python runtime API + the kernel library."""

    def __init__(self, kernels: Path | None = None):
        self._streams: dict[int, object] = {}
        self._events: dict[int, object] = {}
        self._graphs: dict[int, object] = {}
        self.kernels = None
        if kernels is not None:
            self.kernels = ctypes.CDLL(str(kernels))
            self.kernels.dspark_scatter_rows.restype = ctypes.c_int

    # memory
    def malloc(self, nbytes: int) -> int:
        return int(check(cudart.cudaMalloc(max(nbytes, 1))))

    def free(self, ptr: int) -> None:
        check(cudart.cudaFree(ptr))

    def host_alloc(self, nbytes: int) -> tuple[int, np.ndarray]:
        """Pinned (page-locked) host memory and a uint8 numpy view of it."""
        ptr = int(check(cudart.cudaMallocHost(max(nbytes, 1))))
        return ptr, np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr))

    def host_free(self, ptr: int) -> None:
        check(cudart.cudaFreeHost(ptr))

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """cudaMemcpyDefault: direction from the pointers (unified addressing)."""
        if nbytes:
            check(cudart.cudaMemcpyAsync(dst, src, nbytes, cudart.cudaMemcpyKind.cudaMemcpyDefault,
                                         self._streams[stream]))

    def memset(self, ptr: int, nbytes: int, stream: int) -> None:
        check(cudart.cudaMemsetAsync(ptr, 0, nbytes, self._streams[stream]))

    # streams and events
    def stream(self) -> int:
        stream = check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking))
        self._streams[int(stream)] = stream
        return int(stream)

    def event(self) -> int:
        event = check(cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming))
        self._events[int(event)] = event
        return int(event)

    def record(self, event: int, stream: int) -> None:
        check(cudart.cudaEventRecord(self._events[event], self._streams[stream]))

    def wait(self, stream: int, event: int) -> None:
        check(cudart.cudaStreamWaitEvent(self._streams[stream], self._events[event], 0))

    def sync_event(self, event: int) -> None:
        check(cudart.cudaEventSynchronize(self._events[event]))

    def sync_stream(self, stream: int) -> None:
        check(cudart.cudaStreamSynchronize(self._streams[stream]))

    def destroy_stream(self, stream: int) -> None:
        check(cudart.cudaStreamDestroy(self._streams.pop(stream)))

    def destroy_event(self, event: int) -> None:
        check(cudart.cudaEventDestroy(self._events.pop(event)))

    # CUDA graphs
    def capture(self, stream: int, launch) -> int:
        """Record what `launch()` enqueues on `stream` into an instantiated CUDA graph."""
        handle = self._streams[stream]
        check(cudart.cudaStreamBeginCapture(handle, cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal))
        try:
            launch()
        finally:
            graph = check(cudart.cudaStreamEndCapture(handle))
        graph_exec = check(cudart.cudaGraphInstantiate(graph, 0))
        self._graphs[int(graph_exec)] = graph_exec
        return int(graph_exec)

    def replay(self, graph_exec: int, stream: int) -> None:
        check(cudart.cudaGraphLaunch(self._graphs[graph_exec], self._streams[stream]))

    def destroy_graph(self, graph_exec: int) -> None:
        check(cudart.cudaGraphExecDestroy(self._graphs.pop(graph_exec)))

    # kernels
    def scatter_rows(self, src: int, dst: int, planes: int, src_batch: int, heads: int, src_rows: int,
                     dst_batch: int, dst_rows: int, width: int, index: int, n_entries: int, max_count: int,
                     stream: int) -> None:
        """`index` points to int64 [4, n_entries] on the device: source row, destination row, offset, count."""
        if self.kernels is None:
            raise DSparkError("the kernel library is not loaded")
        c_int = ctypes.c_int
        columns = [ctypes.c_void_p(index + k * n_entries * 8) for k in range(4)]
        status = self.kernels.dspark_scatter_rows(
            ctypes.c_void_p(src), ctypes.c_void_p(dst), c_int(planes), c_int(src_batch), c_int(heads),
            c_int(src_rows), c_int(dst_batch), c_int(dst_rows), c_int(width), *columns, c_int(n_entries),
            c_int(max_count), ctypes.c_void_p(stream))
        if status != 0:
            raise DSparkError(f"dspark_scatter_rows failed ({status})")
