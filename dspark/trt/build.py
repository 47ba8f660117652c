"""`dspark-export build`: engines for a bundle with TensorRT 10/11 (`--flavor tensorrt`) or TensorRT for RTX 1.x
(`--flavor rtx`, whose ahead-of-time build needs no GPU), imported on first use.

Steps per graph: (1) write a build copy of the ONNX model without the dspark function bodies, so the parser cannot
inline them and must create the registered plugin (onnx-tensorrt imports model-local functions before falling
back to plugins); (2) on strongly typed networks (TensorRT 11, RTX) and fp16/bf16, cast the matmuls first;
(3) parse, then check that every dspark node became a dspark plugin layer and that the network's inputs and outputs
are the manifest's; (4) add the prefill/verify profiles (checked back), build, check the serialized engine names
every tensor, write it. The plugin is the C++ library when one is given, else the Python registration
(dspark.trt.plugin). Engines and a `tensorrt` manifest section (flavor, version, targets, plugin, profiles, I/O)
go into the bundle.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir

from dspark.bundle import GRAPHS, Manifest, sha256_file
from dspark.errors import DSparkError
from dspark.files import atomic_folder
from dspark.integrity import read_onnx
from dspark.export.trace.passes import cast_matmuls
from dspark.ops.confidence_truncate.onnx_function import DOMAIN
from dspark.ops.kernels import archs_for, build_kernel
from dspark.trt import network_checks as checks
from dspark.trt.buildable import not_buildable
from dspark.trt.cuda import cudart
from dspark.trt.plugin import (
    CONFIDENCE_TRUNCATE,
    load_recorded_plugin,
    register_python_plugin,
)
from dspark.trt.profiles import Profile, graph_profiles
from dspark.trt.versions import TrtApi, compute_targets, import_tensorrt, resolve_flavor, runs_on

PLUGIN_LIB = "libdspark_trt_plugin.so"
DEFAULT_RTX_TARGETS = ("80", "86", "89", "120", "121")  # SM75 (Turing) refuses fp32 GEMMs: ask for it explicitly


@dataclass
class BuildOptions:
    precision: str = "fp16"
    max_batch: int = 8
    max_context: int = 2048
    version_compatible: bool = False
    timing_cache: Path | None = None
    plugin: Path | None = None  # the C++ plugin library; None: the Python registration
    work_dir: Path | None = None
    workspace_gb: float | None = None  # None: TensorRT's default limit (the device's memory; 64 GiB for RTX AOT)
    flavor: str | None = None  # "tensorrt" | "rtx"; None: whichever is installed, TensorRT first
    compute_capabilities: tuple[str, ...] = ()  # RTX ahead-of-time targets (default DEFAULT_RTX_TARGETS)
    runtime_cache: str | None = None  # RTX: where the runtime keeps its JIT results (relative: to the bundle)
    kernels: bool = True  # also build the GPU runtime's kernel library with nvcc when it is there


def plugin_library(explicit: Path | None) -> Path | None:
    """The C++ plugin library to use: --plugin, else $DSPARK_TRT_PLUGIN, else None (the Python registration)."""
    candidate = explicit or os.environ.get("DSPARK_TRT_PLUGIN")
    if candidate is None:
        return None
    if not Path(candidate).is_file():
        raise DSparkError(f"plugin library {candidate} does not exist (build it: cmake -S dspark/ops/trt_plugin -B "
                          f"build/plugin -DTENSORRT_ROOT=... && cmake --build build/plugin)")
    return Path(candidate)


def register_plugin(trt, library: Path | None) -> dict:
    """Make dspark::ConfidenceTruncate creatable in this process; the manifest's `plugin` record."""
    decl = CONFIDENCE_TRUNCATE
    record = {"name": decl.name, "version": decl.version, "namespace": decl.namespace}
    if library is None:
        register_python_plugin(trt)
        return {**record, "implementation": "python", "module": "dspark.trt.plugin"}
    load_recorded_plugin(trt, library.parent, {"library": library.name})
    return {**record, "implementation": "c++", "library": f"engines/{PLUGIN_LIB}"}


def build_copy(bundle: Path, spec_file: str, work: Path, precision: str, api: TrtApi) -> Path:
    """The ONNX file the parser reads: dspark function bodies removed, matmuls cast when strongly typed."""
    path = Manifest.path(bundle, spec_file)
    model = ir.serde.deserialize_model(read_onnx(path, spec_file))
    ir.external_data.set_base_dir(model.graph, path.parent)
    for key in [k for k in model.functions if k[0] == DOMAIN]:
        del model.functions[key]
    if api.plan(precision)["cast_graph"]:
        cast_matmuls(model, precision)
    out = work / spec_file
    ir.save(model, str(out), external_data=f"{spec_file}.data")
    return out


