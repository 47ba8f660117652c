"""ONNX Runtime (CPU) backend: one session per graph, inputs bound zero-copy, vocab-sized tensors kept as OrtValues."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from dspark.bundle import GraphSpec, Manifest
from dspark.errors import DSparkError
from dspark.runtime.backend import Backend
from dspark.runtime.kv import HostKV, HostRows


def session_options(threads: int | None = None, optimize: bool = True) -> ort.SessionOptions:
    """optimize=False keeps the graph as stored: a fp16/bf16 bundle's weights then stay at their precision in
    memory (each Cast to fp32 runs when used instead of being folded into a fp32 copy at load): half the memory,
    slower steps; what `dspark-export check` needs to record on a bundle larger than the machine's fp32 budget."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                     else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    opts.intra_op_num_threads = threads or os.cpu_count() or 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


class OrtGraph:
    def __init__(self, folder: Path, name: str, spec: GraphSpec, options: ort.SessionOptions):
        path = Manifest.path(folder, spec.file)
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types for bad files
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DSparkError(f"cannot load {path.name} ({name} graph): {first[:300]}") from None
        got_in = [i.name for i in self.session.get_inputs()]
        got_out = [o.name for o in self.session.get_outputs()]
        want_in = [t.name for t in spec.inputs]
        want_out = [t.name for t in spec.outputs]
        if got_in != want_in or got_out != want_out:
            raise DSparkError(f"{path.name} does not match the manifest: inputs {got_in} outputs {got_out}, "
                              f"manifest says {want_in} -> {want_out}")
        self.name = name
        self.outputs = want_out

    def run(self, feeds: dict[str, np.ndarray | ort.OrtValue]) -> dict[str, ort.OrtValue]:
        binding = self.session.io_binding()
        for k, v in feeds.items():
            if isinstance(v, ort.OrtValue):
                binding.bind_ortvalue_input(k, v)
            else:
                binding.bind_cpu_input(k, v)  # backed by the numpy buffer: no copy
        for k in self.outputs:
            binding.bind_output(k, "cpu")
        self.session.run_with_iobinding(binding)
        return dict(zip(self.outputs, binding.get_outputs()))


class OrtBackend(Backend):
    """The three graphs of a bundle on ONNX Runtime's CPU execution provider; caches, pending target features and
    graph hand-offs are host numpy arrays of any size (dspark.trt.backend.TrtBackend is the device twin)."""

    kind = "onnxruntime-cpu"
    options = ("threads", "optimize")

    def __init__(self, folder: Path, manifest: Manifest, threads: int | None = None, optimize: bool = True):
        opts = session_options(threads, optimize)
        self.verifier = OrtGraph(folder, "verifier", manifest.graphs["verifier"], opts)
        self.draft = OrtGraph(folder, "draft", manifest.graphs["draft"], opts)
        self.heads = OrtGraph(folder, "heads", manifest.graphs["heads"], opts)

    def kv_cache(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, what: str = "KV",
                 prefix: str = "past") -> HostKV:
        return HostKV(layers, batch, kv_heads, capacity, head_dim, what, prefix)

    def context_rows(self, batch: int, features: int) -> HostRows:
        return HostRows(batch, features)

    def zeros(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def close(self) -> None:
        for name in ("verifier", "draft", "heads"):
            self.__dict__.pop(name, None)
