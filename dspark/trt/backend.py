"""The GPU backend of dspark.runtime: TensorRT engines driven through cuda-python, with device-resident state.

Same interface as the ONNX Runtime backend (dspark.runtime.backend.Backend: three graphs with `run(feeds) ->
outputs`, consumed by dspark.runtime.decoder.Decoder), but only small tensors cross the bus: the target and draft
KV caches, the draft's pending target features, the draft hidden states and the draft probabilities stay on the
device (dspark.trt.state); each engine binds its buffers once and moves only the tensors the host writes or reads,
through pinned double-buffered memory on a copy stream (dspark.trt.engine); all of it is allocated from one pool
per backend that the next decode of the same shapes gets back (dspark.trt.memory).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.ops.kernels import LIBRARY, archs_for, build_kernel
from dspark.resolve import cache_dir
from dspark.runtime.backend import Backend
from dspark.trt.cuda import CudaRuntime
from dspark.trt.engine import EngineRunner, load_trt_engines
from dspark.trt.memory import Device, DeviceTensor
from dspark.trt.state import DeviceKV, DeviceRows


class TrtBackend(Backend):
    """TensorRT engines of a bundle with device-resident decode state; plugs into Decoder like OrtBackend.

    `engines` and `cuda` default to the bundle's TensorRT engines and the cuda-python runtime; anything with the
    same small interface can stand in (the tests drive this class through dspark.testing.gpu_emulator).
    """

    kind = "tensorrt"
    options = ("cuda_graphs",)
    device_resident = True

    def __init__(self, folder: Path, manifest: Manifest, engines: dict | None = None, cuda=None,
                 cuda_graphs: bool = False):
        section = manifest.tensorrt
        if not section:
            raise DSparkError(f"{folder} has no engines: run dspark-export build {folder}")
        engines = engines or load_trt_engines(Path(folder), manifest)  # first: says so when TensorRT is missing
        if cuda is None:
            cuda = CudaRuntime(kernel_library(Path(folder), section))
        self.folder, self.manifest, self.engines, self.cuda_graphs = Path(folder), manifest, engines, cuda_graphs
        self.device = Device(cuda)
        self.fixed_capacity = int(section["max_context"])
        self.max_batch = int(section["max_batch"])
        self.block_size = manifest.block_size
        self.verifier = EngineRunner(self.device, engines["verifier"], "verifier", manifest.block_size + 1,
                                     cuda_graphs)
        self.draft = EngineRunner(self.device, engines["draft"], "draft", cuda_graphs=cuda_graphs)
        self.heads = EngineRunner(self.device, engines["heads"], "heads", cuda_graphs=cuda_graphs)
        self._siblings: list[TrtBackend] = []

    def lanes(self, n: int) -> list["TrtBackend"]:
        """This backend and n - 1 siblings on the same engines and CUDA context, each with its own streams,
        execution contexts and buffers: one per micro-batch of dspark.runtime.pingpong, so one lane's copies and
        host work overlap another's engines. Siblings are kept for the next call (and its captured graphs)."""
        while len(self._siblings) < n - 1:
            self._siblings.append(TrtBackend(self.folder, self.manifest, engines=self.engines,
                                             cuda=self.device.cuda, cuda_graphs=self.cuda_graphs))
        return [self, *self._siblings[:n - 1]]

    def kv_cache(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, what: str = "KV",
                 prefix: str = "past") -> DeviceKV:
        return DeviceKV(self.device, layers, batch, kv_heads, capacity, head_dim, what, prefix)

    def context_rows(self, batch: int, features: int) -> DeviceRows:
        return DeviceRows(self.device, batch, features, self.block_size + 1)

    def zeros(self, shape: tuple[int, ...], dtype=np.float32) -> DeviceTensor:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        zeros = self.device.tensor(0, shape, dtype)
        zeros.ptr = self.device.lease(zeros).alloc(nbytes, zero=True)
        return zeros


def kernel_library(folder: Path, section: dict) -> Path:
    """The runtime kernels ship with the engines (dspark-export build); else they are built once with nvcc."""
    shipped = folder / "engines" / LIBRARY
    if shipped.exists():
        return shipped
    archs = archs_for(section.get("device", {}))
    return build_kernel(cache_dir() / "kernels" / "-".join(archs), archs=archs)