def build_engines(bundle: Path, precision: str = "fp16", max_batch: int = 8, max_context: int = 2048,
                  version_compatible: bool = False, timing_cache: Path | None = None, plugin: Path | None = None,
                  work_dir: Path | None = None, workspace_gb: float | None = None, **more) -> dict:
    """Build and record the bundle's three engines; returns the manifest's new `tensorrt` section."""
    options = BuildOptions(precision, max_batch, max_context, version_compatible, timing_cache, plugin, work_dir,
                           workspace_gb, **more)
    bundle = Path(bundle)
    manifest = Manifest.read_checked(bundle)
    if reason := not_buildable(manifest):
        raise DSparkError(f"{bundle} is not buildable for TensorRT, because {reason}")
    flavor = resolve_flavor(options.flavor)
    library = plugin_library(options.plugin)
    trt = import_tensorrt(flavor.name)
    api = TrtApi.parse(trt.__version__, flavor.name)
    targets = _targets(api, options)
    profiles = graph_profiles(manifest, options.max_batch, options.max_context)
    report = {"flavor": flavor.name, "tensorrt": trt.__version__, "precision": options.precision,
              "max_batch": options.max_batch, "max_context": options.max_context, "targets": targets,
              "version_compatible": options.version_compatible, "runs_on": runs_on(flavor, targets),
              "plugin": register_plugin(trt, library), "plugin_layers": {}, "engines": {}, "profiles": {}}
    if api.flavor == "rtx":
        report["runtime_cache"] = options.runtime_cache or "engines/runtime.cache"
    with atomic_folder(bundle / "engines") as engines:  # a failed or killed build leaves engines/ as they were
        work = Path(options.work_dir or engines / ".build")
        builder = EngineBuilder(trt, api, bundle, work, options, targets, engines=engines)
        work.mkdir(parents=True, exist_ok=True)
        try:
            for name in GRAPHS:  # the portable graphs (their ONNX Runtime twins are its own)
                spec = manifest.graphs[name]
                report["engines"][name], report["plugin_layers"][name] = builder.build(name, spec, profiles[name])
                report["profiles"][name] = [{"name": profile.name, "shapes": {
                    tensor: [list(shape) for shape in shapes] for tensor, shapes in profile.shapes.items()}}
                    for profile in profiles[name]]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if library is not None:
            shutil.copy2(library, engines / PLUGIN_LIB)
        if builder.cache_bytes and options.timing_cache:
            Path(options.timing_cache).write_bytes(builder.cache_bytes)
        _finish(engines, report, options.kernels)
    manifest.tensorrt = report  # the new engines are in place: the manifest names them
    manifest.write(bundle)
    return report


def _targets(api: TrtApi, options: BuildOptions) -> list[str]:
    """RTX compute-capability targets (ComputeCapability names); [] for TensorRT, which builds for this GPU."""
    if not api.aot_targets:
        if options.compute_capabilities or options.runtime_cache:
            raise DSparkError("--compute-capability and --runtime-cache are for --flavor rtx (TensorRT builds for "
                              "the GPU it runs on)")
        return []
    cache = Path(options.runtime_cache or "engines/runtime.cache")
    if cache.is_absolute() or ".." in cache.parts:
        raise DSparkError(f"--runtime-cache {cache} must be a path inside the bundle (relative to it)")
    if options.timing_cache:
        raise DSparkError("TensorRT for RTX has no timing cache (its kernels are chosen on the user's GPU; give "
                          "--runtime-cache for those results instead)")
    return compute_targets(options.compute_capabilities or DEFAULT_RTX_TARGETS)


