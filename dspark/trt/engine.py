"""One TensorRT engine driven through cuda-python: bound-once buffers, pinned double-buffered host I/O, optional
CUDA-graph replay; and loading a bundle's engines.

Device buffers are allocated per tensor (grown only when a larger shape arrives, i.e. during prefill) and bound with
set_tensor_address only when an address changes, so in steady state nothing is re-bound. Inputs the host writes
are staged in pinned, double-buffered host memory and uploaded on the copy stream; the engine runs on the compute
stream after the upload's event; the outputs the host reads (HOST_OUTPUTS) come back to pinned memory on the copy
stream after the compute event. Other outputs are returned as DeviceTensor handles that the next engine binds by
address. With `cuda_graphs`, each launch is captured into a CUDA graph per (profile, shapes, addresses) the second
time that key is seen and replayed afterwards.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.trt.memory import Device, DeviceTensor, HostArray, Staging
from dspark.trt.plugin import load_recorded_plugin
from dspark.trt.versions import import_tensorrt

HOST_VISIBLE = {  # graph -> (tensors the host writes, tensors the host reads) every step
    "verifier": ({"tokens", "logit_index", "verify_len", "temperature", "accept_noise", "sample_noise"},
                 {"accepted", "next_token"}),
    "draft": ({"ctx_count", "anchor"}, set()),
    "heads": ({"temperature", "draft_noise", "threshold", "budget", "mode", "layout"},
              {"draft_tokens", "verify_len", "survival"}),
}
# outputs the decode loop reads every step: downloaded to pinned memory after each run
HOST_OUTPUTS = {graph: outputs for graph, (_, outputs) in HOST_VISIBLE.items()}
MAX_GRAPHS = 64  # captured CUDA graphs kept per engine


class EngineRunner:
    """Runs one engine on the backend's device: `run(feeds) -> outputs`, the Graph interface of dspark.runtime."""

    def __init__(self, device: Device, engine, name: str, verify_positions: int | None = None,
                 cuda_graphs: bool = False):
        self.device, self.cuda, self.name = device, device.cuda, name
        self.engine = engine
        self.context = engine.context()
        io = engine.io()
        self.inputs = [tensor for tensor, is_input, _ in io if is_input]
        self.outputs = [tensor for tensor, is_input, _ in io if not is_input]
        self.dtypes = {tensor: np.dtype(dtype) for tensor, _, dtype in io}
        self.host_outputs = HOST_OUTPUTS.get(name, set())
        self.verify_positions = verify_positions
        self.cuda_graphs = cuda_graphs
        self.buffers: dict[str, tuple[int, int]] = {}  # tensor -> (device pointer, bytes)
        self.staging: dict[str, Staging] = {}
        self.bound: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.profile = -1
        self.calls = 0
        self.uploaded, self.computed, self.downloaded = (device.event() for _ in range(3))
        self.graphs: dict[tuple, int | None] = {}  # capture key -> instantiated graph (None: seen once)

    def run(self, feeds: dict) -> dict:
        cuda, device = self.cuda, self.device
        device.flush()
        self._pick_profile(feeds)
        parity = self.calls % 2
        self.calls += 1
        cuda.wait(device.copy, self.computed)  # the previous call of this engine has read its input buffers
        for name in self.inputs:
            self._feed(name, feeds[name], parity)
        cuda.record(self.uploaded, device.copy)
        cuda.wait(device.compute, self.uploaded)
        shapes = {}
        for name in self.outputs:
            shapes[name] = tuple(int(d) for d in self.context.get_tensor_shape(name))
            self._bind(name, self._buffer(name, int(np.prod(shapes[name])) * self.dtypes[name].itemsize))
        self._execute()
        cuda.record(self.computed, device.compute)
        cuda.wait(device.copy, self.computed)
        return self._results(shapes, parity)

    def _feed(self, name: str, value, parity: int) -> None:
        """Bind a device tensor where it lies; stage a host value in pinned memory and upload it."""
        if isinstance(value, DeviceTensor):
            if np.dtype(value.dtype) != self.dtypes[name]:
                raise DSparkError(f"{self.name}.{name}: device tensor of {value.dtype}, engine wants "
                                  f"{self.dtypes[name]}")
            self._shape(name, tuple(value.shape))
            self._bind(name, value.ptr)
            return
        array = np.asarray(value.numpy() if hasattr(value, "numpy") and not isinstance(value, np.ndarray) else value)
        host_ptr, stage = self.staging.setdefault(name, Staging(self.device)).view(parity, array.shape,
                                                                                  self.dtypes[name])
        stage[...] = array
        ptr = self._buffer(name, stage.nbytes)
        self.cuda.copy(ptr, host_ptr, stage.nbytes, self.device.copy)
        self._shape(name, array.shape)
        self._bind(name, ptr)

    def _results(self, shapes: dict[str, tuple[int, ...]], parity: int) -> dict:
        """Outputs the host reads come back through pinned memory; the others stay on the device."""
        results, pulls = {}, []
        for name in self.outputs:
            if name in self.host_outputs:
                host_ptr, stage = self.staging.setdefault(name, Staging(self.device)).view(parity, shapes[name],
                                                                                          self.dtypes[name])
                self.cuda.copy(host_ptr, self.bound[name], stage.nbytes, self.device.copy)
                pulls.append((name, stage))
            else:
                results[name] = self.device.tensor(self.bound[name], shapes[name], self.dtypes[name])
        if pulls:
            self.cuda.record(self.downloaded, self.device.copy)
            self.cuda.sync_event(self.downloaded)
            for name, stage in pulls:
                results[name] = HostArray(stage.copy())
        return results

    def _buffer(self, name: str, nbytes: int) -> int:
        ptr, size = self.buffers.get(name, (0, 0))
        if nbytes > size:  # grows during prefill; steady-state decode shapes fit after the first rounds
            if ptr:
                self.device.free(ptr)
            ptr = self.device.alloc(nbytes)
            self.buffers[name] = (ptr, nbytes)
        return ptr

    def _bind(self, name: str, ptr: int) -> None:
        if self.bound.get(name) != ptr:
            if not self.context.set_tensor_address(name, ptr):
                raise DSparkError(f"{self.name} engine: cannot bind {name}")
            self.bound[name] = ptr

    def _shape(self, name: str, shape: tuple[int, ...]) -> None:
        if self.shapes.get(name) != shape:
            if not self.context.set_input_shape(name, shape):
                raise DSparkError(f"{self.name} engine: input {name} shape {shape} is outside its optimization "
                                  f"profile (rebuild with a larger --max-batch / --max-context)")
            self.shapes[name] = shape

    def _pick_profile(self, feeds: dict) -> None:
        profile = 0
        if self.engine.num_profiles > 1 and "tokens" in feeds:
            profile = 1 if np.shape(feeds["tokens"])[1] <= (self.verify_positions or 0) else 0
        if profile != self.profile:
            self.context.set_optimization_profile_async(profile, self.device.compute)
            self.profile, self.shapes, self.bound = profile, {}, {}

    def _execute(self) -> None:
        launch = self._launch
        if self.cuda_graphs:
            key = (self.profile, tuple(sorted(self.shapes.items())), tuple(sorted(self.bound.items())))
            if key in self.graphs:
                if self.graphs[key] is None:  # second sighting: capture (the first ran eagerly, as TRT requires)
                    self.graphs[key] = self.cuda.capture(self.device.compute, launch)
                    self.device.handles["graph"].append(self.graphs[key])
                self.cuda.replay(self.graphs[key], self.device.compute)
                return
            if len(self.graphs) >= MAX_GRAPHS:  # addresses keep changing (new shapes): start the cache over
                self._drop_graphs()
            self.graphs[key] = None
        launch()

    def _drop_graphs(self) -> None:
        self.cuda.sync_stream(self.device.compute)
        for graph in self.graphs.values():
            if graph is not None:
                self.cuda.destroy_graph(graph)
                self.device.handles["graph"].remove(graph)
        self.graphs.clear()

    def _launch(self) -> None:
        if not self.context.execute_async_v3(self.device.compute):
            raise DSparkError(f"TensorRT execution of the {self.name} engine failed")


class TrtEngine:
    """A deserialized TensorRT engine behind the small interface EngineRunner uses."""

    def __init__(self, path: Path, runtime, trt):
        self.trt = trt
        self.engine = runtime.deserialize_cuda_engine(Path(path).read_bytes())
        if self.engine is None:
            raise DSparkError(f"cannot load {path} with TensorRT {self.trt.__version__} (built by another version?)")
        self.num_profiles = self.engine.num_optimization_profiles

    def io(self) -> list[tuple[str, bool, np.dtype]]:
        trt, engine = self.trt, self.engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        return [(name, engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT,
                 np.dtype(trt.nptype(engine.get_tensor_dtype(name)))) for name in names]

    def context(self):
        return self.engine.create_execution_context()


def load_trt_engines(folder: Path, manifest: Manifest) -> dict[str, TrtEngine]:
    """The plugin library and the bundle's engines (`dspark-export build`), loaded with the installed TensorRT."""
    section = manifest.tensorrt
    trt = import_tensorrt(section.get("flavor", "tensorrt"))
    load_recorded_plugin(trt, Path(folder), section.get("plugin", {}))
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    return {name: TrtEngine(Manifest.path(folder, spec["file"]), runtime, trt) for name, spec in section["engines"].items()}
