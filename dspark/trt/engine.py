"""A TensorRT engine behind the same `run(feeds) -> outputs` interface as the ONNX Runtime graphs.

The straightforward executor `dspark doctor` uses for per-graph parity on recorded inputs: every input is copied
to the device, the engine runs on one stream, every output is copied back. Decoding goes through the streaming
backend (dspark.trt.stream), which keeps the decode state on the device.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark.errors import DSparkError
from dspark.trt.cuda import check as _check
from dspark.trt.stream import HostArray


class TrtGraph:
    def __init__(self, engine_path: Path, name: str, verify_positions: int | None = None):
        import tensorrt as trt
        from cuda.bindings import runtime as cudart

        self.trt, self.cudart = trt, cudart
        self.name = name
        logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(logger).deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self.engine is None:
            raise DSparkError(f"cannot load {engine_path} with TensorRT {trt.__version__} (built by another version?)")
        self.context = self.engine.create_execution_context()
        self.stream = _check(cudart.cudaStreamCreate())
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.verify_positions = verify_positions
        self.buffers: dict[str, tuple[int, int]] = {}  # name -> (device pointer, bytes)
        self.profile = -1

    def _buffer(self, name: str, nbytes: int) -> int:
        ptr, size = self.buffers.get(name, (0, 0))
        if nbytes > size:
            if ptr:
                _check(self.cudart.cudaFree(ptr))
            ptr = _check(self.cudart.cudaMalloc(max(nbytes, 1)))
            self.buffers[name] = (ptr, nbytes)
        return ptr

    def _pick_profile(self, feeds: dict) -> None:
        profile = 0
        if self.engine.num_optimization_profiles > 1 and "tokens" in feeds:
            profile = 1 if np.asarray(feeds["tokens"]).shape[1] <= (self.verify_positions or 0) else 0
        if profile != self.profile:
            self.context.set_optimization_profile_async(profile, self.stream)
            self.profile = profile

    def run(self, feeds: dict) -> dict[str, HostArray]:
        cudart = self.cudart
        h2d, d2h = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._pick_profile(feeds)
        keep = []
        for name in self.inputs:
            value = feeds[name]
            arr = np.ascontiguousarray(value.numpy() if hasattr(value, "numpy") and not isinstance(value, np.ndarray)
                                       else value)
            want = self.trt.nptype(self.engine.get_tensor_dtype(name))
            arr = arr.astype(want, copy=False)
            keep.append(arr)
            self.context.set_input_shape(name, arr.shape)
            ptr = self._buffer(name, arr.nbytes)
            _check(cudart.cudaMemcpyAsync(ptr, arr.ctypes.data, arr.nbytes, h2d, self.stream))
            self.context.set_tensor_address(name, ptr)
        results = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            out = np.empty(shape, dtype=self.trt.nptype(self.engine.get_tensor_dtype(name)))
            self.context.set_tensor_address(name, self._buffer(name, out.nbytes))
            results[name] = out
        if not self.context.execute_async_v3(self.stream):
            raise DSparkError(f"TensorRT execution of the {self.name} engine failed")
        for name, out in results.items():
            _check(cudart.cudaMemcpyAsync(out.ctypes.data, self.buffers[name][0], out.nbytes, d2h, self.stream))
        _check(cudart.cudaStreamSynchronize(self.stream))
        return {name: HostArray(out) for name, out in results.items()}