class EngineBuilder:
    """One builder with the plugin registered; builds, checks and writes the engine of one graph at a time."""

    def __init__(self, trt, api: TrtApi, bundle: Path, work: Path, options: BuildOptions, targets: list[str],
                 engines: Path | None = None):
        self.trt, self.api, self.bundle, self.work = trt, api, bundle, work
        self.engines = engines or bundle / "engines"  # where the plans go (a staging folder's, in build_engines)
        self.options, self.targets = options, targets
        self.logger = trt.Logger(trt.Logger.WARNING)
        if api.flavor == "tensorrt":
            trt.init_libnvinfer_plugins(self.logger, "")
        self.builder = trt.Builder(self.logger)
        timing = options.timing_cache
        self.cache_bytes = Path(timing).read_bytes() if timing and Path(timing).exists() else b""
        self.keep_networks = False  # keep each graph's network (and its parser, which owns the weights) to inspect
        self.parsed: dict[str, object] = {}
        self._parsers: dict[str, object] = {}

    def build(self, name: str, spec, profiles: list[Profile]) -> tuple[dict, int]:
        """The engine record of one graph (written to engines/NAME.plan) and its plugin layer count."""
        start = time.perf_counter()
        network, parser, plugins = self._parse(spec)  # the parser owns the weights until the build
        config = self._config()
        built = []
        for profile in profiles:
            optimization_profile = self.builder.create_optimization_profile()
            for tensor, (lo, opt, hi) in profile.shapes.items():
                optimization_profile.set_shape(tensor, lo, opt, hi)
            config.add_optimization_profile(optimization_profile)
            built.append((profile, optimization_profile))
        _refuse(checks.profile_problems(spec, built))
        serialized = self.builder.build_serialized_network(network, config)
        if serialized is None:
            raise DSparkError(f"{self.trt.__name__} failed to build {name} (see the log above)")
        plan = bytes(serialized)
        _refuse(checks.plan_problems(spec, plan))
        if self.api.timing_cache:
            self.cache_bytes = bytes(config.get_timing_cache().serialize())
        path = self.engines / f"{name}.plan"
        path.write_bytes(plan)
        if self.keep_networks:
            self.parsed[name], self._parsers[name] = network, parser
        return {"file": f"engines/{name}.plan", "sha256": sha256_file(path), "onnx_sha256": spec.sha256,
                "bytes": len(plan), "build_s": round(time.perf_counter() - start, 2),
                "io": [record.as_dict() for record in checks.network_io(self.trt, network)]}, len(plugins)

    def _config(self):
        trt, options = self.trt, self.options
        config = self.builder.create_builder_config()
        if options.workspace_gb is not None:  # 4 GiB was too little for SmolLM2's fp32 prefill at 8 x 2048
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gb * (1 << 30)))
        for flag in self.api.plan(options.precision)["builder_flags"]:
            config.set_flag(getattr(trt.BuilderFlag, flag))
        if options.version_compatible:
            config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
        if self.api.timing_cache:
            self._cache = config.create_timing_cache(self.cache_bytes)  # kept until the engine is built
            config.set_timing_cache(self._cache, ignore_mismatch=False)
        if self.targets:
            config.num_compute_capabilities = len(self.targets)
            for index, target in enumerate(self.targets):
                config.set_compute_capability(getattr(trt.ComputeCapability, target), index)
        return config

    def _parse(self, spec) -> tuple:
        """The network of one graph, its parser and its plugin layers; every dspark node must have become a
        dspark plugin layer, and the network's inputs and outputs must be the manifest's."""
        trt = self.trt
        _refuse(checks.node_problems(Manifest.path(self.bundle, spec.file), CONFIDENCE_TRUNCATE))
        flags = 0
        for flag in self.api.plan(self.options.precision)["network_flags"]:
            flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, flag))
        network = self.builder.create_network(flags)
        parser = trt.OnnxParser(network, self.logger)
        onnx_path = build_copy(self.bundle, spec.file, self.work, self.options.precision, self.api)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(" ".join(str(parser.get_error(i)).split()) for i in range(parser.num_errors))
            raise DSparkError(f"{trt.__name__} could not parse {spec.file}: {errors[:400]}")
        expected = checks.dspark_nodes(Manifest.path(self.bundle, spec.file))
        plugins = [layer for layer in checks.plugin_layers(trt, network)
                   if layer == f"{CONFIDENCE_TRUNCATE.namespace}::{CONFIDENCE_TRUNCATE.name}"]
        if len(plugins) != expected:
            raise DSparkError(f"{spec.file}: {expected} dspark node(s) but {len(plugins)} dspark plugin layer(s): "
                              f"the parser did not use the plugin")
        _refuse(checks.io_problems(spec, checks.network_io(trt, network)))
        return network, parser, plugins


def _refuse(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DSparkError(f"{problems[0]}{more}")


def _finish(engines: Path, report: dict, kernels: bool) -> None:
    """Record the device and build the runtime kernels for it."""
    report["device"] = _device_info()
    if kernels:  # the GPU runtime's kernels (cache appends); without nvcc the runtime builds them on first use
        archs = tuple(t.removeprefix("SM") for t in report["targets"]) or archs_for(report["device"])
        try:
            build_kernel(engines, archs=archs)
        except DSparkError as e:
            print(f"note: runtime kernels not built ({e}); dspark will build them on first use", file=sys.stderr)


def _device_info() -> dict:
    try:
        _, props = cudart.cudaGetDeviceProperties(0)
        _, version = cudart.cudaRuntimeGetVersion()
        return {"name": props.name.decode() if isinstance(props.name, bytes) else str(props.name),
                "compute_capability": f"{props.major}.{props.minor}", "cuda_runtime": version}
    except Exception as e:  # cuda-python missing or no driver: the engines are still valid, the record thinner
        return {"unknown": f"{type(e).__name__}"}
