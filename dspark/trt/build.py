"""`dspark-export build`: TensorRT engines for a bundle (TensorRT 10.x / 11.x Python API, imported on first use).

Steps per graph: (1) write a build copy of the ONNX model without the dspark function bodies, so the parser cannot
inline them and must create the registered plugin (onnx-tensorrt imports model-local functions before falling
back to plugins); (2) for TensorRT 11 and fp16/bf16, cast the matmuls first (networks are strongly typed);
(3) parse, then assert every dspark node became a plugin layer; (4) add the prefill/verify profiles, build,
serialize. Engines, the plugin library, the timing cache and a `tensorrt` manifest section go into the bundle.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import onnx
import onnx_ir as ir

from dspark.bundle import Manifest, sha256_file
from dspark.errors import DSparkError
from dspark.export.passes import cast_matmuls
from dspark.ops.confidence_truncate.onnx_function import DOMAIN
from dspark.ops.kernels import archs_for, build_kernel
from dspark.trt.cuda import cudart
from dspark.trt.profiles import Profile, graph_profiles
from dspark.trt.versions import TrtApi, import_tensorrt

PLUGIN_LIB = "libdspark_trt_plugin.so"


def find_plugin_library(bundle: Path, explicit: Path | None = None) -> Path:
    for candidate in [explicit, bundle / "engines" / PLUGIN_LIB, os.environ.get("DSPARK_TRT_PLUGIN")]:
        if candidate and Path(candidate).exists():
            return Path(candidate)
    raise DSparkError(f"the dspark TensorRT plugin library is not built: cmake -S dspark/ops/trt_plugin -B "
                      f"build/plugin -DTENSORRT_ROOT=... && cmake --build build/plugin, then pass --plugin "
                      f"build/plugin/{PLUGIN_LIB}")


def build_copy(bundle: Path, spec_file: str, work: Path, precision: str, api: TrtApi) -> Path:
    """The ONNX file the parser reads: dspark function bodies removed, matmuls cast when strongly typed."""
    model = ir.load(str(bundle / spec_file))
    for key in [k for k in model.functions if k[0] == DOMAIN]:
        del model.functions[key]
    if api.plan(precision)["cast_graph"]:
        cast_matmuls(model, precision)
    out = work / spec_file
    ir.save(model, str(out), external_data=f"{spec_file}.data")
    return out


def _network_flags(trt, api: TrtApi, precision: str) -> int:
    flags = 0
    for name in api.plan(precision)["network_flags"]:
        flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))
    return flags


def plugin_layer_count(trt, network) -> int:
    kinds = {getattr(trt.LayerType, kind) for kind in ("PLUGIN_V3", "PLUGIN_V2", "PLUGIN")
             if hasattr(trt.LayerType, kind)}
    return sum(1 for i in range(network.num_layers) if network.get_layer(i).type in kinds)


def build_engines(bundle: Path, precision: str = "fp16", max_batch: int = 8, max_context: int = 2048,
                  version_compatible: bool = False, timing_cache: Path | None = None, plugin: Path | None = None,
                  work_dir: Path | None = None, workspace_gb: float = 4.0) -> dict:
    trt = import_tensorrt()
    bundle = Path(bundle)
    manifest = Manifest.read(bundle)
    if manifest.quantized:
        raise DSparkError(f"{', '.join(manifest.quantized)} of {bundle} hold 8-bit MatMulNBits weights (ONNX Runtime "
                          f"CPU only); TensorRT needs the graphs as exported: build from a bundle that was not "
                          f"quantized")
    profiles = graph_profiles(manifest, max_batch, max_context)
    library = find_plugin_library(bundle, plugin)
    engines_dir = bundle / "engines"
    work = Path(work_dir or engines_dir / ".build")
    builder = EngineBuilder(trt, bundle, library, work, precision, version_compatible, workspace_gb)
    engines_dir.mkdir(exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    cache_bytes = Path(timing_cache).read_bytes() if timing_cache and Path(timing_cache).exists() else b""
    report = {"tensorrt": trt.__version__, "precision": precision, "max_batch": max_batch,
              "max_context": max_context, "version_compatible": version_compatible, "plugin_layers": {},
              "engines": {}, "profiles": {}}
    for name, spec in manifest.graphs.items():
        start = time.perf_counter()
        serialized, cache_bytes, report["plugin_layers"][name] = builder.build(name, spec.file, profiles[name],
                                                                               cache_bytes)
        path = engines_dir / f"{name}.plan"
        path.write_bytes(serialized)
        report["engines"][name] = {"file": f"engines/{name}.plan", "sha256": sha256_file(path),
                                   "onnx_sha256": spec.sha256, "build_s": round(time.perf_counter() - start, 1)}
        report["profiles"][name] = [{"name": profile.name, "shapes": {tensor: [list(shape) for shape in shapes]
                                                                      for tensor, shapes in profile.shapes.items()}}
                                    for profile in profiles[name]]
    shutil.copy2(library, engines_dir / PLUGIN_LIB)
    (engines_dir / "timing.cache").write_bytes(cache_bytes)
    if timing_cache:
        Path(timing_cache).write_bytes(cache_bytes)
    _finish(bundle, manifest, report)
    shutil.rmtree(work, ignore_errors=True)
    return report


class EngineBuilder:
    """One TensorRT builder with the plugin library loaded; builds the engine of one graph at a time."""

    def __init__(self, trt, bundle: Path, library: Path, work: Path, precision: str, version_compatible: bool,
                 workspace_gb: float):
        self.trt, self.bundle, self.library, self.work = trt, bundle, library, work
        self.precision, self.version_compatible, self.workspace_gb = precision, version_compatible, workspace_gb
        self.api = TrtApi.parse(trt.__version__)
        self.builder_flags = self.api.plan(precision)["builder_flags"]
        self.logger = trt.Logger(trt.Logger.WARNING)
        trt.init_libnvinfer_plugins(self.logger, "")
        trt.get_plugin_registry().load_library(str(library))
        self.builder = trt.Builder(self.logger)

    def build(self, name: str, spec_file: str, profiles: list[Profile], cache_bytes: bytes) -> tuple[bytes, bytes, int]:
        """The serialized engine, the timing cache after it, and its plugin layer count."""
        trt = self.trt
        network, parser, plugin_layers = self._parse(spec_file)  # the parser owns the weights until the build
        config = self.builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(self.workspace_gb * (1 << 30)))
        for flag in self.builder_flags:
            config.set_flag(getattr(trt.BuilderFlag, flag))
        if self.version_compatible:
            config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
        cache = config.create_timing_cache(cache_bytes)  # kept until the engine is built
        config.set_timing_cache(cache, ignore_mismatch=False)
        for profile in profiles:
            optimization_profile = self.builder.create_optimization_profile()
            for tensor, (lo, opt, hi) in profile.shapes.items():
                optimization_profile.set_shape(tensor, lo, opt, hi)
            config.add_optimization_profile(optimization_profile)
        serialized = self.builder.build_serialized_network(network, config)
        if serialized is None:
            raise DSparkError(f"TensorRT failed to build {name} (see the log above)")
        return bytes(serialized), bytes(config.get_timing_cache().serialize()), plugin_layers

    def _parse(self, spec_file: str) -> tuple:
        """The network of one graph, its parser and its plugin layer count; every dspark node must have become a
        plugin layer."""
        trt = self.trt
        network = self.builder.create_network(_network_flags(trt, self.api, self.precision))
        parser = trt.OnnxParser(network, self.logger)
        onnx_path = build_copy(self.bundle, spec_file, self.work, self.precision, self.api)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise DSparkError(f"TensorRT could not parse {spec_file}: {errors[:400]}")
        expected = _dspark_nodes(self.bundle / spec_file)
        found = plugin_layer_count(trt, network)
        if found < expected:
            raise DSparkError(f"{spec_file}: {expected} dspark node(s) but {found} plugin layer(s): the plugin was "
                              f"not used (is {self.library} a dspark plugin build for this TensorRT?)")
        return network, parser, found


def _finish(bundle: Path, manifest: Manifest, report: dict) -> None:
    """Record the plugin and the device, build the runtime kernels for it, write the manifest's section."""
    report["plugin"] = {"library": f"engines/{PLUGIN_LIB}", "name": "ConfidenceTruncate", "version": "1",
                        "namespace": "dspark"}
    report["device"] = _device_info()
    try:  # the GPU runtime's kernels (cache appends); without nvcc here the runtime builds them on first use
        build_kernel(bundle / "engines", archs=archs_for(report["device"]))
    except DSparkError as e:
        print(f"note: runtime kernels not built ({e}); dspark will build them on first use", file=sys.stderr)
    manifest.tensorrt = report
    manifest.write(bundle)


def _dspark_nodes(path: Path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return sum(1 for node in model.graph.node if node.domain == DOMAIN)


def _device_info() -> dict:
    try:
        _, props = cudart.cudaGetDeviceProperties(0)
        _, version = cudart.cudaRuntimeGetVersion()
        return {"name": props.name.decode() if isinstance(props.name, bytes) else str(props.name),
                "compute_capability": f"{props.major}.{props.minor}", "cuda_runtime": version}
    except Exception as e:  # cuda-python missing: the engines are still valid, only the record is thinner
        return {"unknown": f"{type(e).__name__}"}
