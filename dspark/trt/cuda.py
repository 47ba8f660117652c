"""The few CUDA runtime calls the GPU backend makes, through cuda-python (cuda.bindings.runtime), plus the
project's kernels (libdspark_kernels.so) through ctypes.

Everything the streaming backend does on the device goes through this one small object, so the data flow of that
backend can also be exercised against an in-process stand-in of the same interface (tests/gpu_emulator.py).
Pointers and stream/event handles are plain ints.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from dspark.errors import DSparkError


def check(result):
    """cuda-python calls return (error, *values): raise on an error, return the value(s)."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise DSparkError(f"CUDA call failed: {err}")
    return rest[0] if len(rest) == 1 else (rest if rest else None)


class CudaRuntime:
    """cuda-python runtime API + the kernel library; import-guarded so CPU-only installs never load it."""

    def __init__(self, kernels: Path | None = None):
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            raise DSparkError("the GPU backend needs cuda-python: pip install cuda-python") from None
        self.rt = cudart
        self._streams: dict[int, object] = {}
        self._events: dict[int, object] = {}
        self._graphs: dict[int, object] = {}
        self.kernels = None
        if kernels is not None:
            self.kernels = ctypes.CDLL(str(kernels))
            self.kernels.dspark_scatter_rows.restype = ctypes.c_int

    # memory
    def malloc(self, nbytes: int) -> int:
        return int(check(self.rt.cudaMalloc(max(nbytes, 1))))

    def free(self, ptr: int) -> None:
        check(self.rt.cudaFree(ptr))

    def host_alloc(self, nbytes: int) -> tuple[int, np.ndarray]:
        """Pinned (page-locked) host memory and a uint8 numpy view of it."""
        ptr = int(check(self.rt.cudaMallocHost(max(nbytes, 1))))
        return ptr, np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr))

    def host_free(self, ptr: int) -> None:
        check(self.rt.cudaFreeHost(ptr))

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """cudaMemcpyDefault: direction from the pointers (unified addressing)."""
        if nbytes:
            check(self.rt.cudaMemcpyAsync(dst, src, nbytes, self.rt.cudaMemcpyKind.cudaMemcpyDefault,
                                        self._streams[stream]))

    def memset(self, ptr: int, nbytes: int, stream: int) -> None:
        check(self.rt.cudaMemsetAsync(ptr, 0, nbytes, self._streams[stream]))

    # streams and events
    def stream(self) -> int:
        s = check(self.rt.cudaStreamCreateWithFlags(self.rt.cudaStreamNonBlocking))
        self._streams[int(s)] = s
        return int(s)

    def event(self) -> int:
        e = check(self.rt.cudaEventCreateWithFlags(self.rt.cudaEventDisableTiming))
        self._events[int(e)] = e
        return int(e)

    def record(self, event: int, stream: int) -> None:
        check(self.rt.cudaEventRecord(self._events[event], self._streams[stream]))

    def wait(self, stream: int, event: int) -> None:
        check(self.rt.cudaStreamWaitEvent(self._streams[stream], self._events[event], 0))

    def sync_event(self, event: int) -> None:
        check(self.rt.cudaEventSynchronize(self._events[event]))

    def sync_stream(self, stream: int) -> None:
        check(self.rt.cudaStreamSynchronize(self._streams[stream]))

    def destroy_stream(self, stream: int) -> None:
        check(self.rt.cudaStreamDestroy(self._streams.pop(stream)))

    def destroy_event(self, event: int) -> None:
        check(self.rt.cudaEventDestroy(self._events.pop(event)))

    # CUDA graphs
    def capture(self, stream: int, launch) -> int:
        """Record what `launch()` enqueues on `stream` into an instantiated CUDA graph."""
        s = self._streams[stream]
        check(self.rt.cudaStreamBeginCapture(s, self.rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal))
        try:
            launch()
        finally:
            graph = check(self.rt.cudaStreamEndCapture(s))
        exe = check(self.rt.cudaGraphInstantiate(graph, 0))
        self._graphs[int(exe)] = exe
        return int(exe)

    def replay(self, exe: int, stream: int) -> None:
        check(self.rt.cudaGraphLaunch(self._graphs[exe], self._streams[stream]))

    def destroy_graph(self, exe: int) -> None:
        check(self.rt.cudaGraphExecDestroy(self._graphs.pop(exe)))

    # kernels
    def scatter_rows(self, src: int, dst: int, planes: int, src_batch: int, heads: int, src_rows: int,
                     dst_batch: int, dst_rows: int, width: int, index: int, n_entries: int, max_count: int,
                     stream: int) -> None:
        """`index` points to int64 [4, n_entries] on the device: source row, destination row, offset, count."""
        if self.kernels is None:
            raise DSparkError("the kernel library is not loaded")
        i = ctypes.c_int
        p = [ctypes.c_void_p(index + k * n_entries * 8) for k in range(4)]
        rc = self.kernels.dspark_scatter_rows(ctypes.c_void_p(src), ctypes.c_void_p(dst), i(planes), i(src_batch),
                                              i(heads), i(src_rows), i(dst_batch), i(dst_rows), i(width), *p,
                                              i(n_entries), i(max_count), ctypes.c_void_p(stream))
        if rc != 0:
            raise DSparkError(f"dspark_scatter_rows failed ({rc})")
