"""ONNX Runtime (CPU) backend: one session per graph, inputs bound zero-copy, vocab-sized tensors kept as OrtValues."""
from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import numpy as np
import onnxruntime as ort

from dspark.bundle import WEIGHTS, GraphSpec, Manifest
from dspark.errors import DSparkError
from dspark.runtime.backend import ON_DEMAND, SAMPLING_INPUTS, SAMPLING_OUTPUTS, Backend, available_memory
from dspark.runtime.fused_verifier import FusedVerifier, lane_count
from dspark.runtime.kv import HostKV, HostRows


WEIGHT_MODES = ("auto", "packed", "mapped")
VERIFIERS = ("auto", "fused", "portable")
FIT_SHARE = 0.6  # auto packs the weights when their fp32 copy takes at most this share of the available memory
PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}  # bytes per stored weight (manifest.precision)


def session_options(threads: int | None = None, weights: str = "packed",
                    spin: bool = False) -> ort.SessionOptions:
    """weights="packed": a fp16/bf16 bundle's Casts are folded into fp32 copies and MatMul weights are prepacked
    at load (the fastest steps; one fp32 copy of every weight in process memory). "mapped": the weights are used
    where ONNX Runtime maps them from the bundle's data file, at their stored precision: nothing is copied at load,
    the mapped pages are shared by the three graphs (and by every process serving the bundle) and each widening
    Cast runs when its MatMul needs it, into memory freed right after (no arena: an arena keeps its high-water
    mark). What a bundle whose fp32 copy does not fit in memory runs with; slow: one AR step of SmolLM2 bf16 took
    105 ms mapped vs 38 ms packed (process memory 0.09 vs 0.74 GB), of a Qwen3-4B-shaped bf16 pair 4.4-6.5 s.

    spin: while a graph runs, its pool's threads spin between kernels instead of sleeping (a step is hundreds of
    short kernels, and waking a sleeping thread for each costs more than some of them), and stop spinning when
    the run ends (a bundle's graphs take turns: one graph's pool spinning after its run would take a core from the
    next). Faster where the process has the cores to itself (dspark serve); where other busy threads or processes
    share them, a spinning thread holds a core they need, so it is not the default."""
    _known_mode(weights, ("packed", "mapped"))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads or os.cpu_count() or 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    opts.add_session_config_entry("session.force_spinning_stop", "1")
    if weights == "mapped":
        opts.add_session_config_entry("session.disable_prepacking", "1")
        opts.add_session_config_entry("optimization.disable_specified_optimizers", "ConstantFolding")
        opts.enable_mem_pattern = False  # one planned block would hold every widened matrix at once
        opts.enable_cpu_mem_arena = False
    return opts


def weights_mode(folder: Path, manifest: Manifest, weights: str | None = "auto") -> str:
    """auto: packed when the bundle's weights, widened to fp32, take at most FIT_SHARE of the memory available
    now; mapped otherwise (a Qwen3-4B bf16 pair: 9.3 GB stored, 18.5 GB as fp32, on a 24 GB machine)."""
    if weights not in (None, "auto"):
        return _known_mode(weights, WEIGHT_MODES)
    available = available_memory()
    return "packed" if available is None or packed_bytes(folder, manifest) <= FIT_SHARE * available else "mapped"


def packed_bytes(folder: Path, manifest: Manifest) -> int:
    """What the packed sessions hold: the export's weights.data widened to fp32, every other data file (a quantized
    or fused graph's MatMulNBits blocks, which do not widen) once. A fused verifier's own file holds the portable
    verifier's q/k/v and gate/up blocks concatenated; when it takes every step (it has lanes, or its activations
    are quantized, so several requests run one by one on it) the portable session is never made, and those blocks
    count once.
    (Counting blocks twice made auto map a Qwen3-8B-shaped 4-bit bundle, whose unpacked MatMulNBits then ran an AR
    step in 36 s instead of 0.8.)"""
    skip = set()
    fused = manifest.graphs.get("verifier_fused")
    if fused is not None and (manifest.quantized_activations("verifier")
                              or lane_count([t.name for t in fused.inputs]) > 1):
        skip.add(Path(fused.file).name + ".data")
    total = 0
    for p in folder.iterdir():
        if p.is_file() and p.name.endswith(".data") and p.name not in skip:
            factor = 4 // PRECISION_BYTES.get(manifest.precision, 4) if p.name == WEIGHTS else 1
            total += p.stat().st_size * factor
    return total


def _known_mode(weights: str, allowed: tuple[str, ...]) -> str:
    if weights not in allowed:
        raise DSparkError(f"unknown weights mode {weights!r} (choose from {', '.join(WEIGHT_MODES)})")
    return weights


def _known_choice(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise DSparkError(f"unknown {what} {value!r} (choose from {', '.join(allowed)})")
    return value


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
        for got, want in zip([*self.session.get_inputs(), *self.session.get_outputs()], [*spec.inputs, *spec.outputs]):
            # a size the manifest fixes (the runtime sizes its buffers by it) must be the file's own fixed size
            if len(got.shape) != len(want.shape) or any(isinstance(w, int) and g != w
                                                        for g, w in zip(got.shape, want.shape)):
                raise DSparkError(f"{path.name} does not match the manifest: {got.name} is {list(got.shape)} in "
                                  f"the graph, {want.shape} in the manifest")
        self.name = name
        self.outputs = want_out
        self.inputs = want_in
        self.metadata = dict(self.session.get_modelmeta().custom_metadata_map)

    def binding(self, feeds: dict[str, np.ndarray | ort.OrtValue]) -> ort.IOBinding:
        """A binding with these inputs bound; run(binding=) binds the rest (and rebinds what it is given)."""
        return _bind_inputs(self.session.io_binding(), feeds)

    def run(self, feeds: dict[str, np.ndarray | ort.OrtValue], into: dict[str, np.ndarray] | None = None,
            fetch: list[str] | None = None, binding: ort.IOBinding | None = None) -> dict[str, ort.OrtValue]:
        """`into`: outputs written into these arrays (same shape, C-contiguous) instead of new memory; `fetch`:
        the other outputs wanted (default: all but those given on demand, the verifier's logits); `binding`: one
        from binding(), whose inputs stay bound (inputs that never change: binding hundreds of them costs ~2 us
        each per step)."""
        if binding is None:
            binding = self.binding(feeds)
        else:
            binding.clear_binding_outputs()
            _bind_inputs(binding, feeds)
        into = into or {}
        if fetch is None:
            fetch = [name for name in self.outputs if name not in ON_DEMAND]
        names = [*fetch, *(k for k in into if k not in fetch)]
        for k in names:
            if k in into:
                a = into[k]
                binding.bind_output(k, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
            else:
                binding.bind_output(k, "cpu")
        self.session.run_with_iobinding(binding)
        return dict(zip(names, binding.get_outputs()))


def _bind_inputs(binding: ort.IOBinding, feeds: dict[str, np.ndarray | ort.OrtValue]) -> ort.IOBinding:
    for k, v in feeds.items():
        if isinstance(v, ort.OrtValue):
            binding.bind_ortvalue_input(k, v)
        else:
            binding.bind_cpu_input(k, v)  # backed by the numpy buffer: no copy
    return binding


class OrtBackend(Backend):
    """The three graphs of a bundle on ONNX Runtime's CPU execution provider; caches, pending target features and
    graph hand-offs are host numpy arrays of any size (dspark.trt.backend.TrtBackend is the device twin)."""

    kind = "onnxruntime-cpu"
    options = ("threads", "weights", "verifier", "spin")

    def __init__(self, folder: Path, manifest: Manifest, threads: int | None = None, weights: str | None = "auto",
                 verifier: str | None = "auto", spin: bool | None = None):
        """verifier: "auto" runs the bundle's fused verifier when it has one (dspark-export fuse), "portable"
        never, "fused" insists on it. spin: session_options' (None: off)."""
        self.weights = weights_mode(folder, manifest, weights)
        opts = session_options(threads, self.weights, bool(spin))
        verifier = _known_choice(verifier or "auto", VERIFIERS, "verifier")
        if verifier == "fused" and "verifier_fused" not in manifest.graphs:
            raise DSparkError(f"bundle {folder} has no fused verifier; add one with `dspark-export fuse {folder}`")
        portable = partial(OrtGraph, folder, "verifier", manifest.graphs["verifier"], opts)
        if verifier != "portable" and "verifier_fused" in manifest.graphs:
            fused = OrtGraph(folder, "verifier_fused", manifest.graphs["verifier_fused"], opts)
            want = [f"present.{i}.{kind}" for i in range(manifest.target["num_layers"]) for kind in ("key", "value")]
            takes = [t.name for t in manifest.graphs["verifier"].inputs]
            if ([o for o in fused.outputs if o.startswith("present.")] != want
                    or [i for i in fused.inputs if not i.startswith("lane")] != takes):
                raise DSparkError(f"{manifest.graphs['verifier_fused'].file} is not a fused verifier of this bundle "
                                  f"(it must take the verifier's inputs and write present.* for every layer); "
                                  f"rebuild it with `dspark-export fuse {folder}`")
            self.verifier = FusedVerifier(fused, portable, alone=manifest.quantized_activations("verifier"))
        else:
            self.verifier = portable()
        self.draft = OrtGraph(folder, "draft", manifest.graphs["draft"], opts)
        # the sampler reads the logits of whichever verifier graph takes the step (a bundle before it: no logits)
        steps = ["verifier", "verifier_fused"] if isinstance(self.verifier, FusedVerifier) else ["verifier"]
        self.logits = all(any(o.name == "logits" for o in manifest.graphs[n].outputs) for n in steps)
        if "sampler" in manifest.graphs and self.logits:
            self.sampler = OrtGraph(folder, "sampler", manifest.graphs["sampler"], opts)
        self.heads = OrtGraph(folder, "heads", manifest.graphs["heads"], opts)
        if "heads_greedy" in manifest.graphs:
            self.heads_greedy = OrtGraph(folder, "heads_greedy", manifest.graphs["heads_greedy"], opts)
            if (self.heads_greedy.inputs != [n for n in self.heads.inputs if n not in SAMPLING_INPUTS]
                    or self.heads_greedy.outputs != [n for n in self.heads.outputs if n not in SAMPLING_OUTPUTS]):
                raise DSparkError(f"{manifest.graphs['heads_greedy'].file} is not the greedy heads graph of this "
                                  f"bundle (it must take the heads' inputs but temperature and draft_noise, and give "
                                  f"their outputs but draft_probs); rebuild it with `dspark-export fuse {folder}`")

    def prepare(self, max_batch: int) -> None:
        if max_batch > 1 and isinstance(self.verifier, FusedVerifier) and not self.verifier.alone \
                and self.verifier.lanes == 1 and not self.verifier.rows:
            self.verifier.portable  # multi-position steps of several requests run on it (0.8 s to load, fp32 SmolLM2)

    def kv_cache(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, what: str = "KV",
                 prefix: str = "past") -> HostKV:
        return HostKV(layers, batch, kv_heads, capacity, head_dim, what, prefix)

    def grouped_kv_cache(self, groups, batch: int, capacity: int, what: str = "KV", prefix: str = "past") -> HostKV:
        return HostKV(0, batch, 0, capacity, 0, what, prefix, groups=groups)

    def context_rows(self, batch: int, features: int) -> HostRows:
        return HostRows(batch, features)

    def zeros(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def close(self) -> None:
        for name in ("verifier", "draft", "heads", "heads_greedy"):
            self.__dict__.pop(name, None)
